"""The simulator against the runtime's ledger on the `small` model (CPU, emulated device).

Issue 7: predicted per-step peak bytes within 10% of what the runtime measures over the
same trace, single process and 4 processes (PP=2 x EP=2). Single process: the runtime
records its routing as a trace; the simulator replays it with the same budget (0.85x the
ceiling's peak) and the guard's own cost model. 4 processes: see the last test.
"""

import pytest

from spikeguard.sim.validate import compare_peaks, compare_pp_ep


@pytest.fixture(scope="module")
def peaks(tmp_path_factory):
    return compare_peaks(steps=2, folder=str(tmp_path_factory.mktemp("trace")))


@pytest.mark.parametrize("policy", ["none", "experts", "offload", "full", "adaptive"])
def test_predicted_peaks_within_10_percent_of_the_ledger(peaks, policy):
    row = peaks["policies"][policy]
    assert len(row["measured_peaks"]) == len(row["predicted_peaks"]) == 2
    for measured, predicted in zip(row["measured_peaks"], row["predicted_peaks"]):
        assert abs(predicted - measured) <= 0.10 * measured, (policy, measured, predicted)


def test_the_same_policies_crash(peaks):
    for policy, row in peaks["policies"].items():
        assert row["runtime_crashed"] == (row["sim_crashes"] > 0), policy
    assert peaks["policies"]["none"]["runtime_crashed"]   # 0.85x the ceiling cannot hold it
    budget = peaks["budget_bytes"]
    assert max(peaks["policies"]["adaptive"]["predicted_peaks"]) <= budget


@pytest.mark.timeout(400)
def test_pp2_ep2_four_processes_peaks_within_10_percent(tmp_path):
    """4 processes under torchrun (gloo): PP=2 x EP=2, production skew with frequent spikes,
    adaptive under 56 MB (about 0.9x what `none` reaches), so the planner really plans.
    The simulator replays the loads each rank logged."""
    out = compare_pp_ep(policies=(("adaptive", "56000000"),), steps=2, batch_size=4,
                        folder=str(tmp_path), timeout_s=300)
    row = out["policies"]["adaptive"]
    assert row["sim_crashes"] == 0
    assert any(d["offload"] + d["recompute"] for d in row["runtime_decisions"])
    for step_measured, step_predicted in zip(row["measured"], row["predicted"]):
        for measured, predicted in zip(step_measured, step_predicted):   # per stage
            assert abs(predicted - measured) <= 0.10 * measured, row


def test_adaptive_decides_as_the_runtime_did(peaks):
    """The simulator mirrors the decision window's inputs (walk.py); with the guard's own
    cost model (its ranking of plans) the same inputs must give the same plans."""
    row = peaks["policies"]["adaptive"]
    assert row["runtime_decisions"]["offload"] + row["runtime_decisions"]["recompute"] > 0
    assert row["sim_decisions_per_step"] == row["runtime_decisions"]
