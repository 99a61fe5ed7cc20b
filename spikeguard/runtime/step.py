"""A guarded step: the device open for it, and the safety net that reaches backward.

`run_steps(guards, fn)` runs `fn()`, every micro-batch's forward and backward, as one
step of every guard in `guards` (one per model chunk a process holds: one, or a pipeline
rank's virtual stages). Under "adaptive", if the device runs out of memory anywhere in it,
forward or backward, every guard frees the step's graph and saved tensors, its gradients
are put back as they were before the step, and `fn` runs again with every layer
recomputed: the data is the same, so the gradients are bitwise those of an uninterrupted
run. `Guard.run_step(fn)` is this with one guard.

The gradients the step opened with are copied to host first (GradSnapshot), unless the
caller gives `replay`: a callable that makes them again from no gradients at all (the
earlier micro-steps of a gradient-accumulation window, replayed in their order). Then
nothing is copied; a failed attempt drops every gradient, and the re-run runs `replay()`
and then `fn()`, both with every layer recomputed (runtime/device_state.py GradsReplayed).

Under expert parallelism the device refuses as a GPU does, at once, on one rank
(spikeguard.runtime.agreement): a rank that fails after a forward (in backward, or in a
loss computed outside the model) frees the step, makes the reverse exchanges its peers
wait for, and says so at one flag point; every other rank ends the step at a flag point
of the same shape (or met the note already, in a later forward). The group then holds the
same notes: every rank re-runs the step together, or every rank ends the job with the
same line. One code path on CPU and CUDA.

The optimizer step is not re-runnable (an update may be half applied): an out-of-memory
there is reported, never retried (on several processes, agreed by every rank at one flag
point after it: spikeguard.train.engines.optimizer_steps).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from spikeguard.errors import BudgetInfeasible, DeviceOutOfMemory, UsageError
from spikeguard.memory.budget import format_bytes
from spikeguard.runtime.agreement import (ABORT, STEP, GroupFailure, JobEnds, Note,
                                          agreed_text, unrecoverable, worst)
from spikeguard.runtime.device_state import GradSnapshot, GradsReplayed, where_code
from spikeguard.runtime.interrupts import interrupts_not_swallowed
from spikeguard.runtime.net import failure_note, recomputing

log = logging.getLogger("spikeguard")


def group_agreement(guards: Sequence):
    """The agreement of the guards' expert-parallel group (None on one process)."""
    return next((g.net.agreement for g in guards if g.net.agreement is not None), None)


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
            stack.enter_context(guard.step_scope(recorder=recorders[i] if recorders else None))
        yield


def _attempt(guards: Sequence, fn, agreement, rerun: bool):
    """One attempt at the step: (fn's value, None) or (None, the group's notes)."""
    try:
        result = fn()
        notes = agreement.flag_point(Note())   # the step's end: every rank makes one
    except JobEnds:
        raise
    except GroupFailure as err:   # a peer's note met in a forward, or the net's verdict
        return None, err.notes
    except (DeviceOutOfMemory, torch.OutOfMemoryError) as err:
        err = guards[0].device_oom(err)
        adaptive = all(g.policy == "adaptive" for g in guards)   # a static one dies of it
        kind = STEP if adaptive and not rerun else ABORT
        mine = failure_note(guards[0], kind, err, agreement.rank)
    except RuntimeError as err:   # a collective that a peer's agreed end broke
        notes = agreement.peer_ended(err)
        if notes is None:
            raise
        return None, notes
    else:
        return result, notes or None
    for guard in guards:
        guard.free_attempt()   # the attempt's graph and saved tensors, before the exchanges
    return None, agreement.settle_backward(mine)


def _run_group(guards: Sequence, fn, agreement, replay=None):
    """run_steps under an expert-parallel group; see the module docstring."""
    snapshots = _snapshots(guards, guards[0].group_adaptive, replay)
    for rerun in (False, True):
        with opened(guards, recorders=[g.recorder for g in guards] if rerun else None):
            agreement.begin_step()
            with recomputing(guards, rerun):
                result, notes = _attempt(guards, _replaying(fn, replay) if rerun else fn,
                                         agreement, rerun)
            if notes is None:
                return result
            note = worst(notes)
            if note.kind == ABORT or rerun or snapshots is None:
                raise unrecoverable(notes, guards[0].budget_bytes, tried_full=rerun)
            failure = agreed_text(notes)
            for guard, snapshot in zip(guards, snapshots):
                guard.abandon_step(snapshot, _where_failed(guard, note, agreement.rank))
        if note.rank == agreement.rank:   # agreed: said once, by the rank that ran out
            note_rerun(guards, failure)
        for guard in guards:
            guard.recorder.restart("step", failure)


def _run_pipeline(guards: Sequence, fn, step_end, keep_grads: bool):
    """run_steps on a pipeline rank: the step's notes come from `step_end`."""
    snapshots = [GradSnapshot(g.model) for g in guards] if keep_grads else None
    for rerun in (False, True):
        with opened(guards, recorders=[g.recorder for g in guards] if rerun else None):
            for guard in guards:
                if guard.net.agreement is not None:
                    guard.net.agreement.begin_step()
            with recomputing(guards, rerun):
                result = fn()
            notes = step_end()
            if not notes:
                return result
            note = worst(notes)
            if note.kind == ABORT or rerun or snapshots is None:
                raise unrecoverable(notes, guards[0].budget_bytes, tried_full=rerun)
            failure = agreed_text(notes)
            rank = dist.get_rank() if dist.is_initialized() else -1
            for guard, snapshot in zip(guards, snapshots):
                guard.abandon_step(snapshot, _where_failed(guard, note, rank))
        if note.rank == rank:   # agreed: said once, by the rank that ran out
            note_rerun(guards, failure)
        for guard in guards:
            guard.recorder.restart("step", failure)


def _snapshots(guards: Sequence, keep: bool, replay) -> Optional[list]:
    """What puts each guard's gradients back after a failed attempt (None: no re-run)."""
    if not keep:
        return None
    kind = GradSnapshot if replay is None else GradsReplayed
    return [kind(g.model) for g in guards]


def _replaying(fn, replay):
    """The re-run's body: the gradients the step opened with made again, then `fn`."""
    if replay is None:
        return fn

    def rerun():
        replay()
        return fn()
    return rerun


def note_rerun(guards: Sequence, failure: str) -> None:
    """The step's re-run, to be said when the step has gone through (`say_reruns`)."""
    guards[0].recorder.rerun_lines.append(
        f"step {len(guards[0].history)} ran out of memory ({failure}); re-running it with "
        f"full recompute")


def say_reruns(guards: Sequence) -> None:
    """The re-runs' warnings (the micro-batch net's and the step's), said once the step
    has gone through: a step whose re-run fails too ends the job in its one line, without
    the lines of the attempts before it (issue 22, item 9)."""
    for guard in guards:
        for line in guard.recorder.rerun_lines:
            log.warning("%s", line)


def _where_failed(guard, note: Note, rank: int) -> tuple[int, int]:
    """(position code, bytes) of this rank's own failure, for the layer peaks to learn
    from; (0, 0) where the failure was a peer's."""
    if note.rank != rank or not note.needed_bytes:
        return 0, 0
    return where_code(note.phase, note.layer, note.micro_batch), note.needed_bytes


def run_steps(guards: Sequence, fn: Callable[[], object],
              step_end: Optional[Callable[[], list]] = None, keep_grads: bool = True,
              replay: Optional[Callable[[], object]] = None):
    """Run `fn()` as one step of every guard in `guards`; see the module docstring.

    `step_end` (a pipeline rank: spikeguard.parallel.pipeline_recovery): `fn` never
    raises a device failure, its stages play the schedule to its end as ghosts, and
    `step_end()` returns every rank's notes of the step, the same on every rank of the
    job. `keep_grads`: whether some rank of the job may re-run (it then keeps the
    gradients to put back). `replay`: see the module docstring (not in a pipeline)."""
    if not callable(fn):
        raise UsageError(f"run_step() needs a callable, got {type(fn).__name__}")
    if replay is not None and not callable(replay):
        raise UsageError(f"run_step(replay=...) needs a callable or None, got "
                         f"{type(replay).__name__}")
    if replay is not None and step_end is not None:
        raise UsageError("a pipeline step does not replay: its gradients are copied")
    guards = list(guards)
    _check_can_open(guards)
    agreement = group_agreement(guards)
    try:
        if step_end is not None:
            result = _run_pipeline(guards, fn, step_end, keep_grads)
        elif agreement is not None:
            result = _run_group(guards, fn, agreement, replay)
        else:
            result = _run_alone(guards, fn, replay)
        say_reruns(guards)
        return result
    except DeviceOutOfMemory as err:
        fatal = err
        # Nothing of the failed step may outlive it: the frames of the error's traceback
        # and of the errors it was raised from hold its graph (and torch keeps a failed
        # backward's queued nodes), so they go, and the step is freed, before it leaves.
        fatal.__traceback__ = fatal.__context__ = fatal.__cause__ = None
    finally:
        for guard in guards:
            if guard.recorder is not None:
                guard.finish_step()
    for guard in guards:
        guard.free_attempt()
    raise fatal


def _run_alone(guards: Sequence, fn, replay=None):
    """run_steps on one process: the rank decides alone."""
    adaptive = all(g.policy == "adaptive" for g in guards)
    snapshots = _snapshots(guards, adaptive, replay)
    with opened(guards):
        try:
            return fn()
        except (DeviceOutOfMemory, torch.OutOfMemoryError) as err:
            if snapshots is None or any(g.full_recompute for g in guards):
                raise guards[0].device_oom(err) from None
            failure = str(guards[0].device_oom(err))
            failed = [(g.meter.where(), g.meter.last_refusal()[1]) for g in guards]
        for guard, snapshot, where in zip(guards, snapshots, failed):
            guard.abandon_step(snapshot, where)
    note_rerun(guards, failure)
    for guard in guards:
        guard.recorder.restart("step", failure)
    with opened(guards, recorders=[g.recorder for g in guards]):
        for guard in guards:
            guard.recompute_whole(True)
        try:
            return _replaying(fn, replay)()
        except (DeviceOutOfMemory, torch.OutOfMemoryError) as err:
            oom = guards[0].device_oom(err)
            needed = max(oom.needed_bytes or 0, guards[0].meter.last_refusal()[1])
            hint = (f"; try a budget of at least {format_bytes(needed, round_up=True)}"
                    if needed else "")   # the same hint as a group's (agreement.unrecoverable)
            raise BudgetInfeasible(f"even full recompute does not fit: {oom}{hint}",
                                   needed_bytes=needed,
                                   budget_bytes=guards[0].budget_bytes) from None
        finally:
            for guard in guards:
                guard.recompute_whole(False)


@contextlib.contextmanager
def step_context(guard):
    """`with guard.step():` the same scope, whose net reaches forward only (a context
    manager cannot re-run its body). Under a group its end is a flag point too: a rank
    that ran out after a forward settles and every rank raises the same agreed error."""
    _check_can_open([guard])
    agreement = guard.net.agreement
    fatal = None
    try:
        with opened([guard]):
            if agreement is not None:
                agreement.begin_step()
            mine = None
            try:
                yield guard
            except JobEnds:
                raise
            except GroupFailure as err:
                raise unrecoverable(err.notes, guard.budget_bytes, tried_full=False) from None
            except (torch.OutOfMemoryError, DeviceOutOfMemory) as err:
                err = guard.device_oom(err)
                if agreement is None:
                    raise err from None
                mine = failure_note(guard, ABORT, err, agreement.rank)
            except RuntimeError as err:   # a collective that a peer's agreed end broke
                notes = agreement.peer_ended(err) if agreement is not None else None
                if notes is None:
                    raise
                raise unrecoverable(notes, guard.budget_bytes, tried_full=False) from None
            if agreement is not None:
                if mine is not None:
                    guard.free_attempt()
                    notes = agreement.settle_backward(mine)
                else:
                    notes = agreement.flag_point(Note())
                if notes:
                    raise unrecoverable(notes, guard.budget_bytes, tried_full=False)
            say_reruns([guard])
    except DeviceOutOfMemory as err:   # as run_steps: nothing of the step outlives it
        fatal = err
        fatal.__traceback__ = fatal.__context__ = fatal.__cause__ = None
    finally:
        guard.finish_step()
    if fatal is not None:
        guard.free_attempt()
        raise fatal
