"""Top-k router: softmax scores, renormalised top-k weights, load-balancing loss.

T = tokens in the micro-batch, D = model width, E = experts, K = top-k.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class Routing:
    """What the router decided for one micro-batch."""

    topk_idx_TK: torch.Tensor      # int64 expert ids
    topk_weight_TK: torch.Tensor   # renormalised, same dtype as the scores
    scores_TE: torch.Tensor        # softmax probabilities over all experts
    aux_loss: torch.Tensor         # scalar load-balancing loss (unscaled)


def load_balancing_loss(scores_TE: torch.Tensor, topk_idx_TK: torch.Tensor) -> torch.Tensor:
    """Switch-Transformer auxiliary loss: E * sum_e f_e * P_e.

    f_e is the fraction of routed token copies sent to expert e (not differentiable),
    P_e the mean router probability of expert e. Equals 1 when routing is uniform.
    """
    num_tokens, num_experts = scores_TE.shape
    counts_E = torch.bincount(topk_idx_TK.reshape(-1), minlength=num_experts)
    fraction_E = counts_E.to(scores_TE.dtype) / topk_idx_TK.numel()
    mean_prob_E = scores_TE.mean(dim=0)
    return num_experts * torch.sum(fraction_E * mean_prob_E)


class TopKRouter(nn.Module):
    """Linear gate, softmax, top-k; an optional per-expert bias shifts only the selection.

    The bias (as in DeepSeek-V3's loss-free balancing) changes which experts are picked but
    not the combine weights, so it can steer load (skew injection uses it) without
    changing the value of the weights it picks.
    """

    def __init__(self, d_model: int, num_experts: int, top_k: int, use_bias: bool = False):
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(d_model, num_experts, bias=False)
        self.register_buffer("expert_bias_E", torch.zeros(num_experts), persistent=use_bias)
        self.use_bias = use_bias

    def forward(self, x_TD: torch.Tensor) -> Routing:
        scores_TE = torch.softmax(self.gate(x_TD).float(), dim=-1)
        if self.use_bias or bool(self.expert_bias_E.any()):
            _, topk_idx_TK = torch.topk(scores_TE + self.expert_bias_E, self.top_k, dim=-1)
            topk_score_TK = scores_TE.gather(-1, topk_idx_TK)
        else:
            topk_score_TK, topk_idx_TK = torch.topk(scores_TE, self.top_k, dim=-1)
        topk_weight_TK = topk_score_TK / topk_score_TK.sum(dim=-1, keepdim=True)
        aux = load_balancing_loss(scores_TE, topk_idx_TK)
        return Routing(topk_idx_TK, topk_weight_TK.to(x_TD.dtype), scores_TE, aux)
