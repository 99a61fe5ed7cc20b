"""What a guard learns online, as plain JSON values: saved in a checkpoint, loaded on resume.

    state = guard.state_dict()        # {"version": 1, "cost": ..., "layer_room": ..., ...}
    guard.load_state_dict(state)      # a resumed run decides as the uninterrupted one

A guard attached afresh starts cold: the cost model's seconds per routed token and per
byte copied are one timing at attach (spikeguard.plan.cost), the layer peaks' slopes are
the shapes' conservative ones until a step calibrates them (plan/layer_room.py), the
forecast's head and shared-expert bytes per token are estimates until a micro-batch
measures them, and the window has seen no attention part nor routed copies per token
(plan/room.py `Seen`). A run resumed from a checkpoint without them decides its first
steps from those cold figures where the uninterrupted run had learned ones (more recompute
and offload than needed, seen on the tiny preset: tests/train/test_train_checkpoint_warm.py).
The state is the values of those pieces, read and written through their public fields;
what is fixed by the model and the device (shapes, budget, the device's copy overlap) is
not in it. Floats go through JSON exactly (repr round-trips them).
"""

from __future__ import annotations

from dataclasses import asdict, fields, replace
from typing import Any

from spikeguard.errors import UsageError
from spikeguard.plan.layer_room import LayerRoom

VERSION = 1
_COST = ("d2h_s_per_byte", "h2d_s_per_byte")
_FORECAST = ("head_bytes_per_token", "post_bytes_per_token")
_SEEN = ("layer_bytes_per_token", "routed_per_token")


def state_of(guard) -> dict[str, Any]:
    """The guard's learned figures (module doc), plain JSON values."""
    cost, forecast, seen = guard.cost, guard.forecast, guard.window.seen
    return {"version": VERSION, "policy": guard.policy,
            "cost": {"stage_s_per_token": dict(cost.stage_s_per_token),
                     **{k: getattr(cost, k) for k in _COST}},
            "forecast": {k: getattr(forecast, k) for k in _FORECAST},
            "layer_room": asdict(guard.layer_room.room),
            "seen": {k: getattr(seen, k) for k in _SEEN}}


def load_into(guard, state: dict[str, Any]) -> None:
    """Set the guard's learned figures from `state_of`'s dict (of a guard on the same
    model and layout). Everything is checked before anything changes."""
    version = state.get("version") if isinstance(state, dict) else state
    if version != VERSION:
        raise UsageError(f"the guard's learned state is not version {VERSION} "
                         f"(got {version!r:.40})")
    cost = state["cost"]
    stages = cost["stage_s_per_token"]
    if set(stages) != set(guard.cost.stage_s_per_token):
        raise UsageError(f"the guard's learned state times the stages {sorted(stages)}, this "
                         f"guard's cost model has {sorted(guard.cost.stage_s_per_token)}")
    names = {f.name for f in fields(LayerRoom)}
    if set(state["layer_room"]) != names:
        raise UsageError(f"the guard's learned layer room has {sorted(state['layer_room'])}, "
                         f"expected {sorted(names)}")
    guard.cost.stage_s_per_token.update({k: float(v) for k, v in stages.items()})
    for k in _COST:
        setattr(guard.cost, k, float(cost[k]))
    for k in _FORECAST:
        setattr(guard.forecast, k, float(state["forecast"][k]))
    guard.layer_room.room = LayerRoom(**state["layer_room"])
    guard.window.seen = replace(guard.window.seen, **{k: float(state["seen"][k]) for k in _SEEN})
    guard.planner.refresh()   # the plans are ranked again with the loaded timings
