"""The simulator and the runtime decide by the same procedure: spikeguard.plan.decide's.

The runtime's window, its hookless proof and the simulator's chunk call the one procedure
(`entry_fallback` at a layer's entry, `decide_layer` after routing, `fits_unaided` for
the proof), which computes the planner's inputs with spikeguard.plan.room's
`decision_inputs`; the planner gets exactly the room's arguments, and the window's memory
of earlier decisions (`Seen`) moves the same way in both: a decided layer raises it, a
layer recomputed whole does not, a new micro-batch forgets its routed count but not the
per-token figures. tests/sim/test_sim_validation.py compares the plans themselves, per
step, against the runtime's.

    .venv/bin/python -m pytest tests/sim/test_sim_room.py -q
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import spikeguard
import spikeguard.runtime.hookless as hookless
import spikeguard.runtime.window as window
import spikeguard.sim.chunk as chunk
import spikeguard.sim.walk as walk
from spikeguard.model import build_model, model_config
from spikeguard.plan import decide as procedure
from spikeguard.plan import room
from spikeguard.plan.planner import Planner
from spikeguard.sim.config import load_config
from spikeguard.sim.engine import device_cost, simulate
from spikeguard.sim.shape import build


def _record(monkeypatch, module) -> dict:
    """Spy on the procedure as `module` (the runtime's window or the simulator's chunk)
    calls it, on the room it computes, and on Planner.decide; `events` is the order they
    ran in: ("entry", state), ("room", room), ("decide", args)."""
    seen: dict = {"entries": [], "rooms": [], "decides": [], "events": [], "calls": []}
    real_inputs, real_decide = procedure.decision_inputs, Planner.decide
    real_entry, real_layer = procedure.entry_fallback, procedure.decide_layer

    def inputs(state, forecast):
        out = real_inputs(state, forecast)
        seen["rooms"].append(out)
        seen["events"].append(("room", out))
        return out

    def entry(state, *args, **kwargs):
        seen["entries"].append(state)
        seen["events"].append(("entry", state))
        seen["calls"].append("entry_fallback")
        return real_entry(state, *args, **kwargs)

    def layer(*args, **kwargs):
        seen["calls"].append("decide_layer")
        return real_layer(*args, **kwargs)

    def decide(self, *args, **kwargs):
        seen["decides"].append(args)
        seen["events"].append(("decide", args))
        return real_decide(self, *args, **kwargs)

    monkeypatch.setattr(procedure, "decision_inputs", inputs)
    monkeypatch.setattr(module, "entry_fallback", entry)
    monkeypatch.setattr(module, "decide_layer", layer)
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
    # every decision came through the one procedure
    assert calls["calls"].count("decide_layer") == len(calls["decides"])
    assert _decided_on_the_last_room(calls)


def _tiny_adaptive_step(micro_batches: int):
    """One step of the tiny model under adaptive at 1 GiB (what the plans are does not
    matter to these tests, only how they are reached); its guard."""
    cfg = model_config("tiny")
    model = build_model(cfg, seed=0)
    gen = torch.Generator().manual_seed(3)
    batch_BT = torch.randint(0, cfg.vocab_size, (4, cfg.seq_len + 1), generator=gen)
    guard = spikeguard.attach(model, budget="1GiB", policy="adaptive")
    with guard.step():
        for _ in range(micro_batches):
            model(batch_BT[:, :-1], batch_BT[:, 1:]).loss.backward()
    return guard


def test_every_runtime_decision_is_made_on_the_rooms_arguments(monkeypatch):
    calls = _record(monkeypatch, window)
    cfg = model_config("tiny")
    _tiny_adaptive_step(2)
    assert calls["decides"] and calls["entries"]
    assert calls["calls"].count("decide_layer") == len(calls["decides"])
    assert calls["calls"].count("entry_fallback") == 2 * cfg.num_layers
    assert _decided_on_the_last_room(calls)
    # what the window remembers at each layer's entry is what the earlier layers decided
    counts: list[int] = []
    for event in calls["events"]:
        if event[0] == "room":
            counts.append(event[1].num_routed)
            continue
        if event[0] == "decide":
            continue
        entry = event[1]   # an entry: the hookless proof's rooms come after a decision
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
    real_overflow = procedure.entry_overflow
    # layer 2 of the first micro-batch is recomputed whole, whatever its estimate says
    # (an overflow no eviction can cover)
    monkeypatch.setattr(procedure, "entry_overflow",
                        lambda s, f: (1 << 50, 1 << 50) if s.layer == 2 and len(
                            calls["entries"]) < 4 else real_overflow(s, f))
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


def _hookless_layers(monkeypatch, answer) -> tuple[int, list]:
    """One tiny adaptive step with the proof's question spied on (and answered `answer`
    instead, unless None): the layers run hookless, and the layers asked about."""
    asked = []
    real = hookless.fits_unaided

    def spy(*args, **kwargs):
        asked.append(args[0].layer)
        return real(*args, **kwargs) if answer is None else answer

    monkeypatch.setattr(hookless, "fits_unaided", spy)
    return _tiny_adaptive_step(1).history[-1]["hookless_layers"], asked


def test_the_hookless_proof_asks_the_procedure(monkeypatch):
    """The hookless proof (runtime/hookless.py) asks plan/decide.py's `fits_unaided` of
    each later layer, and goes by its answer: told no, only the last layer (which has no
    later layer to ask about) runs hookless."""
    num_layers = model_config("tiny").num_layers
    proven, asked = _hookless_layers(monkeypatch, None)
    assert proven == num_layers and set(asked) == set(range(1, num_layers))
    refused, asked = _hookless_layers(monkeypatch, False)
    assert refused == 1 and asked
