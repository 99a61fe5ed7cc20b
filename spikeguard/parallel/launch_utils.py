"""Start a small gloo process group on this machine, for tests and CPU demos.

    run_spawned(worker, world_size=2, args=(out_dir,), store_path=tmp / "store", timeout_s=120)

`worker(rank, world_size, store_path, *args)` must be a module-level function (spawn
pickles it by name). The group rendezvous uses a FileStore, not a TCP port: no free-port
race between concurrent test runs. A worker that hangs in a collective is killed at the
deadline and the call raises TimeoutError, so a mismatched collective fails a test instead
of blocking it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def init_gloo(rank: int, world_size: int, store_path) -> dist.ProcessGroup:
    """Join the default group (gloo, one torch thread: ranks share the machine's cores)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{os.fspath(store_path)}",
                            rank=rank, world_size=world_size)
    return dist.group.WORLD


def close_gloo(group: dist.ProcessGroup) -> None:
    """Leave the group cleanly: a barrier, then destroy it. Call on the success path.

    Without the barrier a rank intermittently dies with SIGABRT ("terminate called without
    an active exception") after its work is done: a gloo worker thread drops the last
    collective's work, whose tensors have Python objects, while the interpreter is being
    finalized, and taking the GIL then ends the thread (backtrace through
    ProcessGroupGloo::AsyncWork::~AsyncWork, torch 2.13; pytorch/pytorch#179291 describes
    it). The barrier's work holds no Python tensor, and gloo runs works in order, so once
    it returns the earlier works are released.
    """
    dist.barrier(group)
    dist.destroy_process_group()


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
