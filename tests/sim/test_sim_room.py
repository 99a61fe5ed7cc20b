"""The simulator and the runtime decide on the same inputs: spikeguard.plan.room's.

Both call `decision_inputs` and `layer_cannot_fit`; the planner gets exactly the room's
arguments, and the window's memory of earlier decisions (`Seen`) moves the same way in
both: a decided layer raises it, a layer recomputed whole does not, a new micro-batch
forgets its routed count but not the per-token figures. tests/sim/test_sim_validation.py
compares the plans themselves, per step, against the runtime's.

    .venv/bin/python -m pytest tests/sim/test_sim_room.py -q
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import spikeguard
import spikeguard.runtime.window as window
import spikeguard.sim.chunk as chunk
import spikeguard.sim.walk as walk
from spikeguard.model import build_model, model_config
from spikeguard.plan import room
from spikeguard.plan.planner import Planner
from spikeguard.sim.config import load_config
from spikeguard.sim.engine import device_cost, simulate
from spikeguard.sim.shape import build


def _record(monkeypatch, module) -> dict:
    """Spy on the room functions as `module` sees them, and on Planner.decide; `events` is
    the order they ran in: ("entry", state, cannot fit) and ("room", room)."""
    seen: dict = {"entries": [], "rooms": [], "decides": [], "events": []}
    real_inputs, real_fit, real_decide = room.decision_inputs, room.layer_cannot_fit, Planner.decide

    def inputs(state, forecast):
        out = real_inputs(state, forecast)
        seen["rooms"].append(out)
        seen["events"].append(("room", out))
        return out

    def fit(state, forecast):
        seen["entries"].append(state)
        out = real_fit(state, forecast)
        seen["events"].append(("entry", state, out))
        return out

    def decide(self, *args):
        seen["decides"].append(args)
        seen["events"].append(("decide", args))
        return real_decide(self, *args)

    monkeypatch.setattr(module, "decision_inputs", inputs)
    monkeypatch.setattr(module, "layer_cannot_fit", fit)
    monkeypatch.setattr(Planner, "decide", decide)
    return seen


def _decided_on_the_last_room(calls) -> bool:
    """Each decision is made on the arguments of the room computed just before it (a room
    with a layer shortfall is computed again after the eviction it asks for)."""
    last, decided = None, []
    for event in calls["events"]:
        if event[0] == "room":
            last = event[1]
        elif event[0] == "decide":
            decided.append(event[1] == last.planner_args())
    return bool(decided) and all(decided)


def test_every_simulated_decision_is_made_on_the_rooms_arguments(monkeypatch):
    calls = _record(monkeypatch, chunk)
    cfg = load_config("188b", overrides={
        "workload.steps": 6, "layout.devices": 256, "layout.global_batch": 128,
        "workload.skew": {"spike_probability": 0.5}, "run.policies": ["adaptive"]})
    decisions = simulate(cfg).policies["adaptive"].decisions
    assert decisions["offload"] + decisions["recompute"] > 0
    assert calls["decides"] and calls["entries"]
    assert _decided_on_the_last_room(calls)


def test_every_runtime_decision_is_made_on_the_rooms_arguments(monkeypatch):
    calls = _record(monkeypatch, window)
    cfg = model_config("tiny")
    model = build_model(cfg, seed=0)
    gen = torch.Generator().manual_seed(3)
    batch_BT = torch.randint(0, cfg.vocab_size, (4, cfg.seq_len + 1), generator=gen)
    # what the plans are does not matter here, only what they are decided on
    guard = spikeguard.attach(model, budget="1GiB", policy="adaptive")
    with guard.step():
        for _ in range(2):
            model(batch_BT[:, :-1], batch_BT[:, 1:]).loss.backward()
    assert calls["decides"] and calls["entries"]
    assert _decided_on_the_last_room(calls)
    # what the window remembers at each layer's entry is what the earlier layers decided
    counts: list[int] = []
    for event in calls["events"]:
        if event[0] == "room":
            counts.append(event[1].num_routed)
            continue
        if event[0] == "decide":
            continue
        entry = event[1]
        if entry.layer == 0:
            counts = []
        assert entry.seen.max_routed == max(counts, default=0)


@pytest.fixture()
def walker():
    cfg = load_config("small", overrides={"run.policies": ["adaptive"]})
    dm = build(cfg)
    return walk.StageWalker(cfg, dm, dm.stages[0], "adaptive", device_cost(cfg, dm)), dm


def test_the_walk_remembers_as_the_window_does(monkeypatch, walker):
    stage_walker, dm = walker
    T, K = dm.tokens, 2
    calls = _record(monkeypatch, chunk)
    real_fit = chunk.layer_cannot_fit
    # layer 2 of the first micro-batch is recomputed whole, whatever its estimate says
    monkeypatch.setattr(chunk, "layer_cannot_fit",
                        lambda s, f: real_fit(s, f) or (s.layer == 2 and len(calls["entries"]) < 4))
    spike, calm = 3 * T * K, T * K
    load = np.array([[calm, spike, 4 * T * K, calm], [calm, calm, calm, calm]])
    stage_walker.walk(load)
    entries = calls["entries"]
    assert [e.layer for e in entries] == [0, 1, 2, 3] * 2
    first = entries[0].seen
    assert first == room.Seen()   # on the emulated device a walk starts as a fresh guard
    assert entries[2].seen.max_routed == spike and entries[2].seen.routed_per_token == 3 * K
    # what it remembers of a layer is the device's growth up to the decision
    grown = max(dm.layer.layer_part(T), dm.layer.at_decision(T, spike))
    assert entries[2].seen.layer_bytes_per_token == grown / T
    # layer 2 ran whole: its 4x count was never decided on, so it is not remembered
    assert entries[3].seen == entries[2].seen
    # the next micro-batch forgets its routed count, not the per-token maximum
    assert entries[4].seen == room.Seen(0, grown / T, 3.0 * K)
