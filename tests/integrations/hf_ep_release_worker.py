"""One torchrun rank of test_integrations_hf_ep_release.py.

    .venv/bin/python -m torch.distributed.run --nproc-per-node 2 \
        tests/integrations/hf_ep_release_worker.py OUT_DIR

The tiny Qwen3-MoE of hf_ep_worker.py under transformers' EP (fsdp 2, ep 2), guarded
(adaptive, unlimited budget), three steps. A dispatch mode tags every storage handed to a
collective by the op that took it, and counts those freed off the main thread: gloo's
worker thread dropping the last reference after the wait returned. Writes
OUT_DIR/release_rank<r>.json: those counts, by collective, and by whether spikeguard made
the call (its flag points' rows are the job's only int64 all-gathers).
"""

from __future__ import annotations

import json
import sys
import threading
import weakref
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hf_ep_worker import HUGE, batches, build, run  # noqa: E402

import spikeguard  # noqa: E402

NAMESPACES = ("c10d", "_c10d_functional")


class HandedOff(TorchDispatchMode):
    """Storages handed to a collective, and those of them freed on another thread."""

    def __init__(self):
        super().__init__()
        self.main = threading.get_ident()
        self.refs: dict[int, weakref.ref] = {}
        self.late: dict[str, int] = {}

    def _freed(self, key: int, what: str) -> None:
        self.refs.pop(key, None)
        if threading.get_ident() != self.main:
            self.late[what] = self.late.get(what, 0) + 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace in NAMESPACES:
            for t in tree_leaves((args, kwargs or {})):
                if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                    self._tag(t, func)
        return func(*args, **(kwargs or {}))

    def _tag(self, t: torch.Tensor, func) -> None:
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self.refs:
            return
        flag = func.overloadpacket.__name__ == "_allgather_base_" and t.dtype == torch.int64
        what = "flag point" if flag else str(func.overloadpacket.__name__)
        self.refs[key] = weakref.ref(storage, lambda _, key=key, what=what: self._freed(key, what))


def main() -> None:
    out_dir = Path(sys.argv[1])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    model = build()
    guard = spikeguard.attach(model, budget=HUGE, policy="adaptive")
    mode = HandedOff()
    with mode:
        for step in range(3):
            run(model, batches(step), guard)
    dist.barrier()
    (out_dir / f"release_rank{dist.get_rank()}.json").write_text(json.dumps(mode.late))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
