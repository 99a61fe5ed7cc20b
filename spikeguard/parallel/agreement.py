"""The expert-parallel group's side of the failure protocol (spikeguard.runtime.agreement).

Implements `OverflowAgreement` over a process group. For spikeguard's own dispatcher the
flag points are its journal's all-to-alls (spikeguard.parallel.exchange_journal), the
same collective the counts exchange of every layer is, so a failed rank's one flag point
meets its peers wherever they are. For a family whose exchanges are its own (transformers,
torchtitan) there is no journal: the flag points are an all-gather of the notes at the end
of each forward attempt and of each step, and a rank that fails inside the family's own
all-to-all leaves its peers there (the limit docs/recovery.md states).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from spikeguard.parallel.exchange_journal import ExchangeJournal
from spikeguard.runtime.agreement import NONE, NOTE_FIELDS, Note


class GroupAgreement:
    """The flag points and settlement of one rank of an expert-parallel group."""

    def __init__(self, group, journal: Optional[ExchangeJournal] = None,
                 device: Optional[torch.device] = None):
        self.group = group
        self.journal = journal
        self.rank = dist.get_rank()
        self.device = device or torch.device("cpu")

    @property
    def settles(self) -> bool:
        """Whether a failed rank can make the exchanges its peers wait in (the journal of
        spikeguard's own dispatcher); else a failure inside a forward or backward is not
        agreed: the rank raises at once and the launcher ends its peers."""
        return self.journal is not None

    def any_rank(self, mine: bool) -> bool:
        flag = torch.tensor([1 if mine else 0], dtype=torch.int32, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return bool(flag.item())

    def begin_step(self) -> None:
        if self.journal is not None:
            self.journal.begin_step()

    def begin_attempt(self, micro_batch: int) -> None:
        if self.journal is not None:
            self.journal.begin_attempt(micro_batch)

    def flag_point(self, note: Note) -> list[Note]:
        if self.journal is not None:
            return self.journal.flag_point(None, note, self.device)[1]
        mine = torch.tensor(note.as_list(), dtype=torch.int64, device=self.device)
        out = torch.empty(dist.get_world_size(self.group) * NOTE_FIELDS, dtype=torch.int64,
                          device=self.device)
        dist.all_gather_single(out, mine, group=self.group)   # gloo: a flat output
        return [n for n in (Note(*row) for row in out.view(-1, NOTE_FIELDS).tolist())
                if n.kind != NONE]

    def settle_forward(self, note: Note) -> list[Note]:
        if self.journal is not None:
            return self.journal.settle_forward(note, self.device)
        return self.flag_point(note)

    def settle_backward(self, note: Note, micro_batch: Optional[int] = None) -> list[Note]:
        if self.journal is not None:
            return self.journal.settle_backward(note, self.device, micro_batch)
        return self.flag_point(note)


def agreement_for(group, blocks=(), device=None) -> Optional[GroupAgreement]:
    """The agreement of `group`'s ranks (with the journal of spikeguard's own dispatcher
    where `blocks` carry one), or None without a group (a rank decides alone)."""
    if group is None:
        return None
    journal = next((b.dispatcher.journal for b in blocks
                    if getattr(getattr(b, "dispatcher", None), "journal", None) is not None),
                   None)
    return GroupAgreement(group, journal, device)
