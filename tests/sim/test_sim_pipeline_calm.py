"""The simulator's pipeline reads the schedule as the runtime does, and plans as it does:
on calm PP=2 x EP=2 steps of `small` under a budget `none` fits in, adaptive keeps every
tensor (CPU, emulated device's bytes; no processes).

    .venv/bin/python -m pytest tests/sim/test_sim_pipeline_calm.py -q
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from torch.distributed.pipelining import Schedule1F1B

from spikeguard.plan.cost import CostModel
from spikeguard.sim.config import load_config
from spikeguard.sim.engine import simulate
from spikeguard.sim.schedule import stage_ops

pytestmark = pytest.mark.timeout(300)

CALM = {"spike_probability": 0.0, "calm_max_ratio": 1.2, "spike_min_ratio": 1.2,
        "spike_max_ratio": 2.0}


@pytest.mark.parametrize("micro_batches", [2, 4, 8])
def test_the_simulators_1f1b_is_torchs(micro_batches):
    """The walk's op order per stage is torch.distributed.pipelining's Schedule1F1B action
    list (torch 2.13, built on a stand-in stage), forwards and backwards alike."""
    stage = SimpleNamespace(num_stages=2, stage_index=0, group_rank=0)
    order = Schedule1F1B(stage, micro_batches).pipeline_order
    for rank in range(2):
        torch_kinds = [str(a.computation_type.value) for a in order[rank]
                       if a is not None and str(a.computation_type.value) in ("F", "B")]
        assert [op.kind for op in stage_ops(rank, 2, micro_batches)] == torch_kinds


def _cfg(capacity: int, policy: str):
    return load_config("small", overrides={
        "layout.devices": 4, "layout.pp": 2, "layout.ep": 2, "layout.micro_batch_size": 4,
        "layout.global_batch": 16, "training.optimizer_bytes": 8,
        "training.distributed_optimizer": False, "device.capacity_bytes": capacity,
        "workload.steps": 6, "workload.skew": CALM, "run.policies": [policy]})


def test_calm_pp2_ep2_adaptive_keeps_everything_when_none_fits():
    """6 calm steps, 2 micro-batches of 4 x 128 tokens per stage, budget 1.1x the peak
    `none` reaches. Before the layer peaks were read net of the micro-batch the schedule
    runs in between (and the other pipeline fixes of plan/), stage 0 recomputed 45 ops,
    6 layers whole and evicted 120 MB over these steps."""
    cost = CostModel()
    none = simulate(_cfg(1 << 30, "none"), cost=cost).policies["none"]
    budget = int(1.1 * none.peak_stage_step.max())
    adaptive = simulate(_cfg(budget, "adaptive"), cost=cost).policies["adaptive"]
    assert adaptive.crashes == 0
    assert dict(adaptive.decisions) == {"save": none.decisions["save"]}, adaptive.decisions
    assert adaptive.peak_stage_step.max() <= budget
