"""A step that opens with gradients, re-run by replay instead of a copy of them.

Gradient accumulation across guard steps (transformers' Trainer calls the guard once per
micro-batch): a step after the window's first opens with the gradients of the micro-steps
before it. The step-level net must put them back if the step fails after a backward
began; by default it copies every gradient to host at each such step (GradSnapshot).
With `run_step(fn, replay=...)` nothing is copied: a failed step drops the gradients and
its re-run replays the earlier micro-steps from none, in order, then `fn`.

The failure is made where the step-level net catches it: after the micro-batch's forward,
outside the model (a tensor the step function allocates on the device beside the kept
activations), sized so that it fits beside full recompute's and not beside what adaptive
keeps at this budget.

    .venv/bin/python -m pytest tests/runtime/test_runtime_replay.py -q
"""

from __future__ import annotations

import pytest
import torch
from host_marks import metered

import spikeguard
from spikeguard.errors import UsageError
from spikeguard.model import build_model, model_config
from spikeguard.runtime import device_state

pytestmark = pytest.mark.timeout(120)

CFG = model_config("tiny")
NUM = 3   # micro-steps of the accumulation window


def _batches(seed: int = 5) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, CFG.vocab_size, (4, CFG.seq_len + 1), generator=gen)
            for _ in range(NUM)]


BATCHES = _batches()


def _micro_step(model, tokens_BT, ballast: int = 0) -> None:
    loss = model(tokens_BT[:, :-1], tokens_BT[:, 1:]).loss
    if ballast:   # on the device beside what the forward kept
        torch.empty(ballast, dtype=torch.uint8).fill_(1)
    loss.backward()


@pytest.fixture(scope="module")
def sizes() -> dict:
    """The plain model's accumulated gradients; the device's in-use after the last
    micro-step's forward with everything kept and with every layer recomputed; the peak."""
    plain = build_model(CFG, seed=0)
    for tokens in BATCHES:
        _micro_step(plain, tokens)
    after = {}
    for policy in ("none", "full"):
        model = build_model(CFG, seed=0)
        guard = spikeguard.attach(model, budget="1GiB", policy=policy)
        for tokens in BATCHES[:-1]:
            guard.run_step(lambda: _micro_step(model, tokens))

        def last():
            loss = model(BATCHES[-1][:, :-1], BATCHES[-1][:, 1:]).loss
            after[policy] = guard.meter.allocated()
            loss.backward()
        guard.run_step(last)
        if policy == "none":
            peak = max(r["peak_bytes"] for r in guard.history)
    return {"grads": [p.grad.clone() for p in plain.parameters()], "kept": after["none"],
            "recomputed": after["full"], "peak": peak}


def _copies(monkeypatch) -> list:
    """The gradients copied to host (device_state's one copy function), counted."""
    copied, real = [], device_state._host_copy

    def counted(t):
        copied.append(t.numel() * t.element_size())
        return real(t)
    monkeypatch.setattr(device_state, "_host_copy", counted)
    return copied


def _window(sizes, replayed: bool, fail: bool):
    """Three micro-steps, one guard step each; the last fails after its forward where
    `fail`. Returns the model, its guard, how many replays ran, and each step's peak by
    the independent meter (tests/meter.py; the host copies of the gradients are host
    memory)."""
    budget = sizes["peak"] + 64 * 1024
    # beside what adaptive keeps at this budget it overflows; beside full recompute's not
    ballast = budget - (sizes["kept"] + sizes["recomputed"]) // 2 if fail else 0
    model = build_model(CFG, seed=0)
    guard = spikeguard.attach(model, budget=budget, policy="adaptive")
    replays, peaks = [], []
    for i, tokens in enumerate(BATCHES):
        def replay(done=BATCHES[:i]):
            replays.append(len(done))
            for earlier in done:
                _micro_step(model, earlier)
        last = i == NUM - 1
        with metered(model) as meter:
            guard.run_step(lambda: _micro_step(model, tokens, ballast if last else 0),
                           replay=replay if replayed and i else None)
        peaks.append(meter.peak_bytes)
    return model, guard, replays, peaks


@pytest.mark.parametrize("replayed", [True, False], ids=["replay", "copy"])
def test_a_failed_step_that_opened_with_gradients_gives_the_plain_sums(sizes, monkeypatch,
                                                                       replayed):
    copied = _copies(monkeypatch)
    model, guard, replays, peaks = _window(sizes, replayed, fail=True)
    last = guard.history[-1]
    assert [r["scope"] for r in last["safety_net"]] == ["step"]   # the step-level net ran
    assert last["peak_bytes"] <= last["budget_bytes"]
    # The device refused the ballast: what was live never passed the budget, by the meter.
    assert all(peak <= last["budget_bytes"] for peak in peaks), peaks
    assert all(torch.equal(a, p.grad) for a, p in zip(sizes["grads"], model.parameters()))
    if replayed:
        assert replays == [NUM - 1]   # once, the two micro-steps before the failed one
        assert copied == []
        assert last["micro_batches"] == NUM   # the replayed forwards ran in the re-run
    else:
        grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        assert sum(copied) == 2 * grad_bytes   # every gradient, at each step after the first
        assert last["micro_batches"] == 1


def test_a_step_that_goes_through_never_replays_and_copies_nothing(sizes, monkeypatch):
    copied = _copies(monkeypatch)
    model, guard, replays, peaks = _window(sizes, replayed=True, fail=False)
    assert replays == [] and copied == []
    assert all(peak <= guard.budget_bytes for peak in peaks), peaks
    assert all(not r["safety_net"] for r in guard.history)
    assert all(torch.equal(a, p.grad) for a, p in zip(sizes["grads"], model.parameters()))


def test_replay_must_be_callable():
    guard = spikeguard.attach(build_model(CFG, seed=0), budget="1GiB", policy="adaptive")
    with pytest.raises(UsageError, match="replay"):
        guard.run_step(lambda: None, replay=3)
