"""The rates a guard is given decide its plans (`train --cost-rates`): under the same spike
and budget, rates that make host copies nearly free and recompute dear give offloads and no
recompute; the opposite rates give recomputes and no offload. Gradients stay bitwise the
plain model's under both."""

from __future__ import annotations

import torch

from spikeguard.plan.catalogue import EXPERT_STAGES
from spikeguard.plan.cost import CostModel
from spikeguard.plan.cost_rates import rates_of, use_rates
from true_device_support import TINY, ceiling_steps, guarded, host_marks, metered_step, step_data

assert host_marks   # a fixture: imported for pytest to find, used as an argument

CALM, SPIKE = [8, 8], [8, 16]


def _rates(stage_s: float, copy_s: float) -> dict:
    cost = CostModel()
    cost.stage_s_per_token = {s: stage_s for s in EXPERT_STAGES}
    cost.d2h_s_per_byte = cost.h2d_s_per_byte = copy_s
    return rates_of(cost)


def _spike_decisions(host_marks, budget: int, rates: dict) -> tuple[dict, list]:
    model, opt, guard = guarded(TINY, "adaptive", budget)
    use_rates(guard.cost, rates)
    metered_step(host_marks, model, opt, guard, step_data(TINY, SPIKE, 1), optimizer_step=False)
    grads = [p.grad.clone() for p in model.parameters()]
    guard.detach()
    return guard.history[-1]["decisions"], grads


def test_the_rates_given_decide_offload_against_recompute(host_marks):
    calm, spike = (m.peak_bytes for m in ceiling_steps(host_marks, TINY, [CALM, SPIKE]))
    budget = (calm + spike) // 2
    offloads, grads_a = _spike_decisions(host_marks, budget, _rates(stage_s=1e-3, copy_s=1e-15))
    recomputes, grads_b = _spike_decisions(host_marks, budget, _rates(stage_s=1e-15, copy_s=1e-3))
    assert offloads["offload"] > 0 and offloads["recompute"] == 0, offloads
    assert recomputes["recompute"] > 0 and recomputes["offload"] == 0, recomputes
    plain = guarded(TINY, "none", 1 << 40)
    metered_step(host_marks, *plain, step_data(TINY, SPIKE, 1), optimizer_step=False)
    for p, a, b in zip(plain[0].parameters(), grads_a, grads_b):
        assert torch.equal(p.grad, a) and torch.equal(p.grad, b)
