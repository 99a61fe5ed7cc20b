"""Checkpoints a restarted job resumes from, as a real training job's are.

Every `every` steps (and after the last) each rank writes its own file (under expert
parallelism the ranks hold different experts): model, optimizer, the training data
generator and torch's global RNG, and the step. The write is atomic: to a temporary file,
then renamed over the old one, so a rank that dies mid-write leaves the previous
checkpoint whole. A resumed run continues bitwise where the checkpointed one was (test).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from spikeguard.errors import UsageError


class Checkpointer:
    """Saves and restores one rank's training state in `folder`."""

    def __init__(self, folder: str | Path, every: int, rank: int = 0, resume: bool = False):
        if not isinstance(every, int) or isinstance(every, bool) or every <= 0:
            raise UsageError(f"checkpoint interval must be a positive integer, got {every!r}")
        folder = Path(folder)
        if folder.exists() and not folder.is_dir():
            raise UsageError(f"checkpoint folder {folder} is a file")
        if resume and not folder.is_dir():
            raise UsageError(f"cannot resume: checkpoint folder {folder} does not exist")
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / f"rank{rank}.pt"
        self.every = every
        self.resume = resume

    def restore(self, model: nn.Module, optimizer,
                generator: torch.Generator) -> int:
        """Load the last checkpoint when resuming; returns its step (0: start afresh)."""
        if not self.resume or not self.path.exists():
            return 0
        try:
            state = torch.load(self.path, weights_only=True)
            model.load_state_dict(state["model"])
            optimizers = _as_list(optimizer)
            saved = _as_list(state["optimizer"])
            if len(saved) != len(optimizers):
                raise ValueError(f"it holds {len(saved)} optimizer states, this rank has "
                                 f"{len(optimizers)}")
            for opt, opt_state in zip(optimizers, saved):
                opt.load_state_dict(opt_state)
        except (RuntimeError, KeyError, ValueError, EOFError) as err:
            raise UsageError(f"checkpoint {self.path} does not fit this run: "
                             f"{str(err).splitlines()[0]}") from None
        generator.set_state(state["generator"])
        torch.set_rng_state(state["torch_rng"])
        return int(state["step"])

    def after_step(self, step: int, model: nn.Module, optimizer,
                   generator: torch.Generator, last: bool) -> bool:
        """Save when `step` is on the interval or the last; returns whether it saved."""
        if step % self.every and not last:
            return False
        tmp = self.path.with_name(self.path.name + ".tmp")
        torch.save({"step": step, "model": model.state_dict(),
                    "optimizer": [o.state_dict() for o in optimizer]
                    if isinstance(optimizer, (list, tuple)) else optimizer.state_dict(),
                    "generator": generator.get_state(),
                    "torch_rng": torch.get_rng_state()}, tmp)
        os.replace(tmp, self.path)
        return True


def _as_list(value) -> list:
    """One optimizer (or its state), or a pipeline rank's list of them (one per stage)."""
    return list(value) if isinstance(value, (list, tuple)) else [value]
