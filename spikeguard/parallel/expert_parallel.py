"""Expert parallelism: experts sharded over a process group, tokens exchanged by all-to-all.

T = tokens in this rank's micro-batch, D = model width, E = experts in the whole model,
L = experts local to this rank (E / ep), K = top-k, N = routed copies this rank sends
(T*K), M = routed copies this rank receives (its local experts' load), R = ep ranks.

    model = build_model(cfg)
    parallelize_experts(model, group)          # before the optimizer: new expert parameters
    guard = spikeguard.attach(model, budget=..., policy="adaptive")
    (model(x, y).loss / group_size).backward()
    allreduce_replicated_grads(model, group)

Rank r owns global experts [r*L, (r+1)*L). Dispatch, in the order of Megatron-Core's
dropless dispatcher: sort the local copies by global expert, exchange the per-expert counts,
bring them to the host (the decision window: from here the exact rows each local expert
will get are host integers), exchange the tokens, then regroup the received rows (ordered
source rank, then local expert) expert by expert.

Every collective here is a `torch.ops._c10d_functional` op (`all_to_all_single`, then
`wait_tensor`), which in torch 2.13 has its own autograd (backward: the reverse exchange).
The guard's checkpoint policies mark exactly those ops MUST_SAVE (runtime/executor.py,
ALWAYS_SAVED_OPS), so a recomputed region that contains a dispatch or combine replays the
cached exchange instead of communicating again, and ranks that take different memory
decisions in the same step still issue the same collectives. The older
`torch.distributed.nn.functional.all_to_all_single` also works on gloo with uneven splits,
but it is deprecated in 2.13 and its op (c10d.alltoall_base_) is re-run by a recompute:
with one rank recomputing a layer and its peers not, gloo aborts on mismatched sizes
(measured) or, with equal sizes, would hang or exchange the wrong rows.

The counts exchange is also the group's flag point (spikeguard.parallel.exchange_journal):
each rank sends its peers one note beside its counts, and the journal records what every
exchange of the step owes, so a rank whose attempt ran out of memory can still make them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist
# Imported for its side effect: it registers the autograd of the _c10d_functional ops
# (torch 2.13); without it their backward silently passes no gradient to the input.
import torch.distributed._functional_collectives  # noqa: F401
from torch import nn

from spikeguard.errors import UsageError
from spikeguard.model.dispatch import Dispatched
from spikeguard.model.moe import MoEBlock
from spikeguard.model.router import Routing
from spikeguard.parallel.exchange_journal import Exchange, ExchangeJournal
from spikeguard.parallel.gradients import sum_grads
from spikeguard.parallel.release import exchange
from spikeguard.runtime.agreement import Note, PeerFailed
from spikeguard.runtime.guard_arguments import attached_guard


@dataclass
class ExpertParallelDispatched(Dispatched):
    """A Dispatched whose rows were exchanged; keeps what combine needs to send them back."""

    send_splits: list[int] = field(default_factory=list)  # rows sent to each rank (sum N)
    recv_splits: list[int] = field(default_factory=list)  # rows from each rank (sum M)
    unsort_M: Optional[torch.Tensor] = None  # expert-grouped row -> its received position
    entry: Optional[Exchange] = None          # the journal's record of these exchanges


class ExpertParallelDispatcher:
    """Dispatch/combine over an expert-parallel group; same interface as LocalDispatcher."""

    def __init__(self, group: dist.ProcessGroup, num_experts_total: int,
                 journal: Optional[ExchangeJournal] = None):
        self.group = group
        self.ep_size = dist.get_world_size(group)
        self.ep_rank = dist.get_rank(group)
        check_divisible(num_experts_total, self.ep_size)
        self.num_experts_total = num_experts_total
        self.num_local_experts = num_experts_total // self.ep_size
        self.expert_lo = self.ep_rank * self.num_local_experts
        # One per model and group, shared by its blocks (parallelize_experts).
        self.journal = journal or ExchangeJournal(group, self.num_local_experts, 1)
        # Called with `exchange_bytes` once the counts are known, before any row of the
        # exchange is allocated: the guard's window evicts what they need beyond the budget
        # (installed by the built-in block's adapter, integrations/builtin.py).
        self.make_room: Optional[Callable[[int], None]] = None

    def dispatch(self, x_TD: torch.Tensor, routing: Routing) -> ExpertParallelDispatched:
        R, L = self.ep_size, self.num_local_experts
        top_k = routing.topk_idx_TK.shape[-1]
        expert_idx_N = routing.topk_idx_TK.reshape(-1)
        order_N = torch.argsort(expert_idx_N, stable=True)
        token_idx_N = order_N // top_k
        send_counts_E = torch.bincount(expert_idx_N, minlength=self.num_experts_total)
        # Row s of recv_counts_RL: copies rank s sends to each of this rank's experts; the
        # notes beside them say whether a peer's attempt failed (the flag point).
        recv_counts_RL, notes = self.journal.flag_point(send_counts_E, Note(), x_TD.device)
        if notes:
            raise PeerFailed(notes)
        # One host sync for both directions: the decision window opens here.
        send_RL, recv_RL = torch.stack([send_counts_E.view(R, L), recv_counts_RL]).tolist()
        send_splits = [sum(row) for row in send_RL]
        recv_splits = [sum(row) for row in recv_RL]
        entry = self.journal.record(send_splits, recv_splits, x_TD.shape[-1], x_TD.dtype,
                                    x_TD.device) if x_TD.requires_grad else None
        # Index work first, while no row of the exchange is alive: from here on the
        # dispatch allocates exactly `exchange_bytes` more, which the window can make room
        # for now (the counts are exact), not at the layer's entry on a guess.
        sort_M, unsort_M = _regroup_order(recv_counts_RL, R, L)
        if self.make_room is not None:
            self.make_room(exchange_bytes(len(token_idx_N), sum(recv_splits),
                                          x_TD.shape[-1] * x_TD.element_size(),
                                          routing.topk_weight_TK.element_size()))
        sent_ND = x_TD.index_select(0, token_idx_N)
        recv_MD = self._all_to_all(sent_ND, recv_splits, send_splits)
        if entry is not None:
            entry.dispatched = True
            # The gradient of what was sent arrives once dispatch's reverse exchange is done.
            sent_ND.register_hook(functools.partial(_mark, entry, "dispatch_reversed"))
        return ExpertParallelDispatched(
            x_ND=recv_MD.index_select(0, sort_M),
            tokens_per_expert=[sum(col) for col in zip(*recv_RL)],
            token_idx_N=token_idx_N,
            weight_N=routing.topk_weight_TK.reshape(-1).index_select(0, order_N),
            num_tokens=x_TD.shape[0],
            send_splits=send_splits,
            recv_splits=recv_splits,
            unsort_M=unsort_M,
            entry=entry,
        )

    def combine(self, y_MD: torch.Tensor, dispatched: ExpertParallelDispatched) -> torch.Tensor:
        recv_order_MD = y_MD.index_select(0, dispatched.unsort_M)
        y_ND = self._all_to_all(recv_order_MD, dispatched.send_splits, dispatched.recv_splits)
        entry = dispatched.entry
        if entry is not None and self.journal.recording():
            entry.combined = True
            if recv_order_MD.requires_grad:
                recv_order_MD.register_hook(functools.partial(_mark, entry, "combine_reversed"))
        weighted_ND = y_ND * dispatched.weight_N.unsqueeze(-1)
        out_TD = y_ND.new_zeros(dispatched.num_tokens, y_ND.shape[-1])
        return out_TD.index_add(0, dispatched.token_idx_N, weighted_ND)

    def _all_to_all(self, x: torch.Tensor, out_splits: list[int], in_splits: list[int]):
        """The exchange, its backward the reverse one, both through `release.exchange`."""
        return _Exchange.apply(x, out_splits, in_splits, self.group.group_name)


class _Exchange(torch.autograd.Function):
    """torch 2.13's own autograd of the functional all_to_all_single, but with
    `release.exchange` in both directions: its registered backward hands gloo a temporary (the gradient made
    contiguous) that nothing else holds, so it is freed on gloo's worker thread."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group_name):
        ctx.splits, ctx.group_name = (out_splits, in_splits), group_name
        return exchange(x, out_splits, in_splits, group_name)

    @staticmethod
    def backward(ctx, grad_out):
        out_splits, in_splits = ctx.splits
        return exchange(grad_out.contiguous(), in_splits, out_splits, ctx.group_name), None, None, None


def _regroup_order(recv_counts_RL: torch.Tensor, R: int, L: int):
    """(sort_M, unsort_M): received rows come source-major; a stable sort on the local
    expert id makes each expert's rows contiguous and keeps source order inside an expert,
    which is the row order a single process holding all experts would use for the same
    batch. unsort_M takes the expert-grouped rows back to their received positions."""
    local_expert_RL = torch.arange(L, device=recv_counts_RL.device).repeat(R, 1)
    local_expert_M = local_expert_RL.reshape(-1).repeat_interleave(recv_counts_RL.reshape(-1))
    sort_M = torch.argsort(local_expert_M, stable=True)
    return sort_M, torch.argsort(sort_M)


def exchange_bytes(num_sent: int, num_received: int, row_bytes: int, weight_bytes: int) -> int:
    """What `dispatch` allocates after its counts, all alive at once when it returns (the
    received rows freed only then): the N rows it sends, the M rows it receives, their copy
    regrouped by expert, and the N routing weights gathered in the sent rows' order.
    (Measured on the emulated device, `small` EP=2: the dispatch's peak above the in-use
    at `make_room` is this figure, or 176 bytes less where a small tensor was freed
    meanwhile; tests/runtime/test_runtime_entry_exchange.py.)"""
    return (num_sent + 2 * num_received) * row_bytes + num_sent * weight_bytes


def _mark(entry: Exchange, what: str, grad) -> None:
    setattr(entry, what, True)


def check_divisible(num_experts: int, ep_size: int) -> None:
    if num_experts % ep_size:
        raise UsageError(f"expert-parallel size {ep_size} must divide the number of experts "
                         f"({num_experts})")


def parallelize_experts(model: nn.Module, group: dist.ProcessGroup) -> nn.Module:
    """Keep this rank's slice of every MoE block's experts and install the EP dispatcher.

    Call on a finished model, identical on every rank (same seed), before building the
    optimizer and before `spikeguard.attach`: the expert weights become new Parameters
    holding only the local experts, so an optimizer made earlier would hold stale ones.
    """
    blocks = [m for m in model.modules() if isinstance(m, MoEBlock)]
    if not blocks:
        raise UsageError("no MoE block found in the model (looked for spikeguard MoEBlock)")
    if attached_guard(model) is not None:
        raise UsageError("parallelize_experts() must come before spikeguard.attach(): the "
                         "guard has already counted the full expert weights")
    ep_size = dist.get_world_size(group)
    for block in blocks:  # all checks before any change: a refused model stays usable
        if isinstance(block.dispatcher, ExpertParallelDispatcher):
            raise UsageError("parallelize_experts() was already applied to this model")
        check_divisible(block.experts.num_experts, ep_size)
    journal = ExchangeJournal(group, blocks[0].experts.num_experts // ep_size, len(blocks))
    for block in blocks:
        experts = block.experts
        dispatcher = ExpertParallelDispatcher(group, experts.num_experts, journal)
        lo, hi = dispatcher.expert_lo, dispatcher.expert_lo + dispatcher.num_local_experts
        experts.w13_ED2F = nn.Parameter(experts.w13_ED2F.detach()[lo:hi].clone())
        experts.w2_EFD = nn.Parameter(experts.w2_EFD.detach()[lo:hi].clone())
        experts.num_experts = hi - lo
        block.dispatcher = dispatcher
    return model


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The sharded parameters: the experts of every MoE block with an EP dispatcher."""
    return [p for m in model.modules()
            if isinstance(m, MoEBlock) and isinstance(m.dispatcher, ExpertParallelDispatcher)
            for p in m.experts.parameters()]


def allreduce_replicated_grads(model: nn.Module, group: dist.ProcessGroup) -> None:
    """Sum over the group the gradients of every parameter that is not a sharded expert
    (in place, one all_reduce per parameter: spikeguard.parallel.gradients).

    Each rank ran a different shard of the batch through its full copy of the replicated
    parameters (embeddings, attention, norms, routers, shared experts), so the whole
    batch's gradient is the sum of the ranks' gradients. Loss scaling: the loss is a mean
    over the rank's tokens, so with equal shards the whole batch's loss is the mean of the
    ranks' losses; backward `loss / group_size` on each rank and this sum give the
    single-process gradient over the whole batch (up to float rounding: the sum is taken
    in a different order). The expert gradients need no reduction:
    the reverse all-to-all already brought every rank's (scaled) contribution to the one
    rank that owns each expert. (The load-balancing loss is a product of batch means, so
    per-shard aux losses are not the whole batch's; only the cross-entropy part matches.)
    """
    sharded = {id(p) for p in expert_parameters(model)}
    sum_grads((p for p in model.parameters() if id(p) not in sharded), group)
