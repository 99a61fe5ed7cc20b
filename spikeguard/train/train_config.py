"""How long and how to train (`TrainConfig`, validated on creation), and the optimizer
those settings describe: the loop's settings, apart from the loop so that the run's
configuration (train/config.py) and the families can read them without importing it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
from torch import nn

from spikeguard.errors import UsageError
from spikeguard.train.typed_settings import is_real

# Steps, batch sizes, micro-batches: far past any real run, and where torch's int64
# arithmetic (and the seeds offset per shard) stays exact.
MAX_COUNT = 2**31 - 1
MAX_SEED = 2**62


@dataclass(kw_only=True)
class TrainConfig:
    """How long and how to train; validated on creation (UsageError on a bad value)."""

    steps: int = 100
    batch_size: int = 8          # sequences per micro-batch
    micro_batches: int = 1       # micro-batches accumulated into one optimizer step
    lr: float = 3e-3
    weight_decay: float = 0.1
    grad_clip: float = 1.0       # max global gradient norm
    seed: int = 0
    eval_every: int = 50         # steps between validation losses (also one at the end)
    eval_batches: int = 4        # fixed validation batches of batch_size sequences

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "micro_batches", "eval_every", "eval_batches"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise UsageError(f"train.{name} must be a positive integer, got {value!r}")
            if value > MAX_COUNT:
                raise UsageError(f"train.{name} must be at most {MAX_COUNT}, got {value:.3g}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0:
            raise UsageError(f"train.seed must be a non-negative integer, got {self.seed!r}")
        if self.seed > MAX_SEED:
            raise UsageError(f"train.seed must be at most {MAX_SEED} (torch's generators take "
                             f"64-bit seeds, offset per shard), got {self.seed:.3g}")
        for name in ("lr", "grad_clip"):
            value = getattr(self, name)
            if not is_real(value) or not math.isfinite(value) or value <= 0:
                raise UsageError(f"train.{name} must be a positive number, got {value!r}")
        if not is_real(self.weight_decay) or not math.isfinite(self.weight_decay) \
                or self.weight_decay < 0:
            raise UsageError(f"train.weight_decay must be >= 0, got {self.weight_decay!r}")

    def to_dict(self) -> dict:
        return asdict(self)


def make_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW; weight decay only on matrices (decaying norm gains and biases pulls them
    toward zero for no regularisation benefit)."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.dim() >= 2 else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr)
