"""A guarded step: the device open for it, and the safety net that reaches backward.

`run_steps(guards, fn)` runs `fn()`, every micro-batch's forward and backward, as one
step of every guard in `guards` (one per model chunk a process holds: one, or a pipeline
rank's virtual stages). Under "adaptive", if the device runs out of memory anywhere in it,
forward or backward, every guard frees the step's graph and saved tensors, its gradients
are put back as they were before the step, and `fn` runs again with every layer
recomputed: the data is the same, so the gradients are bitwise those of an uninterrupted
run. `Guard.run_step(fn)` is this with one guard.

Under a process group on the emulated device, an adaptive rank's overflow is deferred to
the end of the step (the device counts past its capacity instead of refusing), and every
rank's guards agree in one all-reduce whatever their policy (collectives must match): all
re-run together, or all fail together, and no rank is left waiting in a collective. On
CUDA an allocation past the device cannot be deferred: the step's net there reaches a
rank's own OOM; a peer still inside a collective of that step is not released (written,
not run here: no GPU).

The optimizer step is not re-runnable (an update may be half applied): an out-of-memory
there is reported, never retried.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from spikeguard.errors import BudgetInfeasible, DeviceOutOfMemory, UsageError
from spikeguard.memory.budget import format_bytes
from spikeguard.runtime.device_state import GradSnapshot, decode_where, place_text
from spikeguard.runtime.interrupts import interrupts_not_swallowed

log = logging.getLogger("spikeguard")


def agrees_per_step(guard) -> bool:
    """Every guard of every rank agrees at the end of each step on the emulated device."""
    return (not guard.meter.is_cuda and dist.is_available() and dist.is_initialized()
            and dist.get_world_size() > 1)


def defers(guard) -> bool:
    """An adaptive rank finishes its step before it fails, so no peer is left waiting."""
    return guard.policy == "adaptive" and agrees_per_step(guard)


def group_overflow(guards: Sequence, failed: Optional[dict] = None) -> Optional[str]:
    """After a (deferred) step: did a guard of this rank, or of any rank, pass its device?
    `failed`, if given, gets each overflowing guard's (position code, bytes), by id."""
    if not guards or not agrees_per_step(guards[0]):
        return None
    mine = [(g, *g.take_step_overflow()) for g in guards]
    if failed is not None:
        failed.update({id(g): (where, over) for g, over, where in mine if over})
    over = max((o for _, o, _ in mine), default=0)
    flag = torch.tensor([1 if over else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if not flag.item():
        return None
    if over:
        guard, _, where = next(m for m in mine if m[1] == over)
        phase, layer = decode_where(where)
        place = place_text(phase, guard.ctx.micro_batch, layer, "")
        place = place.split(", op")[0].replace("of micro-batch", "of a micro-batch")
        return (f"the step reached {format_bytes(over)} on a device of "
                f"{format_bytes(guard.budget_bytes)} ({place})")
    return "another rank of the job ran out of memory in this step"


def _check_can_open(guards: Sequence) -> None:
    for guard in guards:
        if guard.recorder is not None:
            raise UsageError("a step of this guard is already open: steps do not nest")
        if not guard.attached:
            raise UsageError("this guard is detached: attach a new one to guard a step")


@contextlib.contextmanager
def opened(guards: Sequence, recorders=None):
    """Every guard's step scope open (device active and enforcing, recorder open)."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(interrupts_not_swallowed())
        for i, guard in enumerate(guards):
            stack.enter_context(guard.step_scope(
                defer=defers(guard), recorder=recorders[i] if recorders else None))
        yield


def run_steps(guards: Sequence, fn: Callable[[], object]):
    """Run `fn()` as one step of every guard in `guards`; see the module docstring."""
    if not callable(fn):
        raise UsageError(f"run_step() needs a callable, got {type(fn).__name__}")
    guards = list(guards)
    _check_can_open(guards)
    adaptive = all(g.policy == "adaptive" for g in guards)
    snapshots = [GradSnapshot(g.model) for g in guards] if adaptive else None
    failure = None
    failed: dict[int, tuple[int, int]] = {}   # guard id -> (position code, bytes refused)
    try:
        with opened(guards):
            try:
                result = fn()
                failure = group_overflow(guards, failed)
            except (DeviceOutOfMemory, torch.OutOfMemoryError) as err:
                if snapshots is None or any(g.full_recompute for g in guards):
                    raise guards[0].device_oom(err) from None
                failure = str(guards[0].device_oom(err))
                for guard in guards:   # where the refused allocation was, and how far
                    failed[id(guard)] = (guard.meter.where(), guard.meter.last_refusal()[1])
            if failure is not None and snapshots is None:
                raise DeviceOutOfMemory(f"step {len(guards[0].history)}: {failure}",
                                        budget_bytes=guards[0].budget_bytes)
            if failure is not None:
                for guard, snapshot in zip(guards, snapshots):
                    guard.abandon_step(snapshot, failed.get(id(guard), (0, 0)))
        if failure is None:
            return result
        log.warning("step %d ran out of memory (%s); re-running it with full recompute",
                    len(guards[0].history), failure)
        for guard in guards:
            guard.recorder.restart("step", failure)
        with opened(guards, recorders=[g.recorder for g in guards]):
            for guard in guards:
                guard.full_recompute = True
            try:
                result = fn()
            except (DeviceOutOfMemory, torch.OutOfMemoryError) as err:
                raise BudgetInfeasible(
                    f"even full recompute does not fit: {guards[0].device_oom(err)}",
                    budget_bytes=guards[0].budget_bytes) from None
            finally:
                for guard in guards:
                    guard.full_recompute = False
            failure = group_overflow(guards)
            if failure is not None:
                raise BudgetInfeasible(f"even full recompute does not fit: {failure}",
                                       budget_bytes=guards[0].budget_bytes)
            return result
    finally:
        for guard in guards:
            if guard.recorder is not None:
                guard.finish_step()


@contextlib.contextmanager
def step_context(guard):
    """`with guard.step():` the same scope, whose net reaches forward only."""
    _check_can_open([guard])
    try:
        with opened([guard]):
            try:
                yield guard
            except torch.OutOfMemoryError as err:
                raise guard.device_oom(err) from None
            failure = group_overflow([guard])
            if failure is not None:   # every rank raises together: none is left waiting
                raise DeviceOutOfMemory(f"step {len(guard.history)}: {failure}",
                                        budget_bytes=guard.budget_bytes)
    finally:
        guard.finish_step()
