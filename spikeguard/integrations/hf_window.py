"""The decision window of a Hugging Face MoE block, and its experts call run as a region.

T = tokens in the micro-batch, K = top-k, E = experts, N = T*K routed copies.

The guard puts `run_window` in place of the experts module's forward, bound to the guard's
door (spikeguard.runtime.doors.WindowDoor: what the window may use). It is called as
the block calls its experts, `(hidden_states_TD, top_k_index_TK, top_k_weights_TK)`:
the per-expert counts are a bincount of the indices (host ints, one sync, as Megatron's
dropless dispatcher does), the guard's planner decides, and the call runs as one region:

  SAVE       plainly; what it saves is attributed to op "experts" and counted;
  RECOMPUTE  under `torch.utils.checkpoint` (non-reentrant) with a selective policy:
             every op recomputed in backward but the ALWAYS_SAVED_OPS (sort, nonzero,
             host syncs), whose cached outputs the ledger counts until the region's
             backward starts;
  OFFLOAD    under an inner pair of saved-tensor hooks that tags each saved tensor
             OFFLOAD and hands it to the guard's tracker (the same pack hook and
             offload engine as the built-in expert path).

Every action runs the same operations in the same order, so gradients are bitwise equal
to the plain model's.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint,
                                    create_selective_checkpoint_contexts)

from spikeguard.integrations.hf_ep import LocalWeights
from spikeguard.memory.ledger import storage_bytes, storage_key
from spikeguard.plan.catalogue import EXPERT_STAGES, Action, LayerPlan
from spikeguard.runtime.executor import ALWAYS_SAVED_OPS
from spikeguard.runtime.doors import WindowDoor
from spikeguard.runtime.hooks import unpack
from spikeguard.runtime.offload import expert_path_done

OP = "experts"
# Under transformers' EP the experts' grouped_mm clamps sort's output in place, which a
# cached tensor must not be (torch 2.13 refuses it): sort is recomputed there.
EP_SAVED_OPS = ALWAYS_SAVED_OPS - {torch.ops.aten.sort.default, torch.ops.aten.sort.stable}


@dataclass(frozen=True)
class RegionPlan:
    """What one experts call ran under: one action for the whole region (history counts
    one decision per layer)."""

    actions: tuple[Action, ...]


def region_action(plan: LayerPlan) -> Action:
    """The region's action for a plan of the region menu (see hf_bytes.REGION_MENU)."""
    if plan.recomputed():
        return Action.RECOMPUTE
    if Action.OFFLOAD in plan.actions:
        return Action.OFFLOAD
    return Action.SAVE


def split_call(arg_names, args: tuple, kwargs: dict):
    """(hidden_states, top_k_index, top_k_weights), the other positional arguments and
    the other keyword arguments of an experts call, however the block passed them."""
    routed = list(args[:3])
    rest = {k: v for k, v in kwargs.items() if k not in arg_names[len(routed):]}
    routed += [kwargs[name] for name in arg_names[len(routed):]]
    return routed, args[3:], rest


def run_window(door: WindowDoor, part, layer: int, orig_forward, *args, **kwargs):
    """The experts call of one block, under the guard's decision."""
    (hidden_states, top_k_index, top_k_weights), more, rest = split_call(part.arg_names,
                                                                          args, kwargs)

    def call(hidden_states, top_k_index, top_k_weights):
        return orig_forward(hidden_states, top_k_index, top_k_weights, *more, **rest)

    if not door.position.in_forward or not torch.is_grad_enabled():
        return call(hidden_states, top_k_index, top_k_weights)
    if part.ep is not None:
        # Under transformers' EP (integrations/hf_ep.py) the experts compute on the local
        # tensors ep_forward swapped in: weights for this call, and for its recompute.
        local = LocalWeights(part.experts)
        with door.tracker.weights_during(local.params.values()):
            return _window(door, part, layer, local, call, hidden_states, top_k_index,
                           top_k_weights)
    return _window(door, part, layer, None, call, hidden_states, top_k_index, top_k_weights)


def _window(door: WindowDoor, part, layer: int, local, call, hidden_states, top_k_index,
            top_k_weights):
    counts_E = torch.bincount(top_k_index.reshape(-1), minlength=part.num_experts)
    counts = counts_E[: part.num_experts].tolist()
    inputs = (hidden_states, top_k_index, top_k_weights)
    # The call may run hookless (runtime/hookless.py): in one process, and under
    # transformers' EP, where it is the experts' own forward on the received rows between
    # the two exchanges (its byte model, hf_bytes.derive_bytes(ep=True), is its own).
    under_ep = {} if local is None else {"recompute_call": _with_weights(local, call),
                                         "saved_ops": EP_SAVED_OPS}
    return run_region(door, layer, call, inputs, counts, top_k_index.numel(), hookless=True,
                      **under_ep)


def run_region(door: WindowDoor, layer: int, call, inputs: tuple, counts: list[int],
               num_routed: int, recompute_call=None, saved_ops=ALWAYS_SAVED_OPS,
               hookless: bool = False):
    """Decide on `num_routed` copies (`counts` per expert, for the record) and run
    `call(*inputs)` as one region under the plan; `inputs[0]` is what the experts read
    (its gradient is where their backward is done). Shared by every adapter whose experts
    run as one call (Hugging Face here, torchtitan in titan_blocks.py). A recomputed
    region runs `recompute_call` (default `call`: under transformers' EP, one that puts
    the forward's local weights back for backward) and keeps `saved_ops` cached. The
    guard is reached through `door` only. `hookless`: the call may run with no saved-tensor
    hook where nothing can later want what it saves off the device (runtime/hookless.py;
    set for transformers and torchtitan, in one process and under their EP, whose region
    byte model is the call's own)."""
    hidden_states = inputs[0]
    if door.in_full_region():
        door.record_plan(layer, counts, RegionPlan((Action.RECOMPUTE,)))
        return call(*inputs)
    if door.position.calm and door.calm.keeps(layer, num_routed):
        # kept whole, proven before the forward (runtime/calm_forward.py)
        return door.calm.run_layer(door.record_plan, layer, counts,
                                   RegionPlan((Action.SAVE,)), call, *inputs)
    decision = door.decide(layer, num_routed)
    action = region_action(decision.plan)
    door.record_plan(layer, counts, RegionPlan((action,)))
    door.ctx.op = OP

    def run():
        if action is Action.RECOMPUTE:
            return _recompute(door.ledger, door.ctx, recompute_call or call, inputs, saved_ops)
        if action is Action.OFFLOAD:
            return _offload(door.ctx, door.tracker, call, inputs)
        return _timed(door, call, inputs, num_routed)

    out = door.hookless.run_call(layer, hidden_states, num_routed, decision, run) \
        if hookless else run()
    expert_path_done(door.position, door.engine, layer, out, hidden_states)
    return out


def _timed(door: WindowDoor, call, inputs: tuple, num_routed: int):
    """The call, everything kept; on CPU its time corrects the cost model, as the
    built-in stages' do, spread evenly, as at calibration (recompute re-runs all)."""
    start = time.perf_counter()
    out = call(*inputs)
    if door.executor.timed:
        share = (time.perf_counter() - start) / len(EXPERT_STAGES)
        for stage in EXPERT_STAGES:
            door.cost.observe(stage, num_routed, share)
    return out


def _with_weights(local, call):
    def run(*inputs):
        with local.installed():
            return call(*inputs)
    return run


def _recompute(ledger, ctx, call, inputs, saved_ops=ALWAYS_SAVED_OPS):
    where, cached = ctx.where(OP), []

    def policy(sac_ctx, op, *args, **kwargs):
        if op in saved_ops:
            if not sac_ctx.is_recompute:
                for t in tensors_in(sac_ctx.op_output):
                    ledger.acquire(storage_key(t), storage_bytes(t), where)
                    cached.append(storage_key(t))
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    out = checkpoint(call, *inputs, use_reentrant=False,
                     context_fn=functools.partial(create_selective_checkpoint_contexts, policy))
    if cached:
        if out.requires_grad:
            # SAC's cache is freed by the region's backward, which starts when this grad arrives.
            out.register_hook(functools.partial(ledger.release_all, tuple(cached)))
        else:
            ledger.release_all(cached)
    return out


def _offload(ctx, tracker, call, inputs):
    tagged = {}

    def pack(t):
        key = storage_key(t)
        if key not in tracker.static_keys and key not in tagged:
            # One tag per storage: two views of it (gate and up halves) share a host copy.
            ctx.tag(t, OP, Action.OFFLOAD)
            tagged[key] = t
        return tracker.pack(t)

    try:
        # Innermost hooks win (torch 2.13): the tracker's own pair is shadowed here.
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            return call(*inputs)
    finally:
        for t in tagged.values():  # the intermediates die with the call; their addresses get reused
            ctx.untag(t)
        # Every saved tensor's hook object holds `pack`, so this dict would keep the call's
        # intermediates on the device until backward (and forever after a failed forward:
        # a cycle through autograd's C++ graph that the collector cannot see).
        tagged.clear()


def tensors_in(value) -> list:
    """The tensors of an op's output (a tensor, or tuples and lists of them)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in tensors_in(v)]
    return []
