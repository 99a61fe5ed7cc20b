"""FSDP2 as the guard sees it: each unit's real sizes, read from its parameter groups, and
the reset of an attempt that a refusal abandoned mid-flight (`reset_after_failed_attempt`).

FSDP2 (`torch.distributed.fsdp.fully_shard`; torchtitan applies it even on one rank,
transformers under `DistributedConfig`) keeps each parameter's local shard and all-gathers
the unsharded parameters around each unit's forward and again in its backward, with the
next unit's all-gather issued early in backward (prefetch), then reduce-scatters the
unsharded gradients into the sharded ones. None of those bytes are activations, so the
saved-tensor ledger never sees them; the device does. This module reads, per unit, what
its `FSDPParamGroup`s hold (torch 2.13): the unsharded parameters in their compute dtype
(`FSDPParam._orig_size`, `param_dtype`), the padded reduce-scatter input and the sharded
output in the reduce dtype; the arithmetic of when they are alive is
spikeguard/plan/fsdp_bytes.py's.

Detected by type (`FSDPModule`, the class `fully_shard` mixes in), never by name; a
grouped `fully_shard([norm, lm_head])` is one unit (one state shared by both modules).

    .venv/bin/python -m pytest tests/runtime/test_runtime_fsdp_bytes.py -q
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from spikeguard.runtime.device_state import fsdp_param_groups
from spikeguard.plan.fsdp_bytes import FsdpBytes, FsdpUnit


def fsdp_module_type():
    """torch's FSDPModule, or None where this torch has no FSDP2."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:   # torch built without distributed
        return None
    return FSDPModule


def fsdp_states(model: nn.Module) -> list[tuple[nn.Module, object]]:
    """(first module, FSDP state) of each FSDP2 unit under `model`, in module order (the
    order a decoder's forward runs them: embedding, blocks, norm and head), the root last."""
    kind = fsdp_module_type()
    if kind is None:
        return []
    seen: dict[int, tuple[nn.Module, object]] = {}
    for module in model.modules():
        if isinstance(module, kind):
            state = module._get_fsdp_state()
            seen.setdefault(id(state), (module, state))
    units = list(seen.values())
    root = [u for u in units if u[0] is model]
    return [u for u in units if u[0] is not model] + root


def _itemsize(dtype: Optional[torch.dtype], fallback: torch.dtype) -> int:
    return (dtype or fallback).itemsize


def unit_bytes(state, layer: Optional[int]) -> FsdpUnit:
    """One unit's sizes from its parameter groups: what its all-gather brings (unsharded
    parameters, compute dtype), what its reduce-scatter holds (padded unsharded input and
    the sharded output, reduce dtype), and whether it reshards after forward."""
    unsharded = rs_in = rs_out = 0
    reshard = True
    for group in fsdp_param_groups(state):
        reshard = reshard and bool(getattr(group, "_reshard_after_forward", True))
        # The mixed-precision dtypes: the group's policy (FSDPParam's own copies are set
        # only at FSDP2's lazy init, the first forward).
        policy = group.mp_policy
        for p in group.fsdp_params:
            orig = p.sharded_param.dtype
            unsharded += p._orig_size.numel() * _itemsize(policy.param_dtype, orig)
            world = p.mesh_info.shard_mesh_size if hasattr(p.mesh_info, "shard_mesh_size") else 1
            padded_shard = p.padded_sharded_param_size.numel()
            reduce = policy.reduce_dtype or policy.param_dtype
            rs_in += padded_shard * world * _itemsize(reduce, orig)
            rs_out += padded_shard * _itemsize(reduce, orig)
    return FsdpUnit(layer=layer, unsharded_bytes=unsharded, reduce_input_bytes=rs_in,
                    reduce_output_bytes=rs_out, reshard_after_forward=reshard)


def fsdp_units(model: nn.Module, layer_of: Callable[[nn.Module], Optional[int]]
               ) -> list[FsdpUnit]:
    """Every FSDP2 unit of `model`, in forward order, each tagged with the guarded layer
    it belongs to (`layer_of(module)`: None for the embedding, dense layers, head, root)."""
    return [unit_bytes(state, layer_of(module)) for module, state in fsdp_states(model)]


def gradient_sync(model: nn.Module) -> tuple:
    """Whether FSDP2 reduces (and all-reduces) the gradients in a backward now, per
    parameter group of every unit under `model` (what `set_requires_gradient_sync` and
    `set_requires_all_reduce` set; () without FSDP2). A backward that defers them makes
    none of the reduce-scatters and keeps the unsharded gradients inside FSDP2 instead."""
    return tuple((g.reduce_grads, g.all_reduce_grads) for _module, state in fsdp_states(model)
                 for g in fsdp_param_groups(state))


def set_gradient_sync(model: nn.Module, flags: tuple) -> None:
    """Put back what `gradient_sync(model)` read (every group, in its order)."""
    groups = [g for _module, state in fsdp_states(model) for g in fsdp_param_groups(state)]
    for group, (reduce, all_reduce) in zip(groups, flags):
        group.reduce_grads, group.all_reduce_grads = reduce, all_reduce


def reset_after_failed_attempt(model: nn.Module) -> None:
    """FSDP2 as between two iterations, after an attempt that a refusal ended mid-forward or
    mid-backward (torch 2.13): the one reset of the guard's free-attempt path
    (runtime/guard.py `free_attempt`), run after the attempt's graph and autograd's queued
    nodes are gone, before the re-run. Local only: every rank of the group re-runs, and
    the re-run makes the collectives. Its two steps, each needed:

    * the attempt's unsharded gradients are dropped (`unsharded_accumulated_grad`, the
      unsharded parameter's `.grad`): FSDP2's reset discards in-flight reductions but
      keeps these tensors; left, they stay on the device and the re-run's backward
      accumulates into them (the step's gradients are restored from the guard's snapshot;
      where FSDP2 deferred the reduction, as on a gradient-accumulation window's earlier
      micro-batches, the gradients the step opened with are among these: only a replay
      of those micro-batches makes them again, runtime/step.py);
    * the root's `reset_iter_state()` (public since torch 2.13): it waits on the in-flight
      all-gathers and reduce-scatters, reshards every parameter group and clears the
      iteration's trackers of every unit (training states, the queued post-backward
      callback flag, the forward root and order, the kept reduce-scatter states). The
      attempt died before FSDP2's root post-backward callback ran, so without it a module
      whose backward had begun kept its parameters unsharded (their storage the attempt's,
      freed with it: the re-run read "data is not allocated"), and a unit kept gathered
      after forward (a head) stayed on the device: the re-run ran out even under full
      recompute (32,896 bytes stayed on torchtitan's deepseek_v3 debug model; test:
      tests/integrations/test_integrations_titan_fsdp.py). The root is found through the
      state context every unit shares with it, so a root above `model` is reset too;
      before FSDP2's lazy initialisation (no forward ran) there is nothing to reset."""
    roots: dict[int, nn.Module] = {}
    for _module, state in fsdp_states(model):
        for group in fsdp_param_groups(state):
            for p in group.fsdp_params:
                p.unsharded_accumulated_grad = None
                unsharded = getattr(p, "_unsharded_param", None)
                if unsharded is not None:
                    unsharded.grad = None
        for other in state._state_ctx.all_states:
            if other._is_root:
                roots[id(other)] = other._modules[0]
    for root in roots.values():
        root.reset_iter_state()


def layer_finder(adapter, blocks) -> Callable[[nn.Module], Optional[int]]:
    """`fsdp_units`' `layer_of`: the guarded layer of a unit's first module, when that
    module is a guarded layer (the decoder block holding a MoE block), one of its
    modules, or inside it; None for a module that holds several (the root) or none."""
    parents = [(adapter.parent_layer(b), adapter.layer_index(b)) for b in blocks]

    def layer_of(module: nn.Module) -> Optional[int]:
        inside = [idx for parent, idx in parents if any(m is module for m in parent.modules())]
        if len(inside) == 1:
            return inside[0]
        holds = [idx for parent, idx in parents if any(m is parent for m in module.modules())]
        return holds[0] if len(holds) == 1 else None

    return layer_of


def model_fsdp_bytes(model: nn.Module, adapter, blocks) -> FsdpBytes:
    """The byte model's FSDP2 part for `model` (empty where it has no FSDP2 unit)."""
    return FsdpBytes(tuple(fsdp_units(model, layer_finder(adapter, blocks))))
