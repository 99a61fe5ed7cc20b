"""Shared pieces of the torchtitan tests: the tiny model, its data, one step, gradients."""

from __future__ import annotations

import warnings

import torch

from spikeguard.integrations.titan_models import TitanSizes, build_titan_model, lm_loss

# torchtitan's router asks CPU autocast for float32, which CPU autocast does not do.
warnings.filterwarnings("ignore", message="In CPU autocast")

SIZES = TitanSizes()       # 3 layers (1 dense, 2 MoE), 8 experts top-3, D=F=32
HUGE = "1GiB"


def build(ep: int = 1):
    return build_titan_model("deepseek_v3", SIZES, seed=0, ep=ep)


def batches(seed: int, num: int = 2, batch: int = 2, seq: int = 32):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 256, (batch, seq), generator=gen),
             torch.randint(0, 256, (batch, seq), generator=gen)) for _ in range(num)]


def local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def step(model, data, guard=None) -> list[torch.Tensor]:
    """One step of the micro-batches in `data`; this rank's gradients (local shards)."""
    for p in model.parameters():
        p.grad = None

    def body():
        for x, y in data:
            lm_loss(model, x, y).backward()

    if guard is not None:
        guard.run_step(body)
    else:
        body()
    return [local(p.grad).clone() for p in model.parameters()]


def bitwise(reference, actual) -> bool:
    return len(reference) == len(actual) and all(torch.equal(a, b)
                                                 for a, b in zip(reference, actual))


def moe_blocks(model):
    return [layer.moe for layer in model.layers.values() if getattr(layer, "moe", None) is not None]
