"""Runs one MoE layer's expert path under a plan, with PyTorch's own mechanisms.

RECOMPUTE: the smallest region of stages holding the recomputed tensors and their
consumers runs under `torch.utils.checkpoint.checkpoint(use_reentrant=False)` with a
selective-checkpoint policy built from the plan. OFFLOAD and SAVE: the executor tags the
storage of each stage's output with its op and action, and the saved-tensor hooks around
the forward (spikeguard.runtime.hooks) act on the tag when autograd saves it.

N = routed token copies on this process, D = model width, F = expert hidden width.
The stages compute exactly what `SwiGLUExperts.forward` computes, op for op, so any plan
gives bitwise the same values and gradients.
"""

from __future__ import annotations

import functools
import time
from typing import Callable, Optional

import torch
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint,
                                    create_selective_checkpoint_contexts)

from spikeguard.memory.ledger import Ledger, storage_bytes, storage_key
from spikeguard.model.experts import SwiGLUExperts, stage_functions
from spikeguard.plan.catalogue import EXPERT_STAGES, STAGE_INPUTS, Action, LayerPlan
from spikeguard.runtime.hooks import Context


def _always_saved_ops() -> frozenset:
    """Ops never recomputed inside any region: the router's choice, host syncs and
    collectives (recomputing them would change routing, re-sync or re-communicate)."""
    aten = torch.ops.aten
    ops = {aten.topk.default, aten.sort.default, aten.sort.stable, aten.bincount.default,
           aten._local_scalar_dense.default, aten.nonzero.default}
    for name in ("all_to_all_single", "all_gather_into_tensor", "reduce_scatter_tensor",
                 "all_reduce", "wait_tensor"):
        op = getattr(torch.ops._c10d_functional, name, None)
        if op is not None:
            ops.add(op.default)
    return frozenset(ops)


ALWAYS_SAVED_OPS = _always_saved_ops()


def base_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Whole-layer recompute (the "full" baseline): recompute all but ALWAYS_SAVED_OPS."""
    if op in ALWAYS_SAVED_OPS:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


class ExpertPathExecutor:
    """Applies a LayerPlan; times the stages it runs plainly (CPU) for the cost model."""

    def __init__(self, ledger: Ledger, ctx: Context,
                 on_stage_time: Optional[Callable[[str, int, float], None]] = None):
        self.ledger = ledger
        self.ctx = ctx
        self.on_stage_time = on_stage_time
        self.timed = ledger.device.type == "cpu"

    def tag(self, t: torch.Tensor, op: str, action: Action) -> None:
        self.ctx.tag(t, op, action)

    def run(self, experts: SwiGLUExperts, x_ND: torch.Tensor, tokens_per_expert: list[int],
            plan: LayerPlan, hooked: bool = True, output_hooked: bool = True) -> torch.Tensor:
        """The expert path under `plan`. `hooked` False: the tracker is paused through the
        stages (runtime/hookless.py), so no pack hook reads their tags and none is set;
        `output_hooked` False: combine runs paused too, and the output is not tagged
        either (the tags cost ~8 us each in a calm step of `small`, CPU)."""
        fns = stage_functions(experts, tokens_per_expert)
        tensors = {"dispatch": x_ND}
        if hooked:
            self.tag(x_ND, "dispatch", plan.action("dispatch"))
        region = plan.region()
        num_routed = x_ND.shape[0]
        for stage in EXPERT_STAGES:
            if stage in region and stage != region[0]:
                continue
            self.ctx.op = stage
            start = time.perf_counter()
            if stage in region:
                out = self._run_region(region, fns, tensors, plan)
                stage = region[-1]
            else:
                out = fns[stage](tensors)
                if self.timed and self.on_stage_time is not None:
                    self.on_stage_time(stage, num_routed, time.perf_counter() - start)
            tensors[stage] = out
            if hooked or (output_hooked and stage == EXPERT_STAGES[-1]):
                self.tag(out, stage, plan.action(stage))
        # The intermediates die with this frame; their addresses may be reused by tensors
        # that must not inherit their tags. x and y live on through combine.
        if hooked:
            for stage in EXPERT_STAGES[:-1]:
                if stage in tensors:
                    self.ctx.untag(tensors[stage])
        return tensors["down"]

    def _run_region(self, region, fns, tensors, plan: LayerPlan) -> torch.Tensor:
        names = list(dict.fromkeys(n for s in region for n in STAGE_INPUTS[s] if n not in region))
        current = {"stage": region[0]}
        cached: list = []
        where = self.ctx.where("silu")

        def region_fn(*inputs):
            local = dict(zip(names, inputs))
            for stage in region:
                current["stage"] = stage
                local[stage] = fns[stage](local)
            return local[region[-1]]

        def policy(sac_ctx, op, *args, **kwargs):
            assert torch.Tag.nondeterministic_seeded not in getattr(op, "tags", ()), \
                f"{op} draws random numbers: the region does not keep the RNG state"
            if op in ALWAYS_SAVED_OPS:
                return CheckpointPolicy.MUST_SAVE
            if (current["stage"] == "silu" and op is torch.ops.aten.silu.default
                    and plan.action("silu") is Action.SAVE):
                out = sac_ctx.op_output
                self.ledger.acquire(storage_key(out), storage_bytes(out), where)
                cached.append(storage_key(out))
                return CheckpointPolicy.MUST_SAVE
            return CheckpointPolicy.PREFER_RECOMPUTE

        # No stage draws random numbers (the policy asserts it), so the RNG state is not
        # kept: checkpoint's default stashes torch.get_rng_state() (torch 2.13: 5,056 bytes,
        # host memory under CUDA) until the region's backward. On the emulated device it
        # counted as device bytes, per recomputed layer and micro-batch, which no byte
        # model has: the oracle's plans ran out by 4 bytes at `tiny` with narrow experts,
        # EP=2, 0.6x (tests/bench/test_bench_oracle_ep.py; issue 24).
        out = checkpoint(region_fn, *(tensors[n] for n in names), use_reentrant=False,
                         preserve_rng_state=False,
                         context_fn=functools.partial(create_selective_checkpoint_contexts, policy))
        if cached and out.requires_grad:
            # SAC's cache is freed by the region's backward, which starts when this grad arrives.
            out.register_hook(functools.partial(self.ledger.release_all, tuple(cached)))
        return out

