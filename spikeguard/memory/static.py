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


class StaticWalk:
    """The static bytes of a model and its optimizers, and the storage keys of its
    parameters, read at every step's start; walked again only when something they depend
    on changed. A walk of every parameter and optimizer state was ~220 of the guard's
    Python calls on a calm step of `small` (about a sixth of them under policy none).

    What is checked each step without a Python call per parameter: the parameters (which,
    their storages, their sizes) and each optimizer's count of parameters and of states.
    A parameter that is not a plain `nn.Parameter` (a DTensor: FSDP2, torchtitan's expert
    parallelism) has no storage pointer of its own to compare: such a model is walked at
    every step, as before."""

    def __init__(self, model: nn.Module, optimizers: list, state_bytes):
        self.model = model
        self.optimizers = optimizers
        self.state_bytes = state_bytes   # optimizer -> the bytes its state will hold
        self._seen: Optional[tuple] = None
        self._answer: tuple[int, set] = (0, set())

    def read(self, storage_key) -> tuple[int, set]:
        """(static bytes, the parameters' storage keys by `storage_key`)."""
        params = list(self.model.parameters())
        seen = _signature(params, self.optimizers)
        if seen is None or seen != self._seen:
            num_bytes = parameter_bytes(params) + sum(self.state_bytes(o) for o in self.optimizers)
            self._answer = (num_bytes, {storage_key(p) for p in params})
            self._seen = seen
        return self._answer


def _signature(params: list, optimizers: list) -> Optional[tuple]:
    plain = nn.Parameter
    if any([type(p) is not plain for p in params]):
        return None
    return (tuple([(p.data_ptr(), p.numel(), p.element_size(), p.requires_grad)
                   for p in params]),
            tuple([(id(o), len(o.state), sum([len(g["params"]) for g in o.param_groups]))
                   for o in optimizers]))
