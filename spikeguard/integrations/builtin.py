"""The adapter for spikeguard's own `MoEBlock` (spikeguard.model.moe).

Its expert path is known op by op (`SwiGLUExperts`: gate_up, silu, act, down), so the
guard plans per operator over the full menu of the catalogue and the executor runs the
stages under selective checkpointing and saved-tensor hooks. The window (`run_window`) is the block's
`expert_runner` seam, called with the dispatched tokens and host-int per-expert counts;
it ends in the tail every expert-path window shares (runtime/offload.py expert_path_done),
and reaches the guard through its door (spikeguard.runtime.doors.WindowDoor).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import nn

from spikeguard.model.moe import MoEBlock
from spikeguard.plan.catalogue import ALL_SAVE, OPS, Action, ExpertShape, LayerPlan
from spikeguard.plan.planner import Planner
from spikeguard.runtime.adapter import BlockAdapter, preserved_rng
from spikeguard.runtime.doors import WindowDoor
from spikeguard.runtime.offload import expert_path_done
from spikeguard.parallel.agreement import agreement_for

# Under "full" the whole layer is recomputed; recorded as every operator recomputed.
FULL_RECOMPUTE = LayerPlan(tuple(Action.RECOMPUTE for _ in OPS))


def run_window(door: WindowDoor, block: MoEBlock, dispatched) -> torch.Tensor:
    """The built-in block's decision window: plan from the routed counts, then the
    executor (or a hookless layer) runs the expert path under the plan."""
    counts = dispatched.tokens_per_expert
    if not door.position.in_forward:  # evaluation under no_grad: nothing kept, nothing to plan
        return block.experts(dispatched.x_ND, counts)
    if door.in_full_region():
        door.record_plan(block.layer_idx, counts, FULL_RECOMPUTE)
        return block.experts(dispatched.x_ND, counts)
    if door.position.calm and door.calm.keeps(block.layer_idx, dispatched.x_ND.shape[0]):
        # kept whole, proven before the forward (runtime/calm_forward.py)
        return door.calm.run_layer(door.record_plan, block.layer_idx, counts, ALL_SAVE,
                                   block.experts, dispatched.x_ND, counts)
    decision = door.decide(block.layer_idx, dispatched.x_ND.shape[0])
    door.record_plan(block.layer_idx, counts, decision.plan)
    if not door.hookless.tracker.is_paused:   # paused: covered whole, combine runs paused
        door.executor.tag(dispatched.weight_N, "combine", Action.SAVE)
        door.executor.tag(dispatched.token_idx_N, "combine", Action.SAVE)
    y_ND = door.hookless.run(door.executor, block, dispatched, decision)
    expert_path_done(door.position, door.engine, block.layer_idx, y_ND, dispatched.x_ND)
    return y_ND


def make_room_for_dispatch(door: WindowDoor, exchange_bytes: int) -> None:
    """The EP dispatcher's `make_room`: in a guarded forward (not backward's recompute,
    which replays the cached exchange; not evaluation), the window evicts what the
    exchange's rows need."""
    if door.position.in_forward:
        door.make_room_for_dispatch(exchange_bytes)


class BuiltinAdapter(BlockAdapter):
    looked_for = "spikeguard MoEBlock"
    # spikeguard/parallel/expert_parallel.py: the sent rows and the received ones go once
    # the received are regrouped, before `run_window`
    exchange_freed_before_window = True

    @staticmethod
    def find(model: nn.Module) -> Optional["BuiltinAdapter"]:
        blocks = [m for m in model.modules() if isinstance(m, MoEBlock)]
        return BuiltinAdapter(model, blocks) if blocks else None

    def layer_index(self, block: MoEBlock) -> int:
        return block.layer_idx

    def shared_modules(self, block: MoEBlock) -> list[nn.Module]:
        return [block.shared] if getattr(block, "shared", None) is not None else []

    def group(self):
        return next((b.dispatcher.group for b in self.blocks
                     if getattr(b.dispatcher, "group", None) is not None), None)

    def agreement(self):
        return agreement_for(self.group(), self.blocks)

    def top_k(self) -> int:
        return self.blocks[0].router.top_k

    def install(self, block: MoEBlock, door: WindowDoor) -> None:
        block.expert_runner = functools.partial(run_window, door)
        if hasattr(block.dispatcher, "make_room"):   # expert parallelism's dispatcher
            block.dispatcher.make_room = functools.partial(make_room_for_dispatch, door)

    def uninstall(self, block: MoEBlock) -> None:
        block.expert_runner = None
        if hasattr(block.dispatcher, "make_room"):
            block.dispatcher.make_room = None

    def byte_model(self, device) -> ExpertShape:
        experts = self.blocks[0].experts
        return ExpertShape(d_model=experts.w13_ED2F.shape[1], d_expert=experts.d_expert,
                           elem_bytes=experts.w13_ED2F.element_size(),
                           combine_after_exchange=self.group() is not None)

    def calibrate(self, cost, shape: ExpertShape, device) -> None:
        experts = self.blocks[0].experts
        with preserved_rng(device):
            cost.calibrate(shape, experts.num_experts, device, experts.w13_ED2F.dtype)

    def planner(self, shape: ExpertShape, cost) -> Planner:
        return Planner(shape, cost)
