"""The oracle's plans under expert parallelism (spikeguard/bench/oracle_ep.py) run within the
budget the byte model solved them for, on 2 gloo ranks.

A layer's entry (attention, router, and under EP the dispatch exchange: the sent rows and
the received ones beside their regrouped copy) runs before its decision, so before any
eviction made there: it has to fit beside all the layer below keeps. Without that term in
plan/oracle.py's byte model, the oracle's plans ran out of memory in their first step
(`medium` at 0.70x, issue 24; here `tiny` with medium's narrow experts, at 0.7x and 0.6x,
where they ran out in micro-batch 1, layer 3 and micro-batch 0, layer 3).

    .venv/bin/python -m pytest tests/bench/test_bench_oracle_ep.py -q
"""

from __future__ import annotations

import json

import pytest

from spikeguard.parallel.launch_utils import run_spawned

import oracle_ep_workers

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(300)]


# At 0.6x, with the cost rates frozen (as they now are), the oracle picks plans that
# offload dispatch beside recompute, and they still run out in micro-batch 1, layer 3's
# forward (5.31 MiB asked of 5.31): a second gap of the byte model, for those plans, not
# traced yet (issue 24). With the rates timed on the machine the plans moved with the
# load, and this case passed or failed with them.
@pytest.mark.parametrize("fraction", [0.7, pytest.param(0.6, marks=pytest.mark.xfail(
    strict=True, reason="the oracle's byte model under-predicts plans offloading dispatch "
                        "beside recompute at 0.6x (issue 24)"))])
def test_the_oracle_plans_fit_the_budget_they_were_solved_for(tmp_path, fraction):
    world = 2
    run_spawned(oracle_ep_workers.oracle_plans_worker, world, (str(tmp_path), fraction),
                store_path=tmp_path / "store", timeout_s=240)
    for rank in range(world):
        found = json.loads((tmp_path / f"oracle_rank{rank}.json").read_text())
        assert found["feasible"], (rank, found)
        assert found["error"] is None, (rank, found)
        assert found["peak"] <= found["budget"], (rank, found)
        assert len(found["plans"]) > 1 and found["evicted"] > 0, \
            ("a cut that changes nothing tests nothing", rank, found)
