"""Static bytes: parameters, their gradients and optimizer state, the part of the budget
that does not move with routing. Gradients are counted from the start (the first backward
allocates them and they stay); optimizer state from what the optimizer holds, or, before
its first step, from its kind (Adam/AdamW keep two moments per parameter).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

OPTIMIZER_STATES = {"Adam": 2, "AdamW": 2, "SGD": 1}


def static_bytes(model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None) -> int:
    params = list(model.parameters())
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    grad_bytes = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
    state_bytes = 0
    if optimizer is not None:
        measured = sum(t.numel() * t.element_size() for s in optimizer.state.values()
                       for t in s.values() if torch.is_tensor(t) and t.dim() > 0)
        per_param = OPTIMIZER_STATES.get(type(optimizer).__name__, 2)
        state_bytes = max(measured, per_param * grad_bytes)
    return param_bytes + grad_bytes + state_bytes
