"""The API refuses misuse with a clear UsageError (issue 15, part 5): budgets that are
not finite sizes, nested steps, steps after detach, and a forward with gradients outside
any step (refused by default; `guard.unguarded()` opts out; torch.no_grad() evaluation
needs no opt-out).

    .venv/bin/python -m pytest tests/runtime/test_runtime_misuse.py -q
"""

from __future__ import annotations

import pytest
import torch

import spikeguard
from spikeguard.model import build_model, model_config

pytestmark = pytest.mark.timeout(120)

CFG = model_config("tiny")


@pytest.fixture
def model():
    return build_model(CFG, seed=0)


def _tokens() -> torch.Tensor:
    return torch.randint(0, CFG.vocab_size, (2, CFG.seq_len + 1),
                         generator=torch.Generator().manual_seed(0))


def _train(model):
    x = _tokens()
    model(x[:, :-1], x[:, 1:]).loss.backward()


@pytest.mark.parametrize("budget", [float("nan"), float("inf"), -1, 10**400, "9" * 400,
                                    "nanGiB", "-1GiB", 0.5])
def test_a_budget_that_is_not_a_finite_positive_size_is_refused(model, budget):
    with pytest.raises(spikeguard.UsageError, match="budget"):
        spikeguard.attach(model, budget=budget)
    assert spikeguard.attach(model, budget="1GiB").detach() is None   # left unattached


def test_nested_steps_are_refused_and_the_outer_step_still_records(model):
    guard = spikeguard.attach(model, budget="1GiB", policy="none")
    with pytest.raises(spikeguard.UsageError, match="do not nest"):
        with guard.step():
            with guard.step():
                pass
    with pytest.raises(spikeguard.UsageError, match="do not nest"):
        guard.run_step(lambda: guard.run_step(lambda: None))
    assert len(guard.history) == 2
    guard.run_step(lambda: _train(model))   # the guard works after
    assert len(guard.history) == 3


@pytest.mark.parametrize("form", ["step", "run_step"])
def test_a_step_after_detach_is_refused_and_records_nothing(model, form):
    guard = spikeguard.attach(model, budget="1GiB", policy="none")
    guard.detach()
    with pytest.raises(spikeguard.UsageError, match="detached"):
        if form == "step":
            with guard.step():
                _train(model)
        else:
            guard.run_step(lambda: _train(model))
    assert guard.history == []


def test_a_forward_with_gradients_outside_a_step_is_refused(model):
    guard = spikeguard.attach(model, budget="1GiB", policy="adaptive")
    x = _tokens()
    with pytest.raises(spikeguard.UsageError, match="outside guard.step"):
        model(x[:, :-1], x[:, 1:])
    assert guard.history == []
    guard.run_step(lambda: _train(model))   # nothing was left half-open
    assert len(guard.history) == 1


def test_evaluation_under_no_grad_and_the_opt_out_give_the_plain_model(model):
    x = _tokens()
    with torch.no_grad():
        plain = model(x[:, :-1], x[:, 1:]).loss
    plain_grads = torch.autograd.grad(model(x[:, :-1], x[:, 1:]).loss, list(model.parameters()))
    guard = spikeguard.attach(model, budget="1GiB", policy="adaptive")
    with torch.no_grad():
        assert torch.equal(model(x[:, :-1], x[:, 1:]).loss, plain)
    with guard.unguarded():
        loss = model(x[:, :-1], x[:, 1:]).loss
        grads = torch.autograd.grad(loss, list(model.parameters()))
    assert torch.equal(loss.detach(), plain)
    assert all(torch.equal(a, b) for a, b in zip(grads, plain_grads))
    with pytest.raises(spikeguard.UsageError):   # the opt-out ends with its block
        model(x[:, :-1], x[:, 1:])
    with guard.unguarded():   # and inside a step the guard still guards
        guard.run_step(lambda: _train(model))
        assert guard.history[-1]["micro_batches"] == 1
        loss = model(x[:, :-1], x[:, 1:]).loss   # after the step, still the plain model
    assert torch.equal(loss.detach(), plain)
