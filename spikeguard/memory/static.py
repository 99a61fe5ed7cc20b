"""Static bytes: parameters, their gradients and optimizer state, the part of the budget
that does not move with routing. Gradients are counted from the start (the first backward
allocates them and they stay); optimizer state from what the optimizer holds, or, before
its first step, from its kind (Adam/AdamW keep two moments per parameter).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from spikeguard.memory.ledger import local_tensor

OPTIMIZER_STATES = {"Adam": 2, "AdamW": 2, "SGD": 1}


def static_bytes(model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None) -> int:
    state_bytes = optimizer_state_bytes(model, optimizer)[0] if optimizer is not None else 0
    return parameter_bytes(list(model.parameters())) + state_bytes


def parameter_bytes(parameters: list) -> int:
    """The parameters' bytes and their gradients' (those that require one)."""
    # A sharded parameter (DTensor: FSDP2, expert parallelism) holds its local shard here.
    params = [local_tensor(p) for p in parameters]
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    grad_bytes = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
    return param_bytes + grad_bytes


def optimizer_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[int, int]:
    """(bytes the optimizer's state will hold from its first step on, bytes it holds now)."""
    grad_bytes = sum(local_tensor(p).numel() * p.element_size() for p in model.parameters()
                     if p.requires_grad)
    measured = sum(local_tensor(t).numel() * t.element_size() for s in optimizer.state.values()
                   for t in s.values() if torch.is_tensor(t) and t.dim() > 0)
    per_param = OPTIMIZER_STATES.get(type(optimizer).__name__, 2)
    return max(measured, per_param * grad_bytes), measured
