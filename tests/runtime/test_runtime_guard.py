"""The guard's life cycle and its user errors: attach, detach, and what they refuse.

B = sequences, T = tokens per sequence.

    .venv/bin/python -m pytest tests/runtime/test_runtime_guard.py -q
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import spikeguard
from spikeguard.model import build_model, model_config

pytestmark = pytest.mark.timeout(120)

CFG = model_config("tiny")


def _tokens(batch: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, CFG.vocab_size, (batch, CFG.seq_len + 1), generator=gen)


def _forward_backward(model, tokens_BT):
    model.zero_grad(set_to_none=True)
    out = model(tokens_BT[:, :-1], tokens_BT[:, 1:])
    out.loss.backward()
    return out.logits_BTV.detach(), out.loss.detach(), [p.grad.clone() for p in model.parameters()]


def _static_bytes() -> int:
    model = build_model(CFG, seed=0)
    guard = spikeguard.attach(model, budget="1GiB", policy="none")
    static = guard.ledger.static_bytes
    guard.detach()
    return static


def test_detach_leaves_the_model_as_it_was():
    tokens = _tokens(4, seed=1)
    model = build_model(CFG, seed=0)
    logits_before, loss_before, grads_before = _forward_backward(model, tokens)

    # A budget that nothing but the parameters fits: any guarded training forward fails.
    guard = spikeguard.attach(model, budget=_static_bytes() + 1024, policy="none")
    with pytest.raises(spikeguard.DeviceOutOfMemory):
        with guard.step():
            _forward_backward(model, tokens)
    guard.detach()

    assert "forward" not in vars(model)
    for module in model.modules():
        assert "forward" not in vars(module), type(module).__name__
        assert not module._forward_hooks and not module._forward_pre_hooks, type(module).__name__
    assert all(block.expert_runner is None for block in model.moe_blocks())
    assert getattr(model, "_spikeguard", None) is None

    in_use, peak = guard.ledger.in_use(), guard.ledger.peak_bytes
    logits_after, loss_after, grads_after = _forward_backward(model, tokens)   # no OOM now
    assert (guard.ledger.in_use(), guard.ledger.peak_bytes) == (in_use, peak)
    assert torch.equal(logits_before, logits_after) and torch.equal(loss_before, loss_after)
    assert all(torch.equal(a, b) for a, b in zip(grads_before, grads_after))


def test_attach_again_after_detach_works():
    model = build_model(CFG, seed=0)
    spikeguard.attach(model, budget="1GiB", policy="none").detach()
    guard = spikeguard.attach(model, budget="1GiB", policy="experts")
    with guard.step():
        _forward_backward(model, _tokens(2, seed=2))
    assert guard.history[-1]["decisions"]["recompute"] > 0


def test_attaching_twice_is_refused_and_the_first_guard_keeps_working():
    model = build_model(CFG, seed=0)
    guard = spikeguard.attach(model, budget="1GiB", policy="offload")
    with pytest.raises(spikeguard.UsageError, match="already"):
        spikeguard.attach(model, budget="1GiB", policy="none")
    with guard.step():
        _forward_backward(model, _tokens(2, seed=3))
    assert guard.history[-1]["decisions"]["offload"] > 0


def test_detaching_twice_is_refused():
    model = build_model(CFG, seed=0)
    guard = spikeguard.attach(model, budget="1GiB", policy="none")
    guard.detach()
    with pytest.raises(spikeguard.UsageError):
        guard.detach()


def test_a_stale_guard_cannot_detach_a_newer_one():
    model = build_model(CFG, seed=0)
    old = spikeguard.attach(model, budget="1GiB", policy="none")
    old.detach()
    new = spikeguard.attach(model, budget="1GiB", policy="none")
    with pytest.raises(spikeguard.UsageError):
        old.detach()
    assert model._spikeguard is new
    new.detach()


@pytest.mark.parametrize("kwargs,match", [
    ({"budget": None}, "budget"),
    ({}, "budget"),
    ({"budget": "1GiB", "policy": "greedy"}, "policy"),
    ({"budget": "1GiB", "policy": "None"}, "policy"),
    ({"budget": "lots"}, "byte size"),
    ({"budget": 0}, "positive"),
    ({"budget": -5}, "positive"),
    ({"budget": "1GiB", "optimizer": "adamw"}, "optimizer"),
])
def test_bad_arguments_are_usage_errors_and_leave_the_model_unattached(kwargs, match):
    model = build_model(CFG, seed=0)
    with pytest.raises(spikeguard.UsageError, match=match):
        spikeguard.attach(model, **kwargs)
    assert getattr(model, "_spikeguard", None) is None
    assert "forward" not in vars(model)
    spikeguard.attach(model, budget="1GiB").detach()


@pytest.mark.parametrize("module", [nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), nn.ReLU())])
def test_a_model_without_moe_blocks_is_a_usage_error(module):
    with pytest.raises(spikeguard.UsageError, match="MoE"):
        spikeguard.attach(module, budget="1GiB")
    assert "forward" not in vars(module)


def test_attaching_to_something_that_is_not_a_module_is_a_usage_error():
    with pytest.raises(spikeguard.UsageError, match="nn.Module"):
        spikeguard.attach("model", budget="1GiB")


def test_usage_errors_are_value_errors_and_oom_errors_are_runtime_errors():
    assert issubclass(spikeguard.UsageError, ValueError)
    assert issubclass(spikeguard.BudgetInfeasible, spikeguard.DeviceOutOfMemory)
    assert issubclass(spikeguard.DeviceOutOfMemory, RuntimeError)


def test_static_bytes_count_parameters_gradients_and_optimizer_moments():
    model = build_model(CFG, seed=0)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    guard = spikeguard.attach(model, budget="1GiB", policy="none")
    assert guard.ledger.static_bytes == 2 * param_bytes            # parameters + gradients
    guard.detach()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = spikeguard.attach(model, budget="1GiB", policy="none", optimizer=optimizer)
    assert guard.ledger.static_bytes == 4 * param_bytes            # + AdamW's two moments
    with guard.step():
        _forward_backward(model, _tokens(2, seed=4))
    optimizer.step()                                               # the moments now exist
    with guard.step():
        _forward_backward(model, _tokens(2, seed=5))
    assert [r["static_bytes"] for r in guard.history] == [4 * param_bytes] * 2
