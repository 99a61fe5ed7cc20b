"""What `spikeguard.attach` accepts, checked once before a guard is built, and the few
questions about a model and its optimizers the guard and its callers ask
(spikeguard/runtime/guard.py is the guard itself).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence, Union

import torch
from torch import nn

from spikeguard.errors import UsageError
from spikeguard.runtime.policies import POLICIES, check_policies
from spikeguard.runtime.wiring import OptimizerScope

Optimizers = Union[torch.optim.Optimizer, Sequence[torch.optim.Optimizer], None]


def attached_guard(model: nn.Module):
    """The guard attached to `model` (or to a module of it that attach was given), if any."""
    return getattr(model, "_spikeguard", None)


def mark_attached(model: nn.Module, guard) -> None:
    """Say on `model` which guard is attached to it (None: none is)."""
    model._spikeguard = guard


def as_optimizers(optimizer: Optimizers) -> tuple:
    """`attach`'s optimizer argument as a tuple: () for None, one for one."""
    if optimizer is None:
        return ()
    if isinstance(optimizer, (list, tuple)):
        return tuple(optimizer)
    return (optimizer,)


def check_arguments(model, optimizer, policy: str, shared_policy: str,
                    memory_snapshot=None) -> None:
    """attach()'s arguments, each refused in one line (UsageError) naming what to pass."""
    if not isinstance(model, nn.Module):
        raise UsageError(f"attach() needs a torch.nn.Module, got {type(model).__name__}")
    bad = [o for o in as_optimizers(optimizer) if not isinstance(o, torch.optim.Optimizer)]
    if bad:
        raise UsageError(f"optimizer must be a torch.optim.Optimizer, a list of them, or "
                         f"None, got {type(bad[0]).__name__}")
    OptimizerScope.check_free(as_optimizers(optimizer))
    if policy is None:
        raise UsageError(f"attach() needs a policy; choose one of {', '.join(POLICIES)}")
    check_policies(policy, shared_policy)
    check_snapshot_folder(memory_snapshot)
    if attached_guard(model) is not None:
        raise UsageError("this model already has a spikeguard attached; detach() it first")


def check_snapshot_folder(folder) -> None:
    """`memory_snapshot`: None, or a path that is a folder or can be made one."""
    if folder is None:
        return
    if not isinstance(folder, (str, os.PathLike)) or not str(folder):
        raise UsageError(f"memory_snapshot must be a folder's path or None, got {folder!r}")
    existing = Path(folder)
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise UsageError(f"memory_snapshot {folder} cannot be a folder: {existing} is a file")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UsageError(f"memory_snapshot {folder}: {existing} is not writable")


class OptimizerParameters:
    """An optimizer's parameters where `optimizer_state_bytes` reads a model's."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer

    def parameters(self):
        return (p for group in self.optimizer.param_groups for p in group["params"])
