"""Calm forwards (spikeguard/runtime/calm_forward.py): in one process a forward proven,
before it starts, to keep everything hookless runs as the plain model's own forward.

Against the same guard with calm forwards off (`guard.calm.enabled = False`, every layer
through the hooked path): the same gradients (torch.equal, and the plain model's), the
same true peak (tests/meter.py) and device peak, the same decisions, hookless layers and
routed counts in the record. Where adaptive's own decisions on the hooked path moved
something, the next forward of those shapes runs hooked again (one that kept everything,
unproven, leaves the evidence standing); a step that fails after a calm forward re-runs
hooked and keeps the gradients; a new shape, or a caller's own plan
seam on the guard, runs hooked.

    .venv/bin/python -m pytest tests/runtime/test_runtime_calm_forward.py -q
"""

from __future__ import annotations

import pytest
import torch
from host_marks import host_memory_marked
from meter import LiveMeter, model_state_tensors

import spikeguard
from spikeguard.model import build_model, model_config

pytestmark = pytest.mark.timeout(300)

TINY = model_config("tiny")
SAME = ("decisions", "hookless_layers", "hookless_ends", "received_per_layer",
        "layer_imbalance", "micro_batches", "safety_net_reruns", "evicted_bytes")


def _batches(sizes, seed: int = 5) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, TINY.vocab_size, (b, TINY.seq_len + 1), generator=gen)
            for b in sizes]


def _step_fn(model, batches, ballast: list):
    def step():
        for t in batches:
            loss = model(t[:, :-1], t[:, 1:]).loss
            if ballast:   # once, on the device beside what the forward kept
                torch.empty(ballast.pop(), dtype=torch.uint8).fill_(1)
            loss.backward()
    return step


def _train(policy: str, budget, calm: bool, steps, optimizer: bool = False):
    """`steps`: per step, (micro-batches, ballast bytes or 0). Returns the guard, the
    gradients after each step, and the meter's peak of each step."""
    model = build_model(TINY, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3) if optimizer else None
    guard = spikeguard.attach(model, budget=budget, policy=policy, optimizer=opt)
    guard.calm.enabled = calm
    grads, peaks = [], []
    for batches, ballast in steps:
        model.zero_grad(set_to_none=True)
        meter = LiveMeter(baseline_tensors=model_state_tensors(model, opt))
        with meter, host_memory_marked(meter):   # offloaded bytes are host memory
            guard.run_step(_step_fn(model, batches, [ballast] if ballast else []))
        peaks.append(meter.peak_bytes)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        if opt is not None:
            opt.step()
    return guard, grads, peaks


def _plain_grads(steps, optimizer: bool = False) -> list[dict]:
    model = build_model(TINY, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3) if optimizer else None
    out = []
    for batches, _ in steps:
        model.zero_grad(set_to_none=True)
        for t in batches:
            model(t[:, :-1], t[:, 1:]).loss.backward()
        out.append({n: p.grad.clone() for n, p in model.named_parameters()})
        if opt is not None:
            opt.step()
    return out


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    assert [n for n in a if not torch.equal(a[n], b[n])] == []


@pytest.mark.parametrize("policy", ["adaptive", "none"])
def test_a_calm_forward_changes_nothing_but_the_guards_own_work(policy):
    steps = [(_batches((4, 4)), 0)] * 3
    on, grads_on, peaks_on = _train(policy, "1GiB", True, steps)
    off, grads_off, peaks_off = _train(policy, "1GiB", False, steps)
    # Under none the first step's second micro-batch is calm already (nothing of none
    # depends on what the device holds); under adaptive a forward is calm once a hooked
    # one of its shapes kept everything from as high a start, or higher by less than its
    # step stayed under the budget (the second step's first micro-batch starts 8 bytes
    # above the first step's), from the second step on.
    calm = [r["calm_forwards"] for r in on.history]
    assert calm == ([0, 2, 2] if policy == "adaptive" else [1, 2, 2]), calm
    assert [r["calm_forwards"] for r in off.history] == [0, 0, 0]
    for a, b, plain in zip(grads_on, grads_off, _plain_grads(steps)):
        _same(a, b)
        _same(a, plain)
    assert peaks_on == peaks_off
    for a, b in zip(on.history, off.history):
        assert a["peak_bytes"] == b["peak_bytes"] <= a["budget_bytes"]
        assert {k: a[k] for k in SAME} == {k: b[k] for k in SAME}
    assert on.history[-1]["hookless_layers"] == 2 * TINY.num_layers
    assert on.ledger.activation_bytes == 0


def test_where_adaptive_moved_something_its_forwards_stay_hooked():
    """At 0.85x of the all-saved peak with AdamW's state on the device, adaptive's hooked
    decisions recompute, offload or evict on every step after the first; the proof from
    a forward's start alone said "keeps everything" there and the head's backward ran
    out (seen before the evidence rule). Every forward after one that moved something
    runs hooked; the budget holds by the guard's and the meter's count."""
    steps = [(_batches((4, 4), seed=31), 0)] * 3
    probe, _, _ = _train("none", "1GiB", False, steps, optimizer=True)
    budget = int(0.85 * max(r["peak_bytes"] for r in probe.history))
    guard, grads, peaks = _train("adaptive", budget, True, steps, optimizer=True)
    for r in guard.history[1:]:
        moved = r["decisions"]["recompute"] + r["decisions"]["offload"] + r["evicted_bytes"]
        assert moved > 0 and r["calm_forwards"] == 0, r
    for r, peak in zip(guard.history, peaks):
        assert r["peak_bytes"] <= budget and peak <= budget
        assert r["safety_net_reruns"] == 0
    for a, plain in zip(grads, _plain_grads(steps, optimizer=True)):
        _same(a, plain)


def test_a_hooked_forward_that_kept_everything_unproven_leaves_the_evidence_standing():
    """A hooked forward whose layers kept everything though not every one was proven
    hookless (under expert parallelism: a walk at a spike's counts still remembered; here
    the proof turned off for one step) neither adds evidence nor voids it: the step after
    runs calm again (it ran hooked while such a forward voided the evidence)."""
    steps = [_batches((4, 4))] * 5
    model = build_model(TINY, seed=0)
    guard = spikeguard.attach(model, budget="1GiB", policy="adaptive")
    for k, batches in enumerate(steps):
        guard.hookless.enabled = k != 3
        model.zero_grad(set_to_none=True)
        guard.run_step(_step_fn(model, batches, []))
    records = guard.history
    # The second step's first forward starts 8 bytes above the first step's, inside the
    # room that step left under the budget: calm (compared to the byte, it ran hooked)
    assert [r["calm_forwards"] for r in records] == [0, 2, 2, 0, 2], records
    assert records[3]["hookless_layers"] == 0 and records[3]["decisions"]["save"] > 0
    assert all(r["decisions"]["recompute"] == r["decisions"]["offload"] == 0
               and r["evicted_bytes"] == 0 for r in records)


def test_a_step_that_fails_after_a_calm_forward_re_runs_hooked():
    """The step's function allocates a tensor beside what a calm forward kept, past the
    budget: the step-level net re-runs it with every layer recomputed whole (never calm),
    the gradients bitwise the plain model's; the next forward runs hooked (the failure
    voided the evidence), the one after it calm again."""
    batches = _batches((4,))
    model = build_model(TINY, seed=0)
    probe = spikeguard.attach(model, budget="1GiB", policy="none")
    after = []   # the device's count once the forward kept everything (for sizing only)
    probe.run_step(lambda: (model(batches[0][:, :-1], batches[0][:, 1:]).loss,
                            after.append(probe.ledger.in_use()))[0].backward())
    budget = int(1.1 * probe.history[0]["peak_bytes"])
    ballast = budget - after[0] + 4096   # past the budget beside what is kept
    steps = [(batches, 0)] * 3 + [(batches, ballast)] + [(batches, 0)] * 3
    guard, grads, peaks = _train("adaptive", budget, True, steps)
    calm = [r["calm_forwards"] for r in guard.history]
    assert calm[2] == 1 and calm[3:5] == [0, 0] and calm[-1] == 1, calm
    assert [r["safety_net_reruns"] for r in guard.history] == [0, 0, 0, 1, 0, 0, 0]
    assert guard.history[3]["decisions"]["recompute"] > 0   # the re-run, every layer whole
    for a, plain in zip(grads, _plain_grads(steps)):
        _same(a, plain)
    assert all(p <= budget for p in peaks)


def test_a_new_shape_runs_hooked_once():
    steps = [(_batches((4,)), 0), (_batches((4,)), 0), (_batches((6,)), 0),
             (_batches((6,)), 0), (_batches((4,)), 0)]
    guard, _, _ = _train("none", "1GiB", True, steps)
    assert [r["calm_forwards"] for r in guard.history] == [0, 1, 0, 1, 1]


def test_a_plan_seam_of_the_callers_own_turns_calm_forwards_off():
    """The oracle bench and tests put their own `guard.decide` (or the planner's `fixed`)
    on a guard: every layer of every forward must reach it."""
    model = build_model(TINY, seed=0)
    guard = spikeguard.attach(model, budget="1GiB", policy="none")
    calls = []
    own = guard.decide

    def decide(layer, num_routed):
        calls.append(layer)
        return own(layer, num_routed)

    guard.decide = decide
    for _ in range(3):
        guard.run_step(_step_fn(model, _batches((4,)), []))
    assert len(calls) == 3 * TINY.num_layers
    assert [r["calm_forwards"] for r in guard.history] == [0, 0, 0]
    del guard.decide   # the guard's own seam again: calm
    guard.run_step(_step_fn(model, _batches((4,)), []))
    assert guard.history[-1]["calm_forwards"] == 1
    fixed, plans = guard.planner.fixed, []   # the planner's plan seam (test_sim_device_bytes)
    guard.planner.fixed = lambda plan, num_routed: plans.append(plan) or fixed(plan, num_routed)
    guard.run_step(_step_fn(model, _batches((4,)), []))
    assert guard.history[-1]["calm_forwards"] == 0 and len(plans) >= TINY.num_layers


def test_a_calm_forward_leaves_a_reserve_for_its_backward_until_it_is_done():
    """Both forwards of a step before either backward: what the first one's backward will
    add above the device is reserved for the second's decisions (window.pending_backward,
    which a hooked forward sets from its own decisions' predictions), a calm forward's as
    the last hooked forward predicted it (the step that made the evidence); each is dropped
    once that backward is done."""
    batches = _batches((4, 4))
    model = build_model(TINY, seed=0)
    guard = spikeguard.attach(model, budget="1GiB", policy="adaptive")
    for _ in range(3):
        model.zero_grad(set_to_none=True)
        with guard.step():
            last = guard.window.last_backward_excess
            outs = [model(t[:, :-1], t[:, 1:]) for t in batches]
            between = dict(guard.window.pending_backward)
            for out in outs:
                out.loss.backward()
            assert guard.window.pending_backward == {}
    assert guard.history[-1]["calm_forwards"] == 2
    assert last is not None and between == {0: last, 1: last}, (between, last)
