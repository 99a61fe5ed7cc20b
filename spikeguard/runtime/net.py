"""The safety net of one micro-batch's forward, and the expert-parallel group's agreement.

One part of the guard (spikeguard.runtime.guard): every guarded forward of the model runs
through `MicroBatchNet.forward`. Under "adaptive", a forward that runs out of memory is
freed and run again with every layer recomputed; if even that does not fit, the error
says the budget that would (measured with the emulated budget lifted, on one process).

Under expert parallelism (an `OverflowAgreement` given, spikeguard.runtime.agreement) the
device refuses as a GPU does, at once, on one rank: that rank frees its attempt, makes
the exchanges its peers wait for and says so at the next flag point, where they learn it
(`PeerFailed`); then the whole group holds the same notes and acts on them together: the
micro-batch again with full recompute, the step again (`GroupFailure` of kind STEP, for
spikeguard.runtime.step), or the job ends in one agreed line. The net reaches its guard
only through its door (spikeguard.runtime.doors.NetDoor): the parts it reads and the
guard's forward of one attempt, its abandon and its out-of-memory line.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Optional, Protocol

import torch

from spikeguard.errors import BudgetInfeasible, DeviceOutOfMemory
from spikeguard.memory.budget import format_bytes
from spikeguard.runtime.agreement import (ABORT, MICRO_BATCH, STEP, GroupFailure, Note,
                                          OverflowAgreement, PeerFailed, agreed_text,
                                          unrecoverable, worst)
from spikeguard.runtime.device_state import GradSnapshot, decode_where
from spikeguard.runtime.doors import NetDoor

log = logging.getLogger("spikeguard")


class Recomputes(Protocol):
    """What `recomputing` switches: a guard (runtime/step.py's) or the net's door."""

    policy: str

    @property
    def full_recompute(self) -> bool: ...

    def recompute_whole(self, on: bool) -> None: ...


class NotesFrom(Protocol):
    """What `failure_note` reads: a guard or the net's door."""

    meter: object
    ctx: object
    budget_bytes: int


@contextlib.contextmanager
def recomputing(owners: list[Recomputes], on: bool):
    """Inside, every adaptive owner recomputes every layer whole (a safety net's re-run);
    a static one keeps its own policy ("full" stays full, "none" stays none)."""
    changed = [o for o in owners if on and o.policy == "adaptive" and not o.full_recompute]
    for owner in changed:
        owner.recompute_whole(True)
    try:
        yield
    finally:
        for owner in changed:
            owner.recompute_whole(False)


def failure_note(source: NotesFrom, kind: int, err: DeviceOutOfMemory, rank: int) -> Note:
    """This rank's note of its own failure `err`: where the device stood, how far."""
    phase, layer = decode_where(source.meter.where())
    needed = max(err.needed_bytes or 0, source.meter.last_refusal()[1])
    return Note(kind, rank, phase, source.ctx.micro_batch, layer, int(needed),
                source.budget_bytes)


def layer_votes(door: NetDoor) -> bool:
    """Whether this attempt's layers vote on the whole-layer fallback (GuardedLayers: some
    rank adaptive, where a recomputed layer re-issues a collective; not under full
    recompute): the votes are flag points the journal of a family's EP counts on."""
    return door.layers.votes


class MicroBatchNet:
    """Runs a guard's micro-batch forwards under the safety net (through its door)."""

    def __init__(self, door: NetDoor, agreement: Optional[OverflowAgreement]):
        self.door = door
        self.agreement = agreement

    def forward(self, orig_forward, args, kwargs):
        """One micro-batch's forward; re-run whole with full recompute if it runs out."""
        d = self.door
        step = d.recorder()
        mb = step.micro_batches if step else 0
        try:
            return self.attempt(orig_forward, mb, args, kwargs)
        except GroupFailure:
            raise
        except (DeviceOutOfMemory, torch.OutOfMemoryError) as err:
            if d.policy != "adaptive" or d.full_recompute:
                raise d.device_oom(err) from None
            message = str(d.device_oom(err))
        except _AgreedRerun as rerun:   # the group agreed: this micro-batch again
            message = rerun.message if rerun.mine else ""
        # Safety net: free this micro-batch and run it again with everything recomputed.
        d.abandon_micro_batch(mb)
        if step:
            step.safety_net_reruns += 1
        # Under a group a static rank runs it again as it is (its peers' re-run makes the
        # same exchanges: the built-in ones are replayed, never re-issued, by a recompute).
        try:
            with recomputing([d], True):
                out = self.attempt(orig_forward, mb, args, kwargs, last_try=True)
            if message:   # agreed under a group: said once, by the rank that ran out
                line = (f"micro-batch {mb} ran out of memory ({message}); re-running it "
                        f"with full recompute")
                if step is not None:   # said when the step has gone through
                    step.rerun_lines.append(line)
                else:
                    log.warning("%s", line)
            return out
        except GroupFailure:
            raise
        except (DeviceOutOfMemory, torch.OutOfMemoryError) as err:
            failure = str(d.device_oom(err))
        d.abandon_micro_batch(mb)
        needed = self.full_recompute_need(orig_forward, mb, args, kwargs)
        raise BudgetInfeasible(
            f"even full recompute does not fit: {failure}; try a budget of at least "
            f"{format_bytes(needed, round_up=True)}", needed_bytes=needed,
            budget_bytes=d.budget_bytes)

    def attempt(self, orig_forward, mb, args, kwargs, last_try: bool = False):
        """One forward of a micro-batch. Under expert parallelism every rank ends it at a
        flag point whatever its policy and whatever happened (spikeguard.runtime.agreement):
        a failed rank after settling what it owes, a rank that met a peer's note already
        there, every other rank at the attempt's end. The group then holds the same notes."""
        d = self.door
        if self.agreement is None:
            return d.forward_micro_batch(orig_forward, mb, args, kwargs)
        step = d.recorder()
        if step is not None:   # what the step reached before this attempt stands
            step.note_peak(d.meter.peak(), d.meter.peak_where())
        self.agreement.begin_attempt(mb, layer_votes=layer_votes(d))
        counted = step.micro_batches if step is not None else 0
        mine: Optional[Note] = None
        try:
            out = d.forward_micro_batch(orig_forward, mb, args, kwargs)
            notes = self.agreement.flag_point(Note())
        except PeerFailed as err:
            notes = err.notes
        except (DeviceOutOfMemory, torch.OutOfMemoryError) as err:
            err = d.device_oom(err)
            adaptive = d.policy == "adaptive" and d.group_adaptive
            kind = MICRO_BATCH if adaptive and not last_try else ABORT
            mine = failure_note(d, kind, err, self.agreement.rank)
        except RuntimeError as err:   # a collective that a peer's agreed end broke
            notes = self.agreement.peer_ended(err)
            if notes is None:
                raise
        else:
            if not notes:
                return out
            del out
        if step is not None:
            step.note_attempt_peak(d.meter.peak(), d.meter.peak_where())
            if step.micro_batches > counted:
                # The attempt finished its forward, so it was counted: un-count it, or the
                # re-run and every later micro-batch would get the next number (and the
                # pipeline's residency would read the wrong schedule position).
                step.uncount_attempt()
        d.abandon_micro_batch(mb)   # the attempt's graph and saved tensors are freed first
        if mine is not None:
            notes = self.agreement.settle_forward(mine)
        d.meter.reset_peak()   # recorded above: the re-run's figure starts afresh
        return self.resolve(notes, last_try)

    def resolve(self, notes: list, last_try: bool):
        """What every rank does with the same notes (raises: the attempt is abandoned)."""
        note = worst(notes)
        d = self.door
        if note.kind == STEP:
            raise GroupFailure(notes)
        if note.kind == ABORT or last_try:
            raise unrecoverable(notes, d.budget_bytes, tried_full=last_try)
        raise _AgreedRerun(agreed_text(notes), note.rank == self.agreement.rank)

    def full_recompute_need(self, orig_forward, mb, args, kwargs) -> int:
        """The peak this micro-batch reaches under full recompute, measured with the emulated
        budget lifted (CPU): its forward, and its backward when the output carries its loss
        (gradients restored afterwards); else the head's backward is estimated. On CUDA,
        where that cannot be tried, a quarter more than now."""
        d = self.door
        if d.device.type == "cuda":
            return int(d.budget_bytes * 1.25)
        snapshot = GradSnapshot(d.model)
        d.recompute_whole(True)
        try:
            with d.meter.unlimited():
                d.meter.reset_peak()
                # Twice: the second backward accumulates into gradients that exist, the
                # peak of every micro-batch after a step's first.
                for _ in range(2):
                    out = d.forward_micro_batch(orig_forward, mb, args, kwargs)
                    loss = getattr(out, "loss", None)
                    if not (torch.is_tensor(loss) and loss.requires_grad):
                        head = d.layer_room.head_backward_per_token * num_tokens(args, kwargs)
                        return max(d.meter.peak(), d.ledger.in_use() + int(head))
                    del out
                    loss.backward()
                    del loss
                return d.meter.peak()
        finally:
            d.recompute_whole(False)
            d.abandon_micro_batch(mb)
            snapshot.restore()


class _AgreedRerun(Exception):
    """The group agreed to run the micro-batch again (internal to the net)."""

    def __init__(self, message: str, mine: bool):
        super().__init__(message)
        self.message, self.mine = message, mine


def num_tokens(args, kwargs) -> int:
    """Tokens of the micro-batch: token ids (B, T), or a hidden state (B, T, D) as a
    pipeline stage after the first receives it."""
    for value in list(args) + list(kwargs.values()):
        if torch.is_tensor(value):
            if value.is_floating_point() and value.dim() >= 3:
                return value.numel() // value.shape[-1]
            return value.numel()
    return 0
