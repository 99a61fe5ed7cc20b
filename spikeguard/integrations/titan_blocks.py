"""torchtitan MoE layers (`torchtitan/models/common/moe.py`, 0.3.0), found by structure.

T = tokens, D = model width, E = experts (e = local experts under EP), K = top-k,
F = expert hidden width, R = routed rows this rank's experts receive (T*K without EP).

torchtitan's `MoE.forward` is route -> `RoutedExperts.forward`: dispatch (the token
dispatcher; under expert parallelism its all-to-all, whose split sums are brought to the
host first) -> `inner_experts(routed_input_RD, num_tokens_per_local_expert_e)` -> combine.
That experts call is the decision window: R is the routed input's leading size, a host
int already (no extra sync), and no expert has run. The call runs as one region with
three plans (keep / recompute / offload: spikeguard.integrations.hf_window.run_region,
shared with the Hugging Face adapter). The dispatch and combine all-to-alls are outside
the region, so no plan of it re-issues a collective; a whole layer recomputed (policy
"full", adaptive's layer fallback, the safety net) keeps every collective's output
(runtime.executor.ALWAYS_SAVED_OPS: torchtitan's functional all_to_all_single and
wait_tensor), so a rank that alone falls back re-runs no collective and hangs no one.

A block is recognised when it has a `router` child with an int `top_k`, and a
`routed_experts` child holding `inner_experts` (3-D `w1_EFD`, `w2_EDF`, `w3_EFD`) and a
`token_dispatcher` (dispatch / combine). `shared_experts` are its shared modules.
This module never imports torchtitan.

Byte model of `GroupedExperts.forward` (torch._grouped_mm on bf16 copies; on CPU in torch
2.13 the same op, a loop over the groups), per routed row: the two bf16 copies of the
input 2*D*2, the two grouped_mm outputs, silu's output and the product 4*F*2; per layer,
whatever the count: the bf16 copies of w1, w3, w2 (3*e*F*D*2) and the int32 offsets
(4*e). Under recompute the region keeps its input row (D*b). Measured against the
saved-tensor hook in tests/integrations/test_integrations_titan.py.
"""

from __future__ import annotations

import functools
import inspect
import statistics
import time
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from spikeguard.errors import UsageError
from spikeguard.integrations.hf_bytes import REGION_MENU, RegionBytes, RegionPlanner
from spikeguard.integrations.hf_window import region_action, run_region
from spikeguard.integrations.titan_models import SPMD_BACKEND
from spikeguard.memory.ledger import local_tensor
from spikeguard.parallel.agreement import agreement_for
from spikeguard.parallel.release import released
from spikeguard.plan.catalogue import EXPERT_STAGES, Action, LayerPlan
from spikeguard.runtime.adapter import BlockAdapter, preserved_rng
from spikeguard.runtime.doors import WindowDoor

LOOKED_FOR = ("a torchtitan MoE (a `router` with top_k beside `routed_experts` holding "
              "`inner_experts` with 3-D w1_EFD / w2_EDF / w3_EFD and a `token_dispatcher`)")
GROUPED_MM_BYTES = 2          # GroupedExperts computes on bf16 copies, whatever the weights
OFFSET_BYTES = 4              # its int32 offsets, one per local expert
AC_OFF = ("torchtitan's activation checkpointing wraps the transformer blocks "
          "({name}): set activation_checkpoint = None in the trainer config (command "
          "line: activation_checkpoint:none) before attaching spikeguard; "
          "the guard decides recompute itself, and the two must not be stacked")
COMPILE_OFF = ("torchtitan compiled the transformer blocks holding MoE layers (compile "
               "with fullgraph; its components include 'model'): the decision window is "
               "Python that runs between the router and the experts, which a full graph "
               "leaves no room for; set compile.enable = false (or leave 'model' out of "
               "compile.components) before attaching spikeguard")
EP_BACKEND_OFF = ("torchtitan's expert parallelism runs under parallelism.spmd_backend "
                  "{backend!r}, {why}: set parallelism.spmd_backend = \"partial_dtensor\" "
                  "before attaching spikeguard")
EP_BACKEND_WHY = {
    "spmd_types": "whose token all-to-all (c10d's in-place one, inside an autograd "
                  "Function) a recompute would re-issue",
}


@dataclass(frozen=True)
class TitanBlock:
    """One recognised torchtitan MoE and its parts."""

    block: nn.Module
    router: nn.Module
    experts: nn.Module          # RoutedExperts.inner_experts (GroupedExperts)
    dispatcher: object          # LocalTokenDispatcher / AllToAllTokenDispatcher
    shared: tuple

    @property
    def num_local_experts(self) -> int:
        return local_tensor(self.experts.w1_EFD).shape[0]


def as_titan_block(module: nn.Module) -> Optional[TitanBlock]:
    router = getattr(module, "router", None)
    routed = getattr(module, "routed_experts", None)
    if not (isinstance(router, nn.Module) and isinstance(routed, nn.Module)
            and isinstance(getattr(router, "top_k", None), int)):
        return None
    experts = getattr(routed, "inner_experts", None)
    dispatcher = getattr(routed, "token_dispatcher", None)
    if not (isinstance(experts, nn.Module)   # the dispatcher is a plain object in 0.3.0
            and callable(getattr(dispatcher, "dispatch", None))
            and callable(getattr(dispatcher, "combine", None))):
        return None
    weights = [getattr(experts, n, None) for n in ("w1_EFD", "w2_EDF", "w3_EFD")]
    if not all(isinstance(w, torch.Tensor) and w.dim() == 3 for w in weights):
        return None
    shared = getattr(module, "shared_experts", None)
    return TitanBlock(module, router, experts, dispatcher,
                      (shared,) if isinstance(shared, nn.Module) else ())


@dataclass(frozen=True)
class TitanRegionBytes(RegionBytes):
    """RegionBytes plus what one experts call keeps whatever the count (`layer_bytes`):
    the bf16 weight copies and offsets; kept under SAVE, to host under OFFLOAD, recomputed
    under RECOMPUTE."""

    layer_bytes: int = 0
    num_local_experts: int = 0

    def calibrate(self, cost, experts: nn.Module, num_experts: int, top_k: int, device,
                  num_routed: int = 512, reps: int = 3) -> None:
        """Time the real call (no grad) on `num_routed` rows spread over the local experts;
        its seconds are spread over the four stages (recompute re-runs all of them)."""
        weight = local_tensor(experts.w1_EFD)
        rows = max(num_experts, num_routed - num_routed % num_experts)
        gen = torch.Generator().manual_seed(0)
        x_RD = torch.randn(rows, self.d_model, generator=gen).to(weight.device, weight.dtype)
        counts_e = torch.full((num_experts,), rows // num_experts, dtype=torch.int64,
                              device=weight.device)
        samples = []
        with torch.no_grad():
            for _ in range(reps):
                start = time.perf_counter()
                experts(x_RD, counts_e)
                samples.append(time.perf_counter() - start)
            cost.calibrate_copies(weight.device, weight.dtype)
        per_stage = statistics.median(samples) / rows / len(EXPERT_STAGES)
        for stage in EXPERT_STAGES:
            cost.stage_s_per_token[stage] = per_stage
        cost.copies_overlap = weight.device.type == "cuda"


class TitanRegionPlanner(RegionPlanner):
    """The region planner, with the per-layer constant counted in every plan's bytes."""

    def layer_bytes(self, plan: LayerPlan) -> tuple[int, int]:
        action = region_action(plan)
        constant = self.shape.layer_bytes
        if action is Action.SAVE:
            return constant, 0
        if action is Action.OFFLOAD:
            return 0, constant
        return 0, 0


def derive_titan_bytes(part: TitanBlock, top_k: int, grouped: bool) -> TitanRegionBytes:
    """The byte model of `GroupedExperts.forward` (see the module docstring)."""
    w1 = local_tensor(part.experts.w1_EFD)
    e, F, D = w1.shape
    b = w1.element_size()
    per_row = 2 * D * GROUPED_MM_BYTES + 4 * F * GROUPED_MM_BYTES
    return TitanRegionBytes(d_model=D, d_expert=F, elem_bytes=b, save_per_token=per_row,
                            recompute_per_token=D * b, combine_after_exchange=grouped,
                            layer_bytes=3 * e * F * D * GROUPED_MM_BYTES + e * OFFSET_BYTES,
                            num_local_experts=e)


def titan_window(door: WindowDoor, layer: int, orig_forward, x_RD,
                 num_tokens_per_expert_e, *more, **kwargs):
    """In place of `inner_experts.forward`: decide on the R rows received, run the call
    as one region under the plan (the guard reached through `door` only). As for
    transformers (runtime/hookless.py), in one process and under EP alike, the call runs
    with no saved-tensor hook where nothing of the step can later want what it saves off
    the device; what it keeps is then the region byte model's (module doc); under EP
    what the exchanges keep outside the call is measured on the first layer as router
    and combine."""
    def call(x_RD, num_tokens_per_expert_e):
        return orig_forward(x_RD, num_tokens_per_expert_e, *more, **kwargs)

    if not door.position.in_forward or not torch.is_grad_enabled():
        return call(x_RD, num_tokens_per_expert_e)
    num_routed = x_RD.shape[0]
    # Per-expert counts for the record only: read where that costs no device sync.
    counts = (num_tokens_per_expert_e.tolist() if num_tokens_per_expert_e.device.type == "cpu"
              else [num_routed])
    return run_region(door, layer, call, (x_RD, num_tokens_per_expert_e), counts, num_routed,
                      hookless=True)


# torchtitan 0.3.0's token dispatcher methods that issue the rows' all-to-alls under its
# EP (dispatch, combine): on CPU each returns once gloo let go of the rows it was handed
# (spikeguard.parallel.release `released`), not freed on gloo's thread mid-step.
RELEASED_EXCHANGES = ("_dispatch_token_exchange", "_combine_token_exchange")


def refuse_wrappers(model: nn.Module, blocks: list[TitanBlock]) -> None:
    """torchtitan's own activation checkpointing, a compiled block, and an EP backend
    other than partial_dtensor are refused."""
    # torch 2.13 keeps its checkpoint wrapper in a private module (torchtitan imports it
    # from there too). By type, not name: FSDP2's fully_shard makes the wrapper's class
    # a subclass named FSDPCheckpointWrapper (and the base covers OffloadWrapper).
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import ActivationWrapper
    for module in model.modules():
        if isinstance(module, ActivationWrapper):
            raise UsageError(AC_OFF.format(name=type(module).__name__))
    if blocks and getattr(blocks[0].dispatcher, "ep_mesh", None) is not None:
        from torchtitan.distributed.utils import get_spmd_backend
        backend = get_spmd_backend()
        if backend != SPMD_BACKEND:
            raise UsageError(EP_BACKEND_OFF.format(backend=backend, why=EP_BACKEND_WHY.get(
                backend, "which spikeguard has not been run under")))
    for part in blocks:
        for module in model.modules():
            if getattr(module, "_compiled_call_impl", None) is not None and \
                    any(m is part.block for m in module.modules()):
                raise UsageError(COMPILE_OFF)


class TitanAdapter(BlockAdapter):
    """Runs each torchtitan experts call as one region under the plan."""

    looked_for = LOOKED_FOR

    @staticmethod
    def find(model: nn.Module) -> Optional["TitanAdapter"]:
        found = [b for b in map(as_titan_block, model.modules()) if b is not None]
        return TitanAdapter(model, found) if found else None

    def __init__(self, model: nn.Module, found: list[TitanBlock]):
        refuse_wrappers(model, found)
        super().__init__(model, [f.block for f in found])
        self.parts = {id(f.block): f for f in found}
        # torchtitan's `Module.parallelize` puts its own forward on the instance (the
        # local_map region under EP): the window goes around it and gives it back.
        self._own_forward: dict[int, object] = {}

    def part(self, block: nn.Module) -> TitanBlock:
        return self.parts[id(block)]

    def shared_modules(self, block: nn.Module) -> list[nn.Module]:
        return list(self.part(block).shared)

    def top_k(self) -> int:
        return self.part(self.blocks[0]).router.top_k

    def group(self):
        """The expert-parallel group torchtitan wired into the dispatchers (None at EP=1)."""
        mesh = getattr(self.part(self.blocks[0]).dispatcher, "ep_mesh", None)
        return mesh.get_group() if mesh is not None else None

    def agreement(self):
        return agreement_for(self.group())

    # ---- the window ---------------------------------------------------------------------
    def install(self, block: nn.Module, door) -> None:
        experts = self.part(block).experts
        orig = experts.forward
        self._own_forward[id(block)] = vars(experts).get("forward")
        window = functools.partial(titan_window, door, self.layer_index(block), orig)
        window.__signature__ = inspect.signature(orig)
        experts.forward = window
        dispatcher = self.part(block).dispatcher
        if getattr(dispatcher, "ep_mesh", None) is not None:
            for name in RELEASED_EXCHANGES:
                exchange = getattr(dispatcher, name, None)
                if callable(exchange):
                    setattr(dispatcher, name, functools.partial(released, exchange))

    def uninstall(self, block: nn.Module) -> None:
        experts = self.part(block).experts
        own = self._own_forward.pop(id(block), None)
        if own is not None:
            experts.forward = own
        elif "forward" in vars(experts):
            del experts.forward
        for name in RELEASED_EXCHANGES:   # the dispatcher's own methods again
            vars(self.part(block).dispatcher).pop(name, None)

    # ---- what the planner needs ---------------------------------------------------------
    def byte_model(self, device) -> TitanRegionBytes:
        first = self.part(self.blocks[0])
        kind = type(first.experts)
        if kind.__name__ != "GroupedExperts" or "forward" not in vars(kind):
            raise UsageError(f"the experts of this torchtitan model are {kind.__name__}, "
                             f"whose bytes spikeguard cannot derive (it knows torchtitan's "
                             f"GroupedExperts); remove the converter that replaced them")
        return derive_titan_bytes(first, self.top_k(), self.group() is not None)

    def calibrate(self, cost, shape: TitanRegionBytes, device) -> None:
        first = self.part(self.blocks[0])
        with preserved_rng(device):
            shape.calibrate(cost, first.experts, first.num_local_experts, self.top_k(), device)

    def planner(self, shape: TitanRegionBytes, cost) -> TitanRegionPlanner:
        return TitanRegionPlanner(shape, cost)


__all__ = ["TitanAdapter", "REGION_MENU", "as_titan_block"]
