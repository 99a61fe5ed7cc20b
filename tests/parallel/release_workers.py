"""Spawned rank function for test_parallel_release.py (importable by the child processes).

Counts the storages freed off the main thread once the call that made them has returned:
a dispatch mode puts a weakref with a callback on every storage an op makes (the
callback runs on the thread that frees it), independent of spikeguard.parallel.release,
which only waits. (A storage gloo frees on its thread while the call still waits for it
is not late: nothing of the step runs meanwhile.)
"""

from __future__ import annotations

import threading
import time
import weakref
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single, all_to_all_single_autograd
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from spikeguard.parallel.launch_utils import close_gloo, init_gloo
from spikeguard.parallel.release import released, use_count


class OffThread(TorchDispatchMode):
    """Counts, per `kind`, the storages made while entered and freed on another thread
    after the call that made them returned (`returned`)."""

    def __init__(self):
        super().__init__()
        self.main = threading.get_ident()
        self.kind = ""
        self.returned = False
        self.late: dict[str, int] = {}
        self.refs: dict[int, weakref.ref] = {}

    def _freed(self, key: int, kind: str) -> None:
        self.refs.pop(key, None)
        if threading.get_ident() != self.main and self.returned:
            self.late[kind] = self.late.get(kind, 0) + 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                storage = t.untyped_storage()
                key = storage._cdata
                if key not in self.refs:
                    self.refs[key] = weakref.ref(
                        storage, lambda _, key=key, kind=self.kind: self._freed(key, kind))
        return out


def release_worker(rank: int, world_size: int, store_path: str, out_dir: str,
                   rounds: int) -> None:
    """`rounds` of each collective spikeguard hands gloo under transformers' EP: the flag
    point's all-gather, the job's, the settlement's zero counts and rows, a replayed
    backward span, and a combine; saves how many of their storages gloo freed."""
    init_gloo(rank, world_size, store_path)
    try:
        found = _counted(world_size, rounds)   # holds the group only while it runs
        torch.save(found, Path(out_dir) / f"release_rank{rank}.pt")
    except BaseException:
        dist.destroy_process_group()
        raise
    close_gloo()


def _counted(world_size: int, rounds: int) -> dict:
    from spikeguard.parallel.agreement import job_flag_point
    from spikeguard.parallel.family_backward import Span, replay
    from spikeguard.parallel.family_journal import FamilyAgreement
    from spikeguard.runtime.agreement import Note

    group = dist.group.WORLD
    rows = [3] * world_size
    agreement = FamilyAgreement(group, torch.nn.Linear(1, 1), 64, torch.float32)
    impl = _Impl(group)
    span = Span(("release",), [])
    span.begin()
    _backward_like(group, world_size)
    span.end()

    def combine(expert_output_MD, splits):
        return all_to_all_single_autograd(expert_output_MD, splits, splits, group) * 1

    def titan_exchange(rows_ND, splits):
        return all_to_all_single(rows_ND, splits, splits, group)

    steps = {
        "gather": lambda: agreement.gather(Note()),
        "job": lambda: job_flag_point(Note(), torch.device("cpu")),
        "zero_dispatch": lambda: agreement._zero_dispatch(impl),
        "zero_rows": lambda: agreement._exchange(impl, rows, rows),
        "replay": lambda: replay(span.ops),
        "combine": lambda: released(
            combine, torch.ones(sum(rows), 64, requires_grad=True) * 2, rows).sum(),
        # torchtitan's token exchange: the functional all-to-all, its output unwaited
        "titan_exchange": lambda: released(
            titan_exchange, torch.ones(sum(rows), 64) * 2, rows).sum(),
    }
    mode = OffThread()
    right = True
    with mode:
        for _ in range(rounds):
            for kind, step in steps.items():
                mode.kind, mode.returned = kind, False
                out = step()
                mode.returned = True
                if kind in ("combine", "titan_exchange"):
                    right &= bool(out == 2 * 3 * world_size * 64)
                del out
    dist.barrier()
    late = {kind: mode.late.get(kind, 0) for kind in steps}
    return {"late": late, "ops": len(span.ops), "right": right,
            "held": _held_after(titan_exchange, rows, rounds)}


def _held_after(exchange, rows: list, rounds: int) -> dict:
    """`rounds` of torchtitan's token exchange through `released`: how many returned while
    gloo still held the rows handed in (the functional all-to-all's work item keeps them
    until its output is waited: `released` waits it), and the slowest return."""
    held, slowest = 0, 0.0
    for _ in range(rounds):
        rows_ND = torch.ones(sum(rows), 64)
        storage = rows_ND.untyped_storage()
        own = use_count(storage)
        start = time.perf_counter()
        out = released(exchange, rows_ND, rows)
        slowest = max(slowest, time.perf_counter() - start)
        held += use_count(storage) != own
        del out
    dist.barrier()
    return {"held": held, "slowest_s": slowest}


class _Impl:
    """What the settlement reads of transformers' AllToAllEP: its EP mesh, its experts."""

    def __init__(self, group):
        from torch.distributed.device_mesh import DeviceMesh
        self.ep_mesh = DeviceMesh.from_group(group, "cpu")
        self.num_local_experts = 2


def _backward_like(group, world_size: int) -> None:
    """The kinds of collectives a backward span holds: FSDP's all-gather, a plain
    all-to-all, a functional one. (Not FSDP's reduce-scatter: gloo's keeps buffers of its
    own making, not the ones handed to it, and frees them on its thread.)"""
    flat = torch.ones(4 * world_size)
    dist.all_gather_into_tensor(flat, torch.ones(4), group=group)
    counts = torch.ones(world_size * 2, dtype=torch.long)
    dist.all_to_all_single(torch.empty_like(counts), counts, group=group)
    out = torch.ops._c10d_functional.all_to_all_single(
        torch.ones(2 * world_size, 8), [2] * world_size, [2] * world_size, group.group_name)
    torch.ops._c10d_functional.wait_tensor(out)
