"""The MoE feed-forward block, in named phases: route -> (decide) -> dispatch -> experts -> combine.

T = tokens in the micro-batch, D = model width, E = experts, K = top-k, N = T*K.

The seam for the memory runtime is `expert_runner`: after dispatch the exact per-expert
token counts are host integers, and the experts have not run yet. By default the experts
run plainly; `spikeguard.attach` installs a runner that plans and executes them under a
memory plan. `dispatcher` is the second seam: expert parallelism swaps in a dispatcher
whose dispatch is an all-to-all. The model code itself never imports torch.distributed.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from spikeguard.model.dispatch import Dispatched, LocalDispatcher
from spikeguard.model.experts import SwiGLU, SwiGLUExperts
from spikeguard.model.router import Routing, TopKRouter

# (block, dispatched) -> y_ND; installed by the memory runtime.
ExpertRunner = Callable[["MoEBlock", Dispatched], torch.Tensor]


class MoEBlock(nn.Module):
    """Top-k routed SwiGLU experts plus an optional shared expert."""

    def __init__(self, d_model: int, num_experts: int, top_k: int, d_expert: int,
                 num_shared_experts: int = 0, router_bias: bool = False, layer_idx: int = 0):
        super().__init__()
        self.layer_idx = layer_idx
        self.router = TopKRouter(d_model, num_experts, top_k, use_bias=router_bias)
        self.experts = SwiGLUExperts(num_experts, d_model, d_expert)
        self.shared = SwiGLU(d_model, d_expert * num_shared_experts) if num_shared_experts else None
        self.dispatcher = LocalDispatcher()
        self.expert_runner: Optional[ExpertRunner] = None
        self.last_tokens_per_expert: list[int] = []
        self.last_aux_loss: Optional[torch.Tensor] = None

    def route(self, x_TD: torch.Tensor) -> Routing:
        return self.router(x_TD)

    def dispatch(self, x_TD: torch.Tensor, routing: Routing) -> Dispatched:
        return self.dispatcher.dispatch(x_TD, routing)

    def run_experts(self, dispatched: Dispatched) -> torch.Tensor:
        """The decision window: counts are known here, the experts have not run."""
        if self.expert_runner is not None:
            return self.expert_runner(self, dispatched)
        return self.experts(dispatched.x_ND, dispatched.tokens_per_expert)

    def combine(self, y_ND: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        return self.dispatcher.combine(y_ND, dispatched)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        x_TD = x_BTD.reshape(-1, x_BTD.shape[-1])
        routing = self.route(x_TD)
        dispatched = self.dispatch(x_TD, routing)
        self.last_tokens_per_expert = dispatched.tokens_per_expert
        self.last_aux_loss = routing.aux_loss
        out_TD = self.combine(self.run_experts(dispatched), dispatched)
        if self.shared is not None:
            out_TD = out_TD + self.shared(x_TD)
        return out_TD.reshape(x_BTD.shape)
