"""The expert-parallel group's side of the failure protocol (spikeguard.runtime.agreement).

Implements `OverflowAgreement` over a process group. For spikeguard's own dispatcher the
flag points are its journal's all-to-alls (spikeguard.parallel.exchange_journal), the
same collective the counts exchange of every layer is, so a failed rank's one flag point
meets its peers wherever they are. For a family whose exchanges are its own
(transformers: spikeguard.parallel.family_journal; torchtitan) the flag points are an
all-gather of one row per rank (a note and a vote).

Where a failed rank cannot make what its peers wait in (an exchange it cannot size, a
collective of FSDP's or of torchtitan's, a backward through them), it ends the job for
every rank (`end_job`): its note goes to the job's store, then it aborts its process
groups, so every peer's pending collective fails at once (gloo: the peers' sockets close);
a peer whose collective failed reads the note there (`peer_ended`) and raises the same
agreed line. Never a hang; one line, the same on every rank.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from spikeguard.errors import DeviceOutOfMemory
from spikeguard.parallel.exchange_journal import ExchangeJournal
from spikeguard.parallel.release import handed, let_go
from spikeguard.runtime.agreement import ABORT, NONE, NOTE_FIELDS, Note

#: The job store's key of the note that ended the job (one job per store).
END_KEY = "spikeguard/job_ends"


class GroupAgreement:
    """The flag points and settlement of one rank of an expert-parallel group."""

    def __init__(self, group, journal: Optional[ExchangeJournal] = None,
                 device: Optional[torch.device] = None):
        self.group = group
        self.journal = journal
        self.rank = dist.get_rank()
        self.device = device or torch.device("cpu")
        # Held now: once the job's groups are aborted the default store is not reachable.
        self.store = dist.distributed_c10d._get_default_store()

    def gather(self, note: Note, vote: bool = False,
               promise: bool = False) -> tuple[list[Note], bool, bool]:
        """One all-gather of (note, vote, promise) rows over the group: every rank's note
        (empty: none), whether any rank voted, and whether every rank promised."""
        row = note.as_list() + [1 if vote else 0, 1 if promise else 0]
        mine = torch.tensor(row, dtype=torch.int64, device=self.device)
        out = torch.empty(dist.get_world_size(self.group) * len(row), dtype=torch.int64,
                          device=self.device)
        gathered(out, mine, self.group)
        rows = out.view(-1, len(row)).tolist()
        notes = [n for n in (Note(*r[:NOTE_FIELDS]) for r in rows) if n.kind != NONE]
        return (notes, any(r[NOTE_FIELDS] for r in rows),
                all(r[NOTE_FIELDS + 1] for r in rows))

    def any_rank(self, mine: bool) -> bool:
        return self.gather(Note(), mine)[1]

    def vote(self, mine: bool, promise) -> bool:
        """A layer's whole-layer fallback vote. Only a family's journal (family_journal.py)
        lets every rank's promise spare the later votes; here each layer votes."""
        return self.any_rank(mine)

    def begin_step(self) -> None:
        if self.journal is not None:
            self.journal.begin_step()

    def begin_attempt(self, micro_batch: int, layer_votes: bool = False) -> None:
        if self.journal is not None:
            self.journal.begin_attempt(micro_batch)

    def flag_point(self, note: Note) -> list[Note]:
        if self.journal is not None:
            return self.journal.flag_point(None, note, self.device)[1]
        return self.gather(note)[0]

    def settle_forward(self, note: Note) -> list[Note]:
        """This rank's forward attempt failed (and was freed): what its peers wait in, then
        one flag point with `note`; every rank's notes."""
        return self._settling(self._settle_forward, note)

    def settle_backward(self, note: Note, micro_batch: Optional[int] = None) -> list[Note]:
        """This rank's backward failed (its attempt freed): likewise, for the backward of
        `micro_batch` (None: the one left incomplete)."""
        return self._settling(lambda n: self._settle_backward(n, micro_batch), note)

    def _settling(self, settle, note: Note) -> list[Note]:
        """`settle(note)`, or the job's end where this rank cannot allocate even what it
        owes (an exchange's zero rows, a flag point's row: the attempt's freeing gave back
        nothing its caller still holds, a loss kept across the step). Its peers wait in a
        collective it cannot make, so only the job's end reaches them with its note."""
        try:
            return settle(note)
        except (torch.OutOfMemoryError, DeviceOutOfMemory):
            return self.end_job(note)

    def _settle_forward(self, note: Note) -> list[Note]:
        if self.journal is not None:
            return self.journal.settle_forward(note, self.device)
        return self.end_job(note)

    def _settle_backward(self, note: Note, micro_batch: Optional[int]) -> list[Note]:
        if self.journal is not None:
            return self.journal.settle_backward(note, self.device, micro_batch)
        return self.end_job(note)

    # ---- where settling is impossible ---------------------------------------------------
    def end_job(self, note: Note) -> list[Note]:
        """End the job for every rank: this rank's note (now ABORT) to the job's store,
        then every process group aborted, so that each peer's pending or next collective
        fails at once and the peer reads the note (`peer_ended`). Returns the notes."""
        note = Note(ABORT, *note.as_list()[1:])
        self.store.set(END_KEY, ",".join(map(str, note.as_list())))
        dist.distributed_c10d._abort_process_group()
        return [note]

    def peer_ended(self, err: BaseException) -> Optional[list[Note]]:
        """The notes of a peer that ended the job, if `err` (a collective that failed) came
        from that: the peer wrote its note before it aborted, so it is there now. This
        rank's groups are aborted then as well (the job ends)."""
        if not isinstance(err, RuntimeError):
            return None
        try:
            if not self.store.check([END_KEY]):
                return None
            row = [int(v) for v in self.store.get(END_KEY).decode().split(",")]
        except (RuntimeError, ValueError):
            return None
        # Its own groups aborted too: their pending works (an FSDP reduce-scatter, a
        # functional all-to-all) fail now rather than block whoever frees them.
        dist.distributed_c10d._abort_process_group()
        return [Note(*row)]


def job_flag_point(note: Note, device: torch.device) -> list[Note]:
    """One all-gather of notes over the whole job (every rank calls it at the same point,
    e.g. after the optimizer step): every rank's note, the same on every rank; [] on one
    process or where no rank failed."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [note] if note.kind != NONE else []
    mine = torch.tensor(note.as_list(), dtype=torch.int64, device=device)
    out = torch.empty(dist.get_world_size() * NOTE_FIELDS, dtype=torch.int64, device=device)
    gathered(out, mine, None)
    return [n for n in (Note(*row) for row in out.view(-1, NOTE_FIELDS).tolist())
            if n.kind != NONE]


def gathered(out: torch.Tensor, mine: torch.Tensor, group) -> None:
    """`mine` of every rank into `out` (gloo: a flat output), returning once the backend
    has let go of both: nothing else holds `mine`, and gloo's worker thread freed it (and
    `out`, dropped by the caller) whenever it ran, 192 B at a peak (release.py)."""
    views, marks = handed((out, mine))
    dist.all_gather_single(*views, group=group)
    del views
    let_go(marks)


def agreement_for(group, blocks=(), device=None) -> Optional[GroupAgreement]:
    """The agreement of `group`'s ranks (with the journal of spikeguard's own dispatcher
    where `blocks` carry one), or None without a group (a rank decides alone)."""
    if group is None:
        return None
    journal = next((b.dispatcher.journal for b in blocks
                    if getattr(getattr(b, "dispatcher", None), "journal", None) is not None),
                   None)
    return GroupAgreement(group, journal, device)
