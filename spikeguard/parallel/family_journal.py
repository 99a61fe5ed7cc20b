"""Flag points and settlement where the expert-parallel exchanges are a family's own.

transformers' `AllToAllEP` (v5.24) makes, per MoE layer: a counts exchange (a plain
`all_to_all_single` of (R, L) counts), the dispatch and the combine (functional
all-to-alls); FSDP2 all-gathers each unit's parameters (embeddings, each decoder layer,
the head) in its forward pre-hook. None of them is spikeguard's, so none can carry a note.
This module observes them (it never re-implements them) and adds its own flag points:

    per FSDP unit, in forward:  [flag point] -> FSDP all-gather -> (decoder layer:
        [the whole-layer fallback vote: a flag point too] -> counts -> dispatch -> window
        -> combine)
    end of a forward attempt, end of a step: [flag point]

A vote also carries each rank's promise that no later layer of the attempt will need the
fallback (runtime/window.py `DecisionWindow.promise`); once every rank has promised, the
later layers of the attempt vote no more (each a no, on every rank alike): one or two
votes a micro-batch on a calm step instead of one per layer.

R = ranks of the EP group, L = experts local to a rank, M = rows a rank receives, D =
model width. Every flag point is one all-gather of (note, vote, promise) rows
(GroupAgreement.gather), so a failed rank's one flag point meets each peer at its next
one, whichever it is. The span between two flag points is a *segment*; the journal knows
how far the failed rank's segment got and makes, with zeros, what its peers wait in: the
counts exchange (zero counts sent, the peers' received), the dispatch (no rows sent, the
peers' rows received), the combine (rows of the received sizes sent back). A refusal
inside transformers' dispatch or combine (their own allocations around the all-to-alls)
is placed by the EP group's count of collectives this rank has issued (its sequence
number) since the phase began: a combine whose all-to-all was issued owes nothing (its
peers have theirs and went on; making it again hung the job in gloo until its timeout),
a dispatch that issued none owes all three. A refusal in backward replays with zeros the
rest of the backward's collectives as an earlier step's made them (family_backward).
Where it cannot know (a refusal inside FSDP's all-gather or inside transformers'
dispatch, between its counts and its rows; a backward with no template), the job ends on
every rank in one agreed line instead (GroupAgreement.end_job).
A rank that meets a peer's note, and the failed rank once it has settled, put FSDP back
as every rank holds it then (`reset_iter_state`: every unit resharded), so that the
re-run's all-gathers match.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from spikeguard.parallel.agreement import GroupAgreement
from spikeguard.parallel.family_backward import Span, alike, counted_whole, remaining, replay
from spikeguard.parallel.release import exchange, handed, let_go, released
from spikeguard.runtime.agreement import STEP, Note, PeerFailed
from spikeguard.runtime.fsdp import gradient_sync


@dataclass
class Segment:
    """How far this rank got between two flag points of a forward attempt."""

    gathered: bool = True          # the FSDP unit's all-gather done (or none to make)
    impl: object = None            # the AllToAllEP of the unit's MoE layer, if it has one
    voted: bool = False
    exchange: str = ""             # "", "dispatching", "dispatched", "combining", "combined"
    issued: Optional[int] = None   # the EP group's collectives issued when the phase began
    send_sizes: list = field(default_factory=list)
    recv_sizes: list = field(default_factory=list)


def recording() -> bool:
    """A forward, not backward's recompute (which replays the saved exchanges)."""
    return torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1


class FamilyAgreement(GroupAgreement):
    """GroupAgreement for transformers' own EP: its flag points at every FSDP unit's
    forward and at the layer votes; the failed rank's segment settled from the journal."""

    def __init__(self, group, model: nn.Module, width: int, dtype: torch.dtype):
        super().__init__(group)
        self.model, self.width, self.dtype = model, width, dtype
        self.open = False              # a forward attempt is in progress
        self.votes = False             # its MoE layers vote on the whole-layer fallback
        self.promised = False          # every rank promised: its later layers vote no more
        self.segment = Segment()
        self.unit_impls: dict[int, object] = {}   # id(FSDP unit) -> its layer's AllToAllEP
        self.patched: list = []
        self.handles: list = []
        self.hooked: set[int] = set()
        self.micro_batch = 0
        self.exchanges: list = []      # this attempt's (send, recv) sizes, layer by layer
        self.decisions: list = []      # this attempt's whole-layer votes, in order
        self.span: Optional[Span] = None
        self.templates: dict = {}      # Span.key -> the last complete span's template
        self.confirmed: set = set()    # keys whose last two spans were alike: not watched

    # ---- what is observed ---------------------------------------------------------------
    def observe(self, impl, unit: Optional[nn.Module]) -> None:
        """Watch `impl`'s dispatch and combine (the AllToAllEP of a layer in FSDP `unit`);
        the first call also puts the flag points on every FSDP unit with peers."""
        if not self.handles:
            for fsdp_unit in self.model.modules():
                if (isinstance(fsdp_unit, FSDPModule) and fsdp_unit is not self.model
                        and _spans_peers(fsdp_unit)):
                    self._hook(fsdp_unit)
        if unit is not None:
            self._hook(unit)   # its decoder layer, where no FSDP unit holds it
            self.unit_impls[id(unit)] = impl
        dispatch, combine = impl._dispatch_tokens, impl._combine_tokens

        def dispatch_tokens(*args):
            if not (self.open and recording()):
                return dispatch(*args)
            self.segment.exchange, self.segment.issued = "dispatching", issued(impl)
            tokens, ids, weights, state = dispatch(*args)
            self.segment.send_sizes = list(state.send_sizes)
            self.segment.recv_sizes = list(state.recv_sizes)
            self.exchanges.append((self.segment.send_sizes, self.segment.recv_sizes))
            self.segment.exchange = "dispatched"
            return tokens, ids, weights, state

        def combine_tokens(*args):
            if not (self.open and recording()):
                return released(combine, *args)
            self.segment.exchange, self.segment.issued = "combining", issued(impl)
            out = released(combine, *args)
            self.segment.exchange = "combined"
            return out
        impl._dispatch_tokens, impl._combine_tokens = dispatch_tokens, combine_tokens
        self.patched.append(impl)

    def close(self) -> None:
        """Every hook and wrapper removed (detach)."""
        self._end_span(keep=False)
        self.templates, self.confirmed = {}, set()
        for impl in self.patched:
            for name in ("_dispatch_tokens", "_combine_tokens"):
                vars(impl).pop(name, None)
        for handle in self.handles:
            handle.remove()
        self.patched, self.handles, self.unit_impls, self.hooked = [], [], {}, set()

    def _hook(self, unit: nn.Module) -> None:
        """A flag point ahead of `unit`'s forward pre-hooks (FSDP's all-gather), and a mark
        after them."""
        if id(unit) in self.hooked:
            return
        self.hooked.add(id(unit))
        self.handles.append(unit.register_forward_pre_hook(self._unit_entered, prepend=True))
        self.handles.append(unit.register_forward_pre_hook(self._unit_gathered))

    def _unit_entered(self, unit, args) -> None:
        """Before FSDP's all-gather of `unit`: a flag point, then a new segment."""
        if not (self.open and recording()):
            return
        self._meet(self.gather(Note())[0])
        self.segment = Segment(gathered=False, impl=self.unit_impls.get(id(unit)))

    def _unit_gathered(self, unit, args) -> None:
        if self.open and recording():
            self.segment.gathered = True

    def _meet(self, notes: list[Note]) -> None:
        """A peer's note met inside the forward: FSDP put back, then PeerFailed."""
        if notes:
            self._reset_fsdp()
            raise PeerFailed(notes)

    # ---- the protocol -------------------------------------------------------------------
    def any_rank(self, mine: bool) -> bool:
        """A vote outside a layer's (attach): one gather."""
        return self.gather(Note(), mine)[1]

    def vote(self, mine: bool, promise) -> bool:
        """A layer's whole-layer fallback vote, a flag point too, carrying this rank's
        promise that no later layer of the attempt needs the fallback. Once every rank
        has promised (and none voted yes), the attempt's later layers do not gather: each
        counts as a no, on every rank alike, and a rank that fails in one of them settles
        its exchanges as where no vote is to come (`_settle`). On a calm step of
        qwen3_moe EP=2 each vote is a sync point: the four layers' votes took 12 ms of a
        330 ms step under cProfile (CPU, emulated device)."""
        if not (self.open and recording()):
            return self.gather(Note(), mine)[1]
        if self.promised:
            self.decisions.append(False)
            return False
        self.segment.voted = True
        notes, vote, promised = self.gather(Note(), mine, not mine and promise())
        self._meet(notes)
        self.decisions.append(vote)
        self.promised = promised and not vote
        return vote

    def begin_step(self) -> None:
        self.open = False
        self._end_span(keep=False)

    def begin_attempt(self, micro_batch: int, layer_votes: bool = False) -> None:
        self.open, self.votes, self.segment = True, layer_votes, Segment()
        self.promised = False
        self.micro_batch, self.exchanges, self.decisions = micro_batch, [], []

    def flag_point(self, note: Note) -> list[Note]:
        forward_ends = self.open and recording()
        self.open = False
        notes = self.gather(note)[0]
        if notes:
            self._reset_fsdp()
        elif forward_ends:   # its backward's collectives recorded up to the next flag point
            # FSDP2's reduction on or deferred (runtime/fsdp.py gradient_sync): a backward
            # that reduces makes collectives one that defers does not (transformers'
            # Trainer defers them on an accumulation window's micro-batches but the last;
            # a template of the other kind replayed no reduce-scatter: the peers hung in it)
            key = (self.micro_batch, self.votes, tuple(self.decisions),
                   gradient_sync(self.model))
            self.span = Span(key, self.exchanges, watch=key not in self.confirmed)
            self.span.begin()
        return notes

    def gather(self, note: Note, vote: bool = False,
               promise: bool = False) -> tuple[list[Note], bool, bool]:
        self._end_span(keep=True)
        return super().gather(note, vote, promise)

    def _settle_forward(self, note: Note) -> list[Note]:
        """This rank's forward attempt failed (and was freed): its segment's exchanges with
        zeros, then one flag point; where the segment cannot be settled, the job ends."""
        if not (self.open and self._settle(self.segment)):
            return self.end_job(note)
        return self.flag_point(note)

    def _settle_backward(self, note: Note, micro_batch: Optional[int]) -> list[Note]:
        """This rank's backward failed (its attempt freed): the rest of the backward's
        collectives with zeros, by the template of an earlier step's (family_backward),
        then one flag point; where the rest is not known, the job ends."""
        self.open = False
        span, self.span = self.span, None
        owed = None
        if span is not None and span.end() and note.kind == STEP:
            owed = remaining(span, self.templates.get(span.key))
        if owed is None:
            return self.end_job(note)
        replay(owed)
        return self.flag_point(note)

    def _end_span(self, keep: bool) -> None:
        """The span ends at a flag point: its template kept for the steps to come
        (dropped where its count is not known). A key whose span was alike twice is
        confirmed: its next spans are only counted, per group, not watched; one whose
        counts differ from its template is dropped (watched again from scratch)."""
        span, self.span = self.span, None
        if span is None:
            return
        known = span.end() and keep
        template = self.templates.get(span.key)
        if known and span.watch:
            self.templates[span.key] = span.template()
            if alike(template, span) and self.templates[span.key] is not None:
                self.confirmed.add(span.key)
        elif not (known and counted_whole(span, template)):
            self.templates.pop(span.key, None)
            self.confirmed.discard(span.key)

    # ---- settling ---------------------------------------------------------------------
    def _settle(self, seg: Segment) -> bool:
        """Make what the peers wait in before their next flag point; False if unknown."""
        if not seg.gathered:
            return False
        if seg.impl is None or seg.exchange == "combined":
            return True
        if seg.exchange in ("dispatching", "combining"):
            made = _made_since(seg)
            if seg.exchange == "combining":
                if made is None:
                    return False
                if made:
                    return True   # the combine's all-to-all is made: the peers went on
                seg.exchange = "dispatched"
            elif made != 0:
                return False   # between transformers' counts and rows: not known which
            else:
                seg.exchange = ""   # refused before its counts: the whole exchange owed
        if seg.exchange == "":
            if self.votes and not (seg.voted or self.promised):
                return True   # the flag point to come meets the peers' vote
            seg.send_sizes, seg.recv_sizes = self._zero_dispatch(seg.impl)
        self._exchange(seg.impl, seg.recv_sizes, seg.send_sizes)   # the combine
        return True

    def _zero_dispatch(self, impl) -> tuple[list, list]:
        """The counts exchange (zeros sent) and the dispatch (no rows sent)."""
        group, R = impl.ep_mesh.get_group(), impl.ep_mesh.size()
        send_RL = torch.zeros(R, impl.num_local_experts, dtype=torch.long, device=self.device)
        recv_RL = torch.empty_like(send_RL)
        views, marks = handed((recv_RL, send_RL))
        dist.all_to_all_single(*views, group=group)
        del views
        let_go(marks)
        send_sizes, recv_sizes = [0] * R, recv_RL.sum(dim=1).tolist()
        self._exchange(impl, send_sizes, recv_sizes)
        return send_sizes, recv_sizes

    def _exchange(self, impl, out_of: list, in_of: list) -> None:
        """One all-to-all of zero rows: `out_of` rows to each rank, `in_of` from each."""
        send = torch.zeros(sum(out_of), self.width, dtype=self.dtype, device=self.device)
        exchange(send, list(in_of), list(out_of), impl.ep_mesh.get_group().group_name)

    def _reset_fsdp(self) -> None:
        """FSDP2's own recovery after an aborted forward: every unit resharded, its
        iteration state cleared (torch 2.13 `reset_iter_state`, on the root)."""
        if isinstance(self.model, FSDPModule):
            self.model.reset_iter_state()


def issued(impl) -> Optional[int]:
    """How many collectives this rank has issued on `impl`'s EP group (the group's
    sequence number; no public accessor), or None where the backend does not count.
    Each collective counts once issued, and not when its output's allocation is refused
    (checked: gloo, torch 2.13, CPU; NCCL, torch 2.11, one H200, a CUDA out-of-memory
    at a functional all-to-all's output left the count as it was)."""
    try:
        return int(impl.ep_mesh.get_group()._get_sequence_number_for_group())
    except (AttributeError, RuntimeError):
        return None


def _made_since(seg: Segment) -> Optional[int]:
    """The collectives issued on the EP group since `seg`'s phase began (None: unknown)."""
    now = issued(seg.impl)
    return None if now is None or seg.issued is None else now - seg.issued


def _spans_peers(unit: nn.Module) -> bool:
    """Whether FSDP's all-gather of `unit` involves other ranks (experts kept whole on an
    efsdp mesh of one rank gather alone)."""
    groups = getattr(unit._get_fsdp_state(), "_fsdp_param_groups", None) or []
    return any(g.mesh_info.mesh.size() > 1 for g in groups)


def unit_of(model: nn.Module, module: nn.Module) -> Optional[nn.Module]:
    """The innermost FSDP unit with peers that holds `module` (its decoder layer), or None
    (no FSDP: the caller names the decoder layer)."""
    names = {id(m): n for n, m in model.named_modules()}
    name = names.get(id(module), "")
    best = None
    for n, m in model.named_modules():
        if (m is not model and isinstance(m, FSDPModule) and m is not module
                and name.startswith(n + ".") and _spans_peers(m)):
            if best is None or len(n) > len(best[0]):
                best = (n, m)
    return best[1] if best else None
