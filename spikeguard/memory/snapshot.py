"""Memory snapshots: what the device held when it ran out, for a person to look at.

    guard = spikeguard.attach(model, budget=..., memory_snapshot="runs/snapshots")
    spikeguard train ... --memory-snapshot runs/snapshots

Every out-of-memory the guard meets (one that its safety net then re-runs, and one that
ends the run) leaves one file, written at the refusal, before the failed attempt is
freed, so it shows what was live when the allocation was refused:

- **CUDA**: from attach on, the caching allocator records its own history
  (`torch.cuda.memory._record_memory_history`: the last `MAX_ENTRIES` allocations and
  frees with their Python stacks, a ring, so the steps before a spike are in it too), and
  the file is `torch.cuda.memory._snapshot()` pickled: the format
  `torch.cuda.memory._dump_snapshot` writes, that torchtitan's
  `--profiling.enable_memory_snapshot` writes and https://pytorch.org/memory_viz reads.
  Recording stops at `detach()`.
- **CPU** (the emulated device keeps no history): the nearest equivalent, a JSON of the
  device's own figures at the refusal (in use, peak, budget, the allocation refused and
  what it would have made), and, once the failing op's temporaries have gone, what is in
  use with the ledger's attribution of it by (micro-batch, layer, op) and what it does
  not attribute.

Files are named `step{S:06d}-rank{R}-oom.{pickle|json}` (`S` the step's index in
`guard.history`, `R` the process's rank, 0 alone); an existing file is never replaced
(`-2`, `-3`, ... are added). The error the guard raises or re-runs carries the path in
`memory_snapshot`.
"""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path
from typing import Optional

import torch

MAX_ENTRIES = 100_000   # allocator events kept (a ring): a few steps of a large model
SNAPSHOT_FORMAT = 1     # of the CPU JSON


def process_rank() -> int:
    """This process's rank in the default group (0 without one)."""
    import torch.distributed as dist
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def create_exclusively(folder: Path, stem: str, suffix: str):
    """A new file `folder/stem.suffix` (or `stem-2.suffix`, ...) opened for binary writing;
    never one that exists (O_EXCL: a racing rank cannot take the same name either)."""
    for n in range(1, 10_000):
        path = folder / (f"{stem}{suffix}" if n == 1 else f"{stem}-{n}{suffix}")
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            continue
        return path, os.fdopen(fd, "wb")
    raise FileExistsError(f"{folder}/{stem}{suffix}: 9999 files of that name already")


class NoSnapshots:
    """No `memory_snapshot` given: nothing recorded, nothing written."""

    folder = None

    def taken(self, err: BaseException, oom, step: int, attribution) -> Optional[str]:
        return None

    def stop(self) -> None:
        pass


class MemorySnapshots:
    """Records the device's history (CUDA) and writes one file per out-of-memory."""

    def __init__(self, folder, meter, budget_bytes: int):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.meter, self.budget_bytes = meter, budget_bytes
        self.recording = False
        if meter.is_cuda:
            torch.cuda.memory._record_memory_history(max_entries=MAX_ENTRIES, stacks="python")
            self.recording = True

    def stop(self) -> None:
        """Stop the allocator's recording (detach)."""
        if self.recording:
            torch.cuda.memory._record_memory_history(enabled=None)
            self.recording = False

    def taken(self, err: BaseException, oom, step: int, attribution) -> Optional[str]:
        """The snapshot of the refusal `err` (the allocator's error; `oom` the guard's
        one-line error of it): written once per refusal however often the guard turns it
        into its error; its path is set on both. `attribution()`: the ledger's live bytes
        by (micro-batch, layer, op), asked only on CPU."""
        for e in (oom, err):
            path = getattr(e, "memory_snapshot", None)
            if path is not None:
                oom.memory_snapshot = path
                return path
        stem = f"step{step:06d}-rank{process_rank()}-oom"
        if self.meter.is_cuda:
            path, f = create_exclusively(self.folder, stem, ".pickle")
            with f:
                pickle.dump(torch.cuda.memory._snapshot(), f)
        else:
            path, f = create_exclusively(self.folder, stem, ".json")
            with f:
                f.write(json.dumps(self.cpu_record(step, oom, attribution()), indent=1).encode())
        for e in (oom, err):
            try:
                e.memory_snapshot = str(path)
            except AttributeError:   # an error type without a __dict__: the guard's has one
                pass
        return str(path)

    def cpu_record(self, step: int, oom, attribution: dict) -> dict:
        """The emulated device at the refusal: its figures, and the live bytes by place."""
        asked, after = self.meter.last_refusal()
        in_use = self.meter.allocated()
        places = [{"micro_batch": mb, "layer": layer, "op": op, "bytes": n}
                  for (mb, layer, op), n in sorted(attribution.items()) if n]
        attributed = sum(p["bytes"] for p in places)
        return {"format": SNAPSHOT_FORMAT, "device": "cpu (emulated)", "step": step,
                "rank": process_rank(), "error": str(oom), "budget_bytes": self.budget_bytes,
                # At the refusal: what was in use, what was asked, what it would have made.
                "in_use_at_refusal_bytes": after - asked, "refused_request_bytes": asked,
                "refused_would_be_bytes": after, "peak_bytes": self.meter.peak(),
                # Now, as the failed op's own temporaries have gone (the attempt's graph
                # and saved tensors not yet: the attribution is of those).
                "allocated_bytes": in_use, "attributed_bytes": attributed,
                "unattributed_bytes": in_use - attributed, "attributed": places}


def memory_snapshots(folder, meter, budget_bytes: int):
    """`attach`'s `memory_snapshot` argument as the object the guard calls."""
    if folder is None:
        return NoSnapshots()
    return MemorySnapshots(folder, meter, budget_bytes)
