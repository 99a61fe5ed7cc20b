"""Start a small gloo process group on this machine, for tests and CPU demos.

    run_spawned(worker, world_size=2, args=(out_dir,), store_path=tmp / "store", timeout_s=120)
    run_under_torchrun(lambda group: work(group, args))   # a script started by torchrun

`worker(rank, world_size, store_path, *args)` must be a module-level function (spawn
pickles it by name). The group rendezvous uses a FileStore, not a TCP port: no free-port
race between concurrent test runs. A worker that hangs in a collective is killed at the
deadline and the call raises TimeoutError, so a mismatched collective fails a test instead
of blocking it.
"""

from __future__ import annotations

import gc
import importlib
import os
import sys
import time
import weakref
from pathlib import Path
from typing import Callable, TypeVar

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


T = TypeVar("T")


def _join_gloo(**init_kwargs) -> None:
    # torch 2.13: the first checkpoint imports torch._dynamo, which then keeps references to
    # an existing default group for the life of the process (10 of them, measured), so
    # close_gloo could not end its threads. Imported before the group exists, it keeps none.
    importlib.import_module("torch._dynamo")
    dist.init_process_group("gloo", **init_kwargs)


def init_gloo(rank: int, world_size: int, store_path) -> None:
    """Join the default group (gloo, one torch thread: ranks share the machine's cores).
    Reach it as `dist.group.WORLD`, and hold no reference to it past `close_gloo`."""
    torch.set_num_threads(1)
    _join_gloo(init_method=f"file://{os.fspath(store_path)}", rank=rank,
               world_size=world_size)


def run_under_torchrun(fn: Callable[[object], T]) -> T:
    """Join the gloo group torchrun set up (env://), run `fn(group)`, leave the group.

    For a script that torchrun starts and that owns its group from start to end (not
    spikeguard.train: parallel/launch.init_worker, which also serves the bench's reusable
    worker). Everything `fn` builds, models and guards (which reference the group through
    their dispatchers), lives in `fn`'s own frame and is unreachable once it returns, so
    close_gloo can end the group's threads before interpreter shutdown (pytorch/pytorch#179291:
    see close_gloo). A group destroyed while the caller's frame still held its models is
    what made scripts/calm_overhead.py abort after its table. `fn` must return no model or
    group, and must detach its guards: an attached guard's tensor hooks sit on the autograd
    nodes of its blocks' `last_aux_loss`, a cycle through C++ that gc.collect cannot break
    (torch 2.13), so the group would outlive the close as surely as if `fn` had returned
    the model. That is checked: a group still alive after the close is reported on stderr.

    On an exception nothing talks to the peers (no barrier: they may be inside a
    collective, waiting for this rank): it propagates, the rank exits with it, and torchrun
    stops the others. The torch thread count is the caller's (torchrun sets OMP to 1).
    """
    _join_gloo()
    group = weakref.ref(dist.group.WORLD)
    result = fn(dist.group.WORLD)
    close_gloo()
    if group() is not None:
        print(f"spikeguard: warning: rank {os.environ.get('RANK', '?')}'s process group "
              f"outlived its close (a model or an attached guard still refers to it): its "
              f"threads may abort the process at exit", file=sys.stderr, flush=True)
    return result


def close_gloo() -> None:
    """Leave the default group on the success path: barrier, destroy, and collect.

    A rank must not reach interpreter shutdown with the gloo group alive: its worker
    threads drop finished works whose tensors have Python objects, taking the GIL during
    finalization ends such a thread, and the rank dies with SIGABRT ("terminate called
    without an active exception", backtrace through ProcessGroupGloo::AsyncWork::~AsyncWork;
    torch 2.13, pytorch/pytorch#179291). `destroy_process_group` alone does not end the
    threads while anything still references the group: models do through their
    dispatchers, and an attached guard forms a reference cycle with its model. Collected
    here, while the interpreter is whole, the group's destructor joins its threads (5 per
    rank before, 2 after). Measured on a loaded 2-core machine: 27 of 40 two-rank runs
    aborted with barrier + destroy only, 0 of 30 with this and init_gloo's early import.
    The caller must hold no reference to the group or to a parallelized model here.
    """
    dist.barrier()
    dist.destroy_process_group()
    gc.collect()


def run_spawned(worker: Callable, world_size: int, args: tuple, store_path,
                timeout_s: float) -> None:
    """Run `worker` on `world_size` spawned ranks; raise if one fails or the deadline passes."""
    store_path = Path(store_path)
    if store_path.exists():
        store_path.unlink()  # a FileStore file left by an earlier group would be rejoined
    ctx = mp.spawn(worker, args=(world_size, os.fspath(store_path), *args), nprocs=world_size,
                   join=False)
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
        if time.monotonic() >= deadline:
            for proc in ctx.processes:
                if proc.is_alive():
                    proc.kill()
            for proc in ctx.processes:
                proc.join(5)
            raise TimeoutError(f"{world_size} ranks of {worker.__name__} did not finish "
                               f"within {timeout_s:.0f} s (a hung collective?)")


# What gloo and NCCL say in a surviving rank when a peer's process is gone.
PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
             "NCCL communicator was aborted")


def peer_failure(exc: BaseException) -> "BaseException | None":
    """The error of a broken collective in `exc` or what caused it (torch.distributed's
    pipelining wraps it: "[Stage 0] failed to run forward"), under torchrun only."""
    if "RANK" not in os.environ:
        return None
    seen = 0
    while exc is not None and seen < 16:
        if any(text in str(exc) for text in PEER_GONE):
            return exc
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return None
