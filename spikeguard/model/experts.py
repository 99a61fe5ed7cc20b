"""SwiGLU experts, computed expert by expert on contiguous slices.

N = routed token copies on this process, D = model width, F = expert hidden width,
E = local experts. The computation is split into three stages with names, because the
memory runtime decides per stage what to keep for backward:

    x_ND --gate_up--> h_N2F --act--> a_NF --down--> y_ND
                     (silu(h[:, :F]) * h[:, F:])
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def _split_rows(x: torch.Tensor, tokens_per_expert: list[int]) -> tuple[torch.Tensor, ...]:
    return torch.split(x, tokens_per_expert, dim=0)


class SwiGLUExperts(nn.Module):
    """E experts with fused gate/up weights `w13_ED2F` and down weights `w2_EFD`."""

    def __init__(self, num_experts: int, d_model: int, d_expert: int):
        super().__init__()
        self.num_experts = num_experts
        self.d_expert = d_expert
        self.w13_ED2F = nn.Parameter(torch.empty(num_experts, d_model, 2 * d_expert))
        self.w2_EFD = nn.Parameter(torch.empty(num_experts, d_expert, d_model))
        nn.init.normal_(self.w13_ED2F, std=1.0 / math.sqrt(d_model))
        nn.init.normal_(self.w2_EFD, std=1.0 / math.sqrt(d_expert))

    def gate_up(self, x_ND: torch.Tensor, tokens_per_expert: list[int]) -> torch.Tensor:
        parts = _split_rows(x_ND, tokens_per_expert)
        return torch.cat([p @ self.w13_ED2F[e] for e, p in enumerate(parts)], dim=0)

    @staticmethod
    def act(h_N2F: torch.Tensor) -> torch.Tensor:
        gate_NF, up_NF = h_N2F.chunk(2, dim=-1)
        return F.silu(gate_NF) * up_NF

    def down(self, a_NF: torch.Tensor, tokens_per_expert: list[int]) -> torch.Tensor:
        parts = _split_rows(a_NF, tokens_per_expert)
        return torch.cat([p @ self.w2_EFD[e] for e, p in enumerate(parts)], dim=0)

    def forward(self, x_ND: torch.Tensor, tokens_per_expert: list[int]) -> torch.Tensor:
        if sum(tokens_per_expert) != x_ND.shape[0] or len(tokens_per_expert) != self.num_experts:
            raise ValueError(
                f"tokens_per_expert {tokens_per_expert} does not match {x_ND.shape[0]} rows "
                f"and {self.num_experts} experts")
        return self.down(self.act(self.gate_up(x_ND, tokens_per_expert)), tokens_per_expert)


def stage_functions(experts: SwiGLUExperts, tokens_per_expert: list[int]) -> dict:
    """The four stages of SwiGLUExperts.forward (the planner's operators gate_up, silu,
    act, down), each a function of the tensors so far, by stage name ("dispatch" is
    the input): what the executor runs one by one and the cost model times."""
    return {
        "gate_up": lambda t: experts.gate_up(t["dispatch"], tokens_per_expert),
        "silu": _silu_stage,
        "act": _act_stage,
        "down": lambda t: experts.down(t["act"], tokens_per_expert),
    }


def _silu_stage(t: dict) -> torch.Tensor:
    """silu of the gate half; the up half of the same `chunk` is left in `t` for act.
    One chunk for both halves is one SplitBackward, as in `SwiGLUExperts.act`: two would
    each build a zero-padded 2F-wide gradient and add them (measured: +5% of a calm
    step's time on `small`, CPU)."""
    gate_NF, t["up"] = t["gate_up"].chunk(2, dim=-1)
    return F.silu(gate_NF)


def _act_stage(t: dict) -> torch.Tensor:
    """silu(gate) * up; `up` from silu's chunk when it ran in the same scope (a region
    starting at act takes gate_up as its input and chunks it again)."""
    up_NF = t["up"] if "up" in t else t["gate_up"].chunk(2, dim=-1)[1]
    return t["silu"] * up_NF


class SwiGLU(nn.Module):
    """A dense SwiGLU feed-forward (the shared expert)."""

    def __init__(self, d_model: int, d_hidden: int):
        super().__init__()
        self.w13 = nn.Linear(d_model, 2 * d_hidden, bias=False)
        self.w2 = nn.Linear(d_hidden, d_model, bias=False)

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        return self.w2(SwiGLUExperts.act(self.w13(x_TD)))
