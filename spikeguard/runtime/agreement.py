"""How the ranks of an expert-parallel group agree on a failure: notes at flag points.

A GPU refuses the allocation that would pass its limit at once, on that rank alone, and
its peers go on into the next collective. The guard's recovery therefore never waits on
the device: the rank that ran out frees its attempt, makes the collectives its peers will
wait for, and then says so at the next *flag point*, a collective every rank of the group
makes anyway (spikeguard.parallel.exchange_journal implements it over the group; runtime
knows no process group and never imports parallel). After one flag point every rank holds
the same notes and takes the same branch:

    worst note   what every rank of the group does
    MICRO_BATCH  frees the micro-batch's attempt and runs it again with full recompute
    STEP         frees the step, puts the gradients back, runs it again with full recompute
    ABORT        ends the job with one agreed line (a static policy ran out, or even full
                 recompute did not fit)

Where the failed rank cannot make what its peers wait in, it ends the job for every rank
(spikeguard.parallel.agreement: its note to the job's store, its groups aborted, so each
peer's collective fails at once and the peer reads the same note): one agreed line.

Without a group (one process) a rank decides alone, and no flag point is made.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Protocol

from spikeguard.errors import BudgetInfeasible, DeviceOutOfMemory
from spikeguard.memory.budget import format_bytes
from spikeguard.runtime.device_state import place_text

#: Note kinds, in the order the group resolves them (the largest wins).
NONE, MICRO_BATCH, STEP, ABORT = 0, 1, 2, 3
NOTE_FIELDS = 7   # kind, rank, phase, micro-batch, layer, bytes, the rank's budget


@dataclass(frozen=True)
class Note:
    """One rank's word at a flag point: what failed, where, and the figure it reached (the
    allocation refused would have put `needed_bytes` on the device; 0 where unknown)."""

    kind: int = NONE
    rank: int = -1
    phase: int = 0
    micro_batch: int = 0
    layer: int = -1
    needed_bytes: int = 0
    budget_bytes: int = 0

    def as_list(self) -> list[int]:
        return [self.kind, self.rank, self.phase, self.micro_batch, self.layer,
                self.needed_bytes, self.budget_bytes]


def worst(notes: list[Note]) -> Note:
    """The note the group acts on: the largest kind, then the lowest rank."""
    return max(notes, key=lambda n: (n.kind, -n.rank), default=Note())


def agreed_text(notes: list[Note]) -> str:
    """The one line every rank prints for the same notes: who, where, how far."""
    note = worst(notes)
    place = place_text(note.phase, note.micro_batch, note.layer, "")
    text = f"rank {note.rank} ran out of memory in {place}"
    if note.needed_bytes:
        text += (f" (an allocation would have put {format_bytes(note.needed_bytes)} on a "
                 f"device of {format_bytes(note.budget_bytes)})")
    others = sorted({n.rank for n in notes} - {note.rank})
    if others:
        text += f"; also rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))}"
    return text


class GroupFailure(DeviceOutOfMemory):
    """Raised on every rank of the group once it holds the same `notes`."""

    def __init__(self, notes: list[Note], message: str = ""):
        note = worst(notes)
        super().__init__(message or f"rank {note.rank} of the expert-parallel group ran out "
                         "of memory", needed_bytes=note.needed_bytes)
        self.notes = notes

    @property
    def kind(self) -> int:
        return worst(self.notes).kind


class PeerFailed(GroupFailure):
    """Raised at a flag point on a rank that did not fail: a peer's note arrived there."""


class JobEnds(GroupFailure):
    """The agreed end of the job, raised on every rank with the same line: a static policy
    ran out, or even full recompute did not fit. Never re-run."""


class JobEndsInfeasible(JobEnds, BudgetInfeasible):
    """JobEnds where even full recompute did not fit (a BudgetInfeasible too)."""


def unrecoverable(notes: list[Note], budget_bytes: int, tried_full: bool) -> JobEnds:
    """The agreed error that ends the job, with the smallest budget the refused allocation
    proves where even full recompute did not fit."""
    line = agreed_text(notes)
    needed = worst(notes).needed_bytes
    if tried_full:
        hint = (f"; try a budget of at least {format_bytes(needed, round_up=True)}"
                if needed else "")
        err = JobEndsInfeasible(notes, f"even full recompute does not fit: {line}{hint}")
    else:
        err = JobEnds(notes, line)
    err.budget_bytes = budget_bytes
    return err


class OverflowAgreement(Protocol):
    """The group's side of the protocol (spikeguard.parallel.agreement.GroupAgreement)."""

    rank: int

    def any_rank(self, mine: bool) -> bool:
        """Whether this rank's flag (`mine`) or any other rank's is set: every rank calls it
        at the same point (attach; adaptive's whole-layer fallback, see BlockAdapter)."""
        ...

    def vote(self, mine: bool, promise: Callable[[], bool]) -> bool:
        """A layer's vote on the whole-layer fallback (`any_rank` of `mine`, every rank at
        the same layer). `promise()`: whether this rank predicts that no later layer of the
        attempt needs the fallback; where every rank does, the group may skip the later
        layers' votes (each then counts as a no)."""
        ...

    def begin_step(self) -> None:
        ...

    def begin_attempt(self, micro_batch: int, layer_votes: bool = False) -> None:
        """A forward attempt of `micro_batch` starts (what its exchanges owe is recorded);
        `layer_votes`: its layers vote on the whole-layer fallback (flag points too)."""
        ...

    def flag_point(self, note: Note) -> list[Note]:
        """The end of a forward attempt or of a step: every rank's note (empty: none)."""
        ...

    def settle_forward(self, note: Note) -> list[Note]:
        """This rank's forward attempt failed and was freed: make what the peers wait for,
        then one flag point with `note`; every rank's notes."""
        ...

    def settle_backward(self, note: Note, micro_batch: Optional[int] = None) -> list[Note]:
        """The same for a failure after a forward (its backward, or a loss computed
        outside the model). Where the peers' exchanges cannot be made (a family's own,
        FSDP's), the job ends for every rank instead: the note returned is ABORT."""
        ...

    def peer_ended(self, err: BaseException) -> Optional[list[Note]]:
        """Where a collective failed with `err` because a peer ended the job, its notes
        (the same on every rank); None for any other error."""
        ...
