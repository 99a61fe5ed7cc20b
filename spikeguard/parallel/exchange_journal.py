"""What a rank's expert-parallel exchanges owe its peers, and the flag points of a failure.

A GPU refuses the allocation that would pass its limit at once, on that rank alone; its
peers go on into the next all-to-all and wait there. So a rank whose attempt ran out of
memory still issues every exchange its peers will wait for, with zeros in place of rows
(the sizes are known: they were exchanged with the counts), and then tells them at the
next *flag point*, a collective every rank of the group makes anyway.

R = ranks of the group, L = experts local to a rank, N = rows this rank sends, M = rows it
receives, D = model width.

    forward of one layer:   [flag point: counts exchange] -> dispatch (N -> M) -> combine (M -> N)
    backward of one layer:  combine's reverse (N -> M) -> dispatch's reverse (M -> N)
    end of a forward attempt, end of a step: [flag point]

Every flag point is the same all-to-all: per destination, L counts (zeros where no layer
runs) and one `Note` (kind, rank, phase, micro-batch, layer, bytes). Each rank sends the
same note to every peer, so every rank receives every rank's note: after one flag point
the whole group knows the same notes and takes the same branch (re-run the micro-batch,
re-run the step, or end the job: spikeguard.runtime.agreement). A healthy rank that
receives a note raises `PeerFailed` there (the dispatcher does); a failed rank settles what it owes (`settle_forward`, `settle_backward`), then
makes exactly one flag point with its own note, wherever its peers are now: inside a later
layer's forward, at the end of the attempt, or at the end of the step, they are all at a
flag point of the same shape. Nothing can hang by construction, and no collective is left
half-issued. The dummy rows come from the memory the abandoned attempt just freed: a rank
that cannot find even those ends the job (the launcher ends its peers).

A model whose exchanges are not this module's: transformers' own expert parallelism has
its own journal (spikeguard.parallel.family_journal); torchtitan's has none, and a rank
refused there ends the job for every rank (spikeguard.parallel.agreement.end_job).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from spikeguard.parallel.release import exchange
from spikeguard.runtime.agreement import NONE, NOTE_FIELDS, Note

@dataclass
class Exchange:
    """One layer's exchanges of one micro-batch's forward, and how far each got."""

    micro_batch: int
    send_splits: list[int]
    recv_splits: list[int]
    width: int
    dtype: torch.dtype
    device: torch.device
    dispatched: bool = False
    combined: bool = False
    combine_reversed: bool = False    # backward: combine's reverse exchange done
    dispatch_reversed: bool = False   # backward: dispatch's reverse exchange done


@dataclass
class ExchangeJournal:
    """The exchanges of the open step on one rank of one expert-parallel group."""

    group: object
    num_local_experts: int
    num_layers: int = 0               # MoE layers of one forward (one flag point each)
    exchanges: list[Exchange] = field(default_factory=list)
    micro_batch: int = 0              # the forward attempt in progress
    counts_done: int = 0              # flag points (counts exchanges) of that attempt

    # ---- recording (spikeguard.parallel.expert_parallel) ------------------------------
    def begin_attempt(self, micro_batch: int) -> None:
        """A forward attempt of `micro_batch` starts: its earlier attempt's entries go."""
        self.exchanges = [e for e in self.exchanges if e.micro_batch != micro_batch]
        self.micro_batch, self.counts_done = micro_batch, 0

    def begin_step(self) -> None:
        self.exchanges.clear()
        self.counts_done = 0

    @staticmethod
    def recording() -> bool:
        """Only the forward records: a recompute in backward replays the cached exchanges
        (they are MUST_SAVE), it does not communicate again."""
        return torch._C._current_graph_task_id() == -1

    def record(self, send_splits, recv_splits, width, dtype, device) -> Optional[Exchange]:
        if not self.recording():
            return None
        self.counts_done += 1
        entry = Exchange(self.micro_batch, list(send_splits), list(recv_splits), width,
                         dtype, device)
        self.exchanges.append(entry)
        return entry

    # ---- the flag point ---------------------------------------------------------------
    def flag_point(self, counts_E: Optional[torch.Tensor], note: Note,
                   device: torch.device) -> tuple[Optional[torch.Tensor], list[Note]]:
        """One all-to-all of (L counts + one note) per destination; returns the counts each
        rank sends here (R x L, None without `counts_E`) and every rank's note."""
        R, L = dist.get_world_size(self.group), self.num_local_experts
        counts_RL = (counts_E.view(R, L).to(torch.int64) if counts_E is not None
                     else torch.zeros(R, L, dtype=torch.int64, device=device))
        mine = torch.tensor(note.as_list(), dtype=torch.int64, device=device)
        send = torch.cat([counts_RL, mine.expand(R, NOTE_FIELDS)], dim=1).reshape(-1)
        width = L + NOTE_FIELDS
        # through `exchange`: gloo's work item let go of `send` and the output on return,
        # so they are freed where this drops them, not on gloo's thread
        recv_RW = exchange(send, [width] * R, [width] * R, self.group.group_name)
        recv_RW = recv_RW.view(R, width)
        notes = [Note(*row) for row in recv_RW[:, L:].tolist()]
        counts = recv_RW[:, :L] if counts_E is not None else None
        return counts, [n for n in notes if n.kind != NONE]

    # ---- what a failed rank owes ------------------------------------------------------
    def settle_forward(self, note: Note, device: torch.device) -> list[Note]:
        """After this rank's forward attempt failed (its attempt already freed): the
        exchanges of the layer in flight, then one flag point with `note`."""
        entry = self.exchanges[-1] if self.counts_done and self.exchanges else None
        if entry is not None and entry.micro_batch == self.micro_batch:
            if not entry.dispatched:
                self._exchange(entry, entry.send_splits, entry.recv_splits)
                entry.dispatched = True
            if not entry.combined:
                self._exchange(entry, entry.recv_splits, entry.send_splits)
                entry.combined = True
        return self.flag_point(None, note, device)[1]

    def settle_backward(self, note: Note, device: torch.device,
                        micro_batch: Optional[int] = None) -> list[Note]:
        """After this rank's backward failed (its attempt already freed): the reverse
        exchanges of every layer that backward has not passed yet, last layer first, then
        one flag point with `note`. The micro-batch is the one whose backward is
        incomplete (`micro_batch` names it where several are, as under a pipeline)."""
        if micro_batch is None:
            owed = self.backward_owed()
            micro_batch = owed[-1] if owed else None
        if micro_batch is not None:
            self.settle_reverse(micro_batch)
        return self.flag_point(None, note, device)[1]

    def settle_reverse(self, micro_batch: int) -> None:
        """The reverse exchanges of `micro_batch` that its backward has not made yet, in
        the order its peers' backward makes them (last layer first), with zeros."""
        for entry in reversed([e for e in self.exchanges if e.micro_batch == micro_batch]):
            if not entry.combine_reversed:   # the gradient of N rows out, of M rows in
                self._exchange(entry, entry.send_splits, entry.recv_splits)
                entry.combine_reversed = True
            if not entry.dispatch_reversed:  # the gradient of M rows out, of N rows in
                self._exchange(entry, entry.recv_splits, entry.send_splits)
                entry.dispatch_reversed = True

    def backward_owed(self) -> list[int]:
        """Micro-batches, in forward order, with a reverse exchange still to make."""
        owed: list[int] = []
        for e in self.exchanges:
            if not (e.combine_reversed and e.dispatch_reversed) and e.micro_batch not in owed:
                owed.append(e.micro_batch)
        return owed

    def _exchange(self, entry: Exchange, out_of: list[int], in_of: list[int]) -> None:
        """One exchange with zeros for rows: `out_of` rows sent to each rank, `in_of`
        received from each (the argument order of all_to_all_single is the reverse)."""
        send = torch.zeros(sum(out_of), entry.width, dtype=entry.dtype, device=entry.device)
        exchange(send, list(in_of), list(out_of), self.group.group_name)
