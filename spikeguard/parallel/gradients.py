"""The gradient's reduction and its clip over a mesh: one place for every training engine
(the built-in engines, torchtitan's, the pipeline's).

A rank holds two kinds of gradient:
  * replicated: a parameter every rank of a group holds whole (each rank ran its own shard
    of the batch through it): its gradients are summed over the group (`sum_grads`);
  * sharded: a part only this rank holds (expert-parallel experts, FSDP2 shards,
    torchtitan's DTensor experts): no sum for the gradient, but its squared norm is summed
    over the group whose ranks hold the parts (`clip_grads_`).

Everything happens in place, one collective per parameter: no flat copy, which would be
device bytes allocated after the step's plan, where the device could refuse them with the
step already done (a flat buffer was 2.83 MiB on `small` at EP=2).
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch
import torch.distributed as dist

from spikeguard.memory.ledger import local_tensor
from spikeguard.parallel.release import reduced


def sum_grads(params: Iterable[torch.nn.Parameter], group) -> None:
    """Sum each parameter's gradient over `group`, in place. A gradient that is None on
    some ranks but not all is summed with zeros there (a mask is summed first), so every
    rank issues the same collectives; one with no gradient anywhere stays None."""
    params = [p for p in params if p.requires_grad]
    if not params:
        return
    has_grad = torch.tensor([p.grad is not None for p in params], dtype=torch.int32,
                            device=params[0].device)
    reduced(dist.all_reduce, has_grad, group=group)
    params = [p for p, n in zip(params, has_grad.tolist()) if n > 0]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    for p in params:
        dist.all_reduce(p.grad, group=group)


def clip_grads_(params: Iterable[torch.nn.Parameter], max_norm: float, *,
                sharded: Callable[[torch.nn.Parameter], bool] = lambda p: False,
                shard_group=None, stage_group=None) -> torch.Tensor:
    """Scale every gradient so the whole model's gradient norm is at most `max_norm`;
    the norm, the same on every rank.

    The squared norm is the replicated gradients' (counted once: equal on their replicas)
    plus the sharded ones' summed over `shard_group` (their parts), then summed over
    `stage_group` (a pipeline's stages hold different layers). With neither group, torch's
    own `clip_grad_norm_`."""
    params = [p for p in params if p.grad is not None]
    if shard_group is None and stage_group is None:
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    grads = [local_tensor(p.grad) for p in params]
    kinds = [sharded(p) for p in params]
    replicated = sum((g.float() ** 2).sum() for g, s in zip(grads, kinds) if not s)
    parts = torch.as_tensor(sum((g.float() ** 2).sum() for g, s in zip(grads, kinds) if s),
                            dtype=torch.float32).clone()
    if shard_group is not None:
        reduced(dist.all_reduce, parts, group=shard_group)
    total = torch.as_tensor(replicated, dtype=torch.float32) + parts
    if stage_group is not None:
        reduced(dist.all_reduce, total, group=stage_group)
    norm = total.sqrt()
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(coef)
    return norm


__all__ = ["clip_grads_", "sum_grads"]
