"""The safety net: when the plan was wrong, the micro-batch (or the step) reruns with full
recompute.

The forecast is blinded (nothing still to come, no output head), so the planner saves
everything in both MoE layers and the head's bytes overflow the budget. The guard must
free the failed micro-batch, run it again under full recompute, and give the same
gradients, bit for bit, as the plain model.

    .venv/bin/python -m pytest tests/runtime/test_runtime_safety_net.py -q
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

import spikeguard
from spikeguard.model import build_model, model_config

pytestmark = pytest.mark.timeout(120)

CFG = model_config("tiny")


def _batches(sizes, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, CFG.vocab_size, (b, CFG.seq_len + 1), generator=gen) for b in sizes]


BATCHES = _batches((4, 4), seed=71)


def _step(model, guard=None) -> None:
    def micro_batches():
        for tokens_BT in BATCHES:
            model(tokens_BT[:, :-1], tokens_BT[:, 1:]).loss.backward()

    # run_step: the net that reaches backward (on the device's true figure a blinded
    # forecast may also overflow there, in the head's backward).
    guard.run_step(micro_batches) if guard is not None else micro_batches()


@pytest.fixture(scope="module")
def reference() -> dict:
    plain = build_model(CFG, seed=0)
    _step(plain)
    model = build_model(CFG, seed=0)
    guard = spikeguard.attach(model, budget="1GiB", policy="none")
    _step(model, guard)
    record = guard.history[-1]
    return {"grads": [p.grad.clone() for p in plain.parameters()],
            "static": record["static_bytes"], "peak": record["peak_bytes"]}


def _blind(guard) -> None:
    guard.forecast.still_to_come = lambda *args, **kwargs: 0
    guard.forecast.head_bytes_per_token = 0.0
    guard.forecast.observe = lambda *args, **kwargs: None
    # The layer peaks' experts' weight gradients (plan/layer_room.py) would make the
    # layers evict for the head's room on their own: blinded too, so the plan is wrong.
    guard.layer_room.room = dataclasses.replace(guard.layer_room.room, expert_grad_bytes=0,
                                                expert_grad_sum_bytes=0)


def test_under_planned_micro_batches_rerun_and_give_bitwise_gradients(reference, caplog):
    static = reference["static"]
    # The expert paths all saved fit; the output head on top of them does not.
    budget = static + int(0.85 * (reference["peak"] - static))
    model = build_model(CFG, seed=0)
    guard = spikeguard.attach(model, budget=budget, policy="adaptive")
    _blind(guard)
    with caplog.at_level(logging.WARNING, logger="spikeguard"):
        _step(model, guard)

    record = guard.history[-1]
    assert record["safety_net_reruns"] >= 1
    assert record["micro_batches"] == 2
    assert record["peak_bytes"] <= budget
    assert any("full recompute" in r.getMessage() for r in caplog.records)
    # Nothing of the failed attempts is left on the device or the host.
    assert guard.ledger.host_bytes == 0
    assert guard.ledger.activation_bytes <= 1024     # the aux-loss graph kept by the model
    grads = [p.grad for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(reference["grads"], grads))


def test_blinded_guard_under_a_loose_budget_needs_no_rerun(reference):
    """Control: the same blinded guard with room for everything never reruns, so the
    reruns above come from the overflow, not from the blinding itself."""
    model = build_model(CFG, seed=0)
    guard = spikeguard.attach(model, budget=reference["peak"], policy="adaptive")
    _blind(guard)
    _step(model, guard)
    record = guard.history[-1]
    assert record["safety_net_reruns"] == 0
    assert record["decisions"]["recompute"] == record["decisions"]["offload"] == 0
    grads = [p.grad for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(reference["grads"], grads))


def test_decisions_count_only_what_ran(reference):
    """The plans of an abandoned attempt never ran: the step must not report them."""
    static = reference["static"]
    budget = static + int(0.85 * (reference["peak"] - static))
    model = build_model(CFG, seed=0)
    guard = spikeguard.attach(model, budget=budget, policy="adaptive")
    _blind(guard)
    _step(model, guard)
    record = guard.history[-1]
    reruns = record["safety_net_reruns"]
    assert reruns >= 1
    # What ran: a step re-run runs both micro-batches fully recomputed; a micro-batch
    # re-run that one, the others keeping everything (the forecast is blind). The
    # abandoned attempts' plans are gone either way.
    step_rerun = any(net["scope"] == "step" for net in record["safety_net"])
    full = 2 if step_rerun else reruns
    per_mb = CFG.num_layers * 5
    assert record["decisions"] == {"save": (2 - full) * per_mb, "recompute": full * per_mb,
                                   "offload": 0}
