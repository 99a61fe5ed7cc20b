"""The narrow doors into a guard (spikeguard.runtime.guard): what its collaborators may use.

    NetDoor      the safety net of a micro-batch's forward (runtime/net.py)
    WindowDoor   the decision window of an expert path: the built-in block's
                 (integrations/builtin.py), transformers' and torchtitan's experts call
                 (integrations/hf_window.py run_region, titan_blocks.py)

A door names the parts a collaborator reads (the meter, ledger, tracker, position, cost
model, offload engine ...) and the few things it may ask of the guard, as callables the
guard binds; it is no way to the rest of the guard, and nothing can be set through it
(frozen, slotted). The guard builds both at attach (`net_door`, `window_door`); a test
that replaces one of the guard's methods on one guard (`decide`, `record_plan`,
`forward_micro_batch`) still reaches the net and the windows: the door asks the guard at
each call. tests/test_guard_doors.py checks that the net
and the windows take a door, not the guard.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn

from spikeguard.errors import DeviceOutOfMemory
from spikeguard.memory.ledger import Ledger
from spikeguard.plan.cost import CostModel
from spikeguard.runtime.calm_forward import CalmForwards
from spikeguard.runtime.executor import ExpertPathExecutor
from spikeguard.runtime.history import StepRecorder
from spikeguard.runtime.hookless import HooklessLayers
from spikeguard.runtime.hooks import Context, SavedTensorTracker
from spikeguard.runtime.layer_room import LayerPeaks
from spikeguard.runtime.layers import GuardedLayers
from spikeguard.runtime.offload import OffloadEngine
from spikeguard.runtime.position import Position


@dataclass(frozen=True, slots=True)
class NetDoor:
    """What the safety net uses of its guard."""

    policy: str
    budget_bytes: int
    device: torch.device
    model: nn.Module          # its gradients, snapshot around a measuring re-run
    meter: object             # the device (spikeguard.memory.device)
    ctx: Context
    ledger: Ledger
    layer_room: LayerPeaks
    layers: GuardedLayers     # owns "every layer recomputed whole"; the group's votes
    group_adaptive: bool      # some rank of the group is adaptive
    recorder: Callable[[], Optional[StepRecorder]]   # the open step's (None outside one)
    device_oom: Callable[[BaseException], DeviceOutOfMemory]
    forward_micro_batch: Callable   # (orig_forward, mb, args, kwargs) -> output
    abandon_micro_batch: Callable[[int], None]

    @property
    def full_recompute(self) -> bool:
        return self.layers.full_recompute

    def recompute_whole(self, on: bool) -> None:
        """Every layer recomputed whole from now (a safety net's re-run), or no longer."""
        self.layers.full_recompute = on


@dataclass(frozen=True, slots=True)
class WindowDoor:
    """What an expert path's decision window uses of its guard."""

    position: Position        # in forward or not; backward's marks (offload.expert_path_done)
    ctx: Context
    ledger: Ledger
    tracker: SavedTensorTracker
    engine: OffloadEngine
    executor: ExpertPathExecutor
    cost: CostModel
    hookless: HooklessLayers
    calm: CalmForwards        # counts a layer run in a calm forward
    in_full_region: Callable[[], bool]   # inside a whole-layer checkpoint: recomputed already
    decide: Callable                     # (layer, num_routed) -> the plan's Decision
    record_plan: Callable[[int, list, object], None]   # (layer, counts, plan) for the record
    # (exchange bytes): under EP, room for the dispatch's rows once its counts are known
    make_room_for_dispatch: Callable[[int], None]


def net_door(guard) -> NetDoor:
    """The safety net's door into `guard`."""
    return NetDoor(
        policy=guard.policy, budget_bytes=guard.budget_bytes, device=guard.device,
        model=guard.model, meter=guard.meter, ctx=guard.ctx, ledger=guard.ledger,
        layer_room=guard.layer_room, layers=guard.layers, group_adaptive=guard.group_adaptive,
        recorder=lambda: guard.recorder, device_oom=lambda err: guard.device_oom(err),
        forward_micro_batch=lambda *call: guard.forward_micro_batch(*call),
        abandon_micro_batch=lambda mb: guard.abandon_micro_batch(mb))


def window_door(guard) -> WindowDoor:
    """The expert-path windows' door into `guard` (the adapters install it)."""
    return WindowDoor(
        position=guard.position, ctx=guard.ctx, ledger=guard.ledger, tracker=guard.tracker,
        engine=guard.engine, executor=guard.executor, cost=guard.cost, hookless=guard.hookless,
        calm=guard.calm,
        in_full_region=lambda: guard.layers.in_full_region,
        decide=lambda layer, num_routed: guard.decide(layer, num_routed),
        record_plan=lambda layer, counts, plan: guard.record_plan(layer, counts, plan),
        make_room_for_dispatch=guard.window.make_room_for_dispatch)
