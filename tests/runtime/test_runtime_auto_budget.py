"""--budget auto: the calm-step probe measures what `none` really peaks at, leaves no trace
on the model, and the budget adds the margin to the activation part only.

    .venv/bin/python -m pytest tests/runtime/test_runtime_auto_budget.py -q
"""

from __future__ import annotations

import pytest
import torch

import spikeguard
from spikeguard.errors import UsageError
from spikeguard.model import build_model, model_config
from spikeguard.train.auto_budget import AUTO_MARGIN, auto_budget, calm_peak_bytes

pytestmark = pytest.mark.timeout(120)
CFG = model_config("tiny")


def _batches(n=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        t = torch.randint(0, CFG.vocab_size, (4, CFG.seq_len + 1), generator=gen)
        out.append((t[:, :-1], t[:, 1:]))
    return out


def test_probe_equals_a_none_step_and_leaves_the_model_as_it_was():
    model = build_model(CFG, seed=0)
    opt = torch.optim.AdamW(model.parameters())
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    peak, static = calm_peak_bytes(model, opt, _batches())
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())
    assert getattr(model, "_spikeguard", None) is None   # detached: attach works again
    guard = spikeguard.attach(model, budget="1GiB", policy="none", optimizer=opt)
    batches = _batches()   # made before the step, as the probe's were (tokens are bytes too)
    with guard.step():
        for x, y in batches:
            model(x, y).loss.backward()
    # The probe's peak is the none step's true peak plus the optimizer state that exists
    # from the first optimizer step on (AdamW: two moments per parameter), not yet here.
    moments = 2 * sum(p.numel() * p.element_size() for p in model.parameters())
    assert peak == guard.history[-1]["peak_bytes"] + moments
    assert static == guard.history[-1]["static_bytes"] and 0 < static < peak


def test_margin_is_on_activations_and_rounded_to_kib():
    assert auto_budget(100 * 1024, 60 * 1024) == 104 * 1024       # 40 KiB activations, +10%
    assert auto_budget(1000, 0, margin=0.5) == 2048               # 1500 rounded up
    assert auto_budget(4096, 4096) == 4096                        # nothing but static
    assert AUTO_MARGIN == 0.10


@pytest.mark.parametrize("args, fragment", [
    ((0, 0), "calm peak"), ((-5, 0), "calm peak"), ((100, 200), "static bytes"),
    ((100, -1), "static bytes"), ((100, 10, -0.1), "margin"), ((100, 10, float("nan")), "margin"),
    ((1.5, 0), "calm peak")])
def test_bad_arguments_are_usage_errors(args, fragment):
    with pytest.raises(UsageError, match=fragment):
        auto_budget(*args)


def test_probe_needs_micro_batches():
    with pytest.raises(UsageError, match="at least one micro-batch"):
        calm_peak_bytes(build_model(CFG, seed=0), None, [])
