"""The simulator against the runtime's ledger on the `small` model (CPU, emulated device).

Issue 7: predicted per-step peak bytes within 10% of what the runtime measures over the
same trace, single process. The runtime records its routing as a trace; the simulator
replays it with the same budget (0.85x the ceiling's peak) and the guard's own cost model.
"""

import pytest

from spikeguard.sim.validate import compare_peaks


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
