"""Hookless layers on transformers models in one process (spikeguard/runtime/hookless.py,
integrations/hf_window.py `run_region(hookless=True)`): an experts call that keeps
everything, where nothing of the step can later want what it saves off the device, runs
with no saved-tensor hook, and the layers after it in the micro-batch run whole without
one; everything else is as with the hook on every layer (the same guard with
`hookless.enabled = False`).

Against that reference, for every architecture and for adaptive and none: the same
gradients (torch.equal, and the unguarded model's), the same true peak (tests/meter.py,
an independent meter over every op's outputs), the ledger empty after backward; and the
attribution the ledger models for a hookless call ("experts": the region byte model's
keep-everything bytes) within 5% of what the hook measures, the layers' other parts as
the first layer measured them (up to 2% over: it also saved what later layers share).

    .venv/bin/python -m pytest tests/integrations/test_integrations_hf_hookless.py -q
"""

from __future__ import annotations

import pytest
from hf_helpers import ARCHITECTURES, HUGE, SIZES, assert_bitwise, build, step, windows
from meter import LiveMeter, model_state_tensors

import spikeguard

pytestmark = pytest.mark.timeout(300)

OPS = ("attn", "router", "experts", "shared")


def _guarded(name: str, policy: str, hookless: bool):
    model = build(name)
    guard = spikeguard.attach(model, budget=HUGE, policy=policy)
    if not hookless:
        guard.hookless.enabled = False
    return model, guard


def _two_steps(name: str, policy: str, hookless: bool, batches):
    model, guard = _guarded(name, policy, hookless)
    step(model, batches, guard)
    with LiveMeter(baseline_tensors=model_state_tensors(model, None)) as meter:
        grads = step(model, batches, guard)
    return guard, grads, meter


@pytest.mark.parametrize("policy", ["adaptive", "none"])
@pytest.mark.parametrize("name", ARCHITECTURES)
def test_a_calm_step_runs_every_experts_call_hookless_and_changes_nothing_else(name, policy):
    batches = windows(seed=3)
    on, grads_on, meter_on = _two_steps(name, policy, True, batches)
    off, grads_off, meter_off = _two_steps(name, policy, False, batches)
    assert on.history[-1]["hookless_layers"] == SIZES.num_layers * len(batches)
    assert off.history[-1]["hookless_layers"] == 0
    assert_bitwise(grads_off, grads_on)
    assert_bitwise(step(build(name), batches), grads_on)
    assert meter_on.peak_bytes == meter_off.peak_bytes
    # What the ledger modelled left it with the backward that freed the tensors.
    assert on.ledger.activation_bytes == off.ledger.activation_bytes == 0


def _attribution(name: str, hookless: bool):
    model, guard = _guarded(name, "adaptive", hookless)
    batches = windows(seed=23, sizes=(4, 8))
    with guard.step():
        outs = [model(input_ids=w, labels=w) for w in batches]
        seen = {(mb, layer, op): guard.ledger.bytes_by(mb, layer, op)
                for mb in range(len(batches)) for layer in range(SIZES.num_layers)
                for op in OPS}
        for out in outs:
            out.loss.backward()
    return seen, guard


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_the_modelled_attribution_matches_what_the_hook_measures(name):
    # Both forwards before either backward: both micro-batches are in the ledger at once.
    modelled, guard = _attribution(name, True)
    measured, _ = _attribution(name, False)
    assert guard.history[-1]["hookless_layers"] == 2 * SIZES.num_layers
    assert guard.ledger.activation_bytes == 0   # the backward released what was modelled
    for key, want in measured.items():
        got = modelled[key]
        if key[2] == "experts":
            assert want > 0 and abs(got - want) <= 0.05 * want, (key, got, want)
        elif key[1] == 0:   # measured there, by the hook, in both runs
            assert got == want, (key, got, want)
        else:   # as layer 0 measured them, which also saved what later layers share (the
            # rotary tables: one storage, attributed where first saved): a little over
            assert want <= got <= 1.02 * want, (key, got, want)
