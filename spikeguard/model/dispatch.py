"""Sort-based dispatch and combine on one process (all experts local).

T = tokens, D = model width, E = experts, K = top-k, N = routed token copies (T*K).
Dispatch permutes token copies so each expert's tokens are contiguous and brings the
per-expert counts to the host: that host list is the decision window of spikeguard.
The expert-parallel dispatcher (spikeguard.parallel) has the same interface.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spikeguard.model.router import Routing


@dataclass
class Dispatched:
    """Tokens laid out expert by expert, plus what combine needs to undo it."""

    x_ND: torch.Tensor               # token copies, grouped by local expert
    tokens_per_expert: list[int]      # host ints, one per local expert
    token_idx_N: torch.Tensor         # source token of each copy (for combine)
    weight_N: torch.Tensor            # combine weight of each copy
    num_tokens: int                   # T, rows of the combined output


def expert_imbalance(tokens_per_expert_E: list[int]) -> float:
    """max / mean tokens per expert: 1.0 is perfectly even, E means one expert got all."""
    total = sum(tokens_per_expert_E)
    if total == 0:
        return 1.0
    return max(tokens_per_expert_E) * len(tokens_per_expert_E) / total


class LocalDispatcher:
    """All experts on this process: a stable argsort of the expert ids."""

    def dispatch(self, x_TD: torch.Tensor, routing: Routing) -> Dispatched:
        num_experts = routing.scores_TE.shape[-1]
        top_k = routing.topk_idx_TK.shape[-1]
        expert_idx_N = routing.topk_idx_TK.reshape(-1)
        order_N = torch.argsort(expert_idx_N, stable=True)
        token_idx_N = order_N // top_k
        counts_E = torch.bincount(expert_idx_N, minlength=num_experts)
        return Dispatched(
            x_ND=x_TD.index_select(0, token_idx_N),
            tokens_per_expert=counts_E.tolist(),
            token_idx_N=token_idx_N,
            weight_N=routing.topk_weight_TK.reshape(-1).index_select(0, order_N),
            num_tokens=x_TD.shape[0],
        )

    def combine(self, y_ND: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        weighted_ND = y_ND * dispatched.weight_N.unsqueeze(-1)
        out_TD = y_ND.new_zeros(dispatched.num_tokens, y_ND.shape[-1])
        return out_TD.index_add(0, dispatched.token_idx_N, weighted_ND)
