"""torchtitan's second MoE family, `qwen3` (every layer MoE, no shared expert), under the
guard in one process: found by the same structure as deepseek_v3, gradients `torch.equal`
to the unguarded model's under every policy, adaptive under a tight budget on the true
device, and `none` out of memory there.

    .venv/bin/python -m pytest tests/integrations/test_integrations_titan_qwen3.py -q
"""

from __future__ import annotations

import pytest

pytest.importorskip("torchtitan")

import spikeguard  # noqa: E402
from spikeguard.integrations.titan_models import TitanSizes, build_titan_model  # noqa: E402

from titan_helpers import HUGE, batches, bitwise, moe_blocks, step  # noqa: E402

pytestmark = [pytest.mark.timeout(120), pytest.mark.filterwarnings("ignore:In CPU autocast")]

DATA = batches(3)
SIZES = TitanSizes(num_layers=2)   # 2 MoE layers, 8 experts top-3, D=F=32


@pytest.fixture(scope="module")
def case():
    model = build_titan_model("qwen3", SIZES, seed=0)
    assert len(moe_blocks(model)) == 2
    reference = step(model, DATA)
    peaks = {}
    for policy in ("none", "full"):
        guard = spikeguard.attach(model, budget=HUGE, policy=policy)
        assert bitwise(reference, step(model, DATA, guard)), policy
        peaks[policy] = guard.history[-1]["peak_bytes"]
        guard.detach()
    assert peaks["full"] < peaks["none"]
    return model, reference, peaks


@pytest.mark.parametrize("policy", ["experts", "offload", "adaptive"])
def test_every_policy_bitwise(case, policy):
    model, reference, _ = case
    guard = spikeguard.attach(model, budget=HUGE, policy=policy)
    try:
        assert bitwise(reference, step(model, DATA, guard))
        assert sum(guard.history[-1]["decisions"].values()) == 4   # 2 layers x 2 micro-batches
    finally:
        guard.detach()


def test_adaptive_fits_a_budget_none_does_not(case):
    model, reference, peaks = case
    budget = int(peaks["full"] + 0.8 * (peaks["none"] - peaks["full"]))
    guard = spikeguard.attach(model, budget=budget, policy="adaptive")
    try:
        assert bitwise(reference, step(model, DATA, guard))
        record = guard.history[-1]
        assert record["peak_bytes"] <= budget
        assert record["decisions"]["save"] < 4 or record["safety_net"]
    finally:
        guard.detach()
    guard = spikeguard.attach(model, budget=budget, policy="none")
    try:
        with pytest.raises(spikeguard.DeviceOutOfMemory):
            step(model, DATA, guard)
    finally:
        guard.detach()
