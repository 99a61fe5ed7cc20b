"""Byte model of one Hugging Face experts call, run as a single region.

N = routed token copies, D = model width, F = expert hidden width, K = top-k,
b = bytes per element of the expert weights.

The experts call of a transformers v5 block is one function (its kernel is chosen by
`config._experts_implementation`), so spikeguard plans it as one region with three
actions, not per operator:

    action      what stays on the device for backward        per routed copy
    SAVE        everything the call saves                     save_per_token
    RECOMPUTE   the call's inputs and the outputs of the ops  recompute_per_token
                never recomputed (sort, nonzero, host syncs)
    OFFLOAD     nothing: every tensor the call saves goes to  0 (save_per_token to host)
                the host pool and comes back in backward

Two ways to know the numbers:
  * derived, for transformers' own `grouped_mm` kernel over the standard layout (3-D
    `gate_up_proj` (E, 2F, D) and `down_proj` (E, D, F), gated, no bias): the call keeps
    the gathered input N*D*b, gate/up N*2F*b, act(gate) N*F*b, the product N*F*b, the
    down output N*D*b, the sorted weights N*4 and three int64 index vectors N*24;
    under recompute, sort's two int64 outputs (16 B) and the inputs (D*b/K + 8 + 4);
  * measured (the probe), for any other kernel or layout: the call runs on two token
    counts under a saved-tensor hook that sums the distinct storages it saves, and a
    line through the two points gives bytes per routed copy (the intercept, a few
    per-expert offsets, is logged and left out of the slope).

The planner's catalogue has the five operators of the built-in expert path; the
region's numbers are laid onto them so the same Planner ranks the three plans:
`dispatch` = what recompute keeps, `gate_up` = what recompute drops, the rest 0; the
menu is {ALL_SAVE, EXPERTS_RECOMPUTE, ALL_OFFLOAD}.
"""

from __future__ import annotations

import functools
import statistics
import time
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint,
                                    create_selective_checkpoint_contexts)

from spikeguard.integrations.hf_window import tensors_in
from spikeguard.memory.ledger import local_tensor
from spikeguard.plan.catalogue import (ALL_OFFLOAD, ALL_SAVE, EXPERTS_RECOMPUTE, EXPERT_STAGES,
                                       OPS)
from spikeguard.plan.planner import Planner
from spikeguard.runtime.executor import ALWAYS_SAVED_OPS

REGION_MENU = (ALL_SAVE, EXPERTS_RECOMPUTE, ALL_OFFLOAD)
PROBE_TOKENS = (64, 192)   # tokens per probe run (routed copies: times K)
WEIGHT_BYTES = 4           # v5 routers return float32 top-k weights


@dataclass(frozen=True)
class RegionBytes:
    """Bytes per routed copy that one experts call keeps, per region action."""

    d_model: int
    d_expert: int
    save_per_token: int
    recompute_per_token: int
    elem_bytes: int = 4
    source: str = "derived"        # or "measured"
    intercept_bytes: int = 0       # the probe's fitted constant (not planned on)
    probe_counts: tuple = ()
    combine_after_exchange: bool = False

    def bytes_per_token(self) -> dict[str, int]:
        """The whole experts call is one region (docs/hf.md): what a recompute keeps (its
        input) is dispatch's, the rest of what saving keeps gate_up's; every other
        operator of the catalogue keeps nothing of its own."""
        per = dict.fromkeys((*OPS, "combine"), 0)
        per["dispatch"] = self.recompute_per_token
        per["gate_up"] = max(0, self.save_per_token - self.recompute_per_token)
        return per

    def predict(self, num_routed: int) -> dict[str, int]:
        return {op: num_routed * per for op, per in self.bytes_per_token().items()}

    def calibrate(self, cost, experts: nn.Module, num_experts: int, top_k: int,
                  device, num_routed: int = 512, reps: int = 3, call=None) -> None:
        """Time the real experts call (no grad) and the host copies on this device; the
        call's seconds are spread over the four stages (recompute re-runs all of them).
        `call`: what computes the experts (default the module)."""
        param = local_tensor(next(experts.parameters()))
        experts = call or experts
        tokens = max(1, num_routed // top_k)
        gen = torch.Generator().manual_seed(0)
        args = random_inputs(tokens, self.d_model, top_k, num_experts, param.device,
                             param.dtype, gen)
        samples = []
        with torch.no_grad():
            for _ in range(reps):
                start = _now(param.device)
                experts(*args)
                samples.append(_now(param.device) - start)
            cost.calibrate_copies(param.device, param.dtype)
        per_stage = statistics.median(samples) / (tokens * top_k) / len(EXPERT_STAGES)
        for stage in EXPERT_STAGES:
            cost.stage_s_per_token[stage] = per_stage
        cost.copies_overlap = param.device.type == "cuda"


class RegionPlanner(Planner):
    """The planner over the three region plans (same ranking and fitting code)."""

    def __init__(self, shape: RegionBytes, cost):
        super().__init__(shape, cost)
        self.menu = list(REGION_MENU)
        self.min_bytes_per_token = min(self.device_bytes_per_token(p) for p in self.menu)
        self.refresh()


def derive_bytes(experts: nn.Module, top_k: int, ep: bool = False):
    """The byte model from known attributes, or None when they do not pin it down.

    `ep`: called by transformers' EP implementation (hf_ep.py) on the received rows, one
    routed copy per row with constant unit weights: the down output is not saved (its
    product with a weight that needs no gradient saves nothing), two int64 index vectors
    and the sentinel mask (1 B) are, and sort is recomputed (measured on 5.24: exact)."""
    cfg = getattr(experts, "config", None)
    if getattr(cfg, "_experts_implementation", None) != "grouped_mm":
        return None
    if not (getattr(experts, "has_gate", False) and getattr(experts, "is_concatenated", False)) \
            or getattr(experts, "has_bias", True) or getattr(experts, "is_transposed", True) \
            or getattr(experts, "has_post_expert_norm", True):
        return None
    if getattr(getattr(experts, "_apply_gate", None), "__name__", "") != "_default_apply_gate":
        return None
    gate_up = getattr(experts, "gate_up_proj", None)
    down = getattr(experts, "down_proj", None)
    if not (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor)
            and gate_up.dim() == 3 and down.dim() == 3):
        return None
    E, F2, D = gate_up.shape
    if tuple(down.shape) != (E, D, F2 // 2):
        return None
    F, b = F2 // 2, gate_up.element_size()
    if ep:
        return RegionBytes(d_model=D, d_expert=F, elem_bytes=b,
                           save_per_token=D * b + 4 * F * b + WEIGHT_BYTES + 2 * 8 + 1,
                           recompute_per_token=_input_bytes(D, b, 1))
    save = 2 * D * b + 4 * F * b + WEIGHT_BYTES + 3 * 8
    return RegionBytes(d_model=D, d_expert=F, elem_bytes=b, save_per_token=save,
                       recompute_per_token=16 + _input_bytes(D, b, top_k))


def _input_bytes(d_model: int, elem_bytes: int, top_k: int) -> int:
    """The call's inputs per routed copy (hidden row shared by K copies, index, weight)."""
    return -(-d_model * elem_bytes // top_k) + 8 + WEIGHT_BYTES


def random_inputs(tokens: int, d_model: int, top_k: int, num_experts: int, device, dtype,
                  gen: torch.Generator):
    """(hidden_states_TD, top_k_index_TK, top_k_weights_TK) as a router would give them."""
    hidden = torch.randn(tokens, d_model, generator=gen).to(device, dtype).requires_grad_()
    scores = torch.rand(tokens, num_experts, generator=gen)
    weights, index = scores.topk(top_k, dim=-1)
    weights = (weights / weights.sum(-1, keepdim=True)).to(device).requires_grad_()
    return hidden, index.to(device), weights


def probe_bytes(experts: nn.Module, num_experts: int, top_k: int, device,
                d_model: int, call=None) -> RegionBytes:
    """Learn the byte model by running the call on two token counts (linear fit)."""
    param = local_tensor(next(experts.parameters()))
    static = {local_tensor(p).untyped_storage().data_ptr() for p in experts.parameters()}
    experts = call or experts
    gen = torch.Generator().manual_seed(0)
    saved, cached, routed = [], [], []
    for tokens in PROBE_TOKENS:
        args = random_inputs(tokens, d_model, top_k, num_experts, param.device,
                             param.dtype, gen)
        saved.append(_saved_bytes(lambda: experts(*args), static, args))
        cached.append(_cached_bytes(experts, args))
        routed.append(tokens * top_k)
    slope = (saved[1] - saved[0]) / (routed[1] - routed[0])
    cached_slope = (cached[1] - cached[0]) / (routed[1] - routed[0])
    b = param.element_size()
    return RegionBytes(d_model=d_model, d_expert=0, elem_bytes=b,
                       save_per_token=int(round(slope)),
                       recompute_per_token=int(round(cached_slope)) + _input_bytes(d_model, b, top_k),
                       source="measured", intercept_bytes=int(round(saved[0] - slope * routed[0])),
                       probe_counts=tuple(routed))


def _saved_bytes(fn, static: set, inputs) -> int:
    """Distinct storages autograd saves while `fn` runs, parameters and inputs left out
    (the router has saved the inputs already: the ledger counts a storage once)."""
    skip = static | {t.untyped_storage().data_ptr() for t in inputs}
    seen: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in skip:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    del out
    return sum(seen.values())


def _cached_bytes(experts: nn.Module, inputs) -> int:
    """Bytes selective checkpointing caches for the ops it never recomputes."""
    seen: dict[int, int] = {}

    def policy(ctx, op, *args, **kwargs):
        if op in ALWAYS_SAVED_OPS:
            for t in tensors_in(ctx.op_output):
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    out = checkpoint(experts, *inputs, use_reentrant=False,
                     context_fn=functools.partial(create_selective_checkpoint_contexts, policy))
    del out
    return sum(seen.values())


def _now(device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
