"""The oracle's plans under expert parallelism (spikeguard/bench/oracle_ep.py) run within the
budget the byte model solved them for, on 2 gloo ranks.

A layer's entry (attention, router, and under EP the dispatch exchange: the sent rows and
the received ones beside their regrouped copy) runs before its decision, so before any
eviction made there: it has to fit beside all the layer below keeps. Without that term in
plan/oracle.py's byte model, the oracle's plans ran out of memory in their first step
(`medium` at 0.70x, issue 24; here `tiny` with medium's narrow experts, at 0.7x and 0.6x,
where they ran out in micro-batch 1, layer 3 and micro-batch 0, layer 3). At 0.6x a second
term: the RNG state a recompute region kept (see the case's comment).

    .venv/bin/python -m pytest tests/bench/test_bench_oracle_ep.py -q
"""

from __future__ import annotations

import json

import pytest

from spikeguard.parallel.launch_utils import run_spawned

import oracle_ep_workers

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(300)]


# At 0.6x, with the cost rates frozen (as they now are), the oracle picks plans that
# recompute gate_up to act in most layers (offloading dispatch beside). They ran out in
# micro-batch 1, layer 3's entry, by 4 bytes on rank 0 (5,565,428 of 5,565,424), until the
# executor's recompute region stopped keeping the RNG state (spikeguard/runtime/executor.py:
# 5,056 bytes of torch.get_rng_state() per recomputed layer and micro-batch until its
# backward, counted by the emulated device, in no byte model; issue 24). Seen failing with
# the state kept again. With the rates timed on the machine the plans moved with the load.
@pytest.mark.parametrize("fraction", [0.7, 0.6])
def test_the_oracle_plans_fit_the_budget_they_were_solved_for(tmp_path, fraction):
    world = 2
    run_spawned(oracle_ep_workers.oracle_plans_worker, world, (str(tmp_path), fraction),
                store_path=tmp_path / "store", timeout_s=240)
    for rank in range(world):
        found = json.loads((tmp_path / f"oracle_rank{rank}.json").read_text())
        assert found["feasible"], (rank, found)
        # The budget binds: some layer's plan moves a tensor, or the oracle evicts. (Which
        # plans it picks moves with the in-use it solves from, gloo's rows held or not: a
        # CI run here at 0.6x picked one plan, recompute gate_up to act and offload
        # dispatch, in every layer, evicting nothing; earlier ones mixed two.) Checked
        # before the run's outcome, so that an oracle that cuts nothing fails here (seen,
        # with the solver returning all-save: the run then ran out of memory too).
        moved = [p for p in found["plans"] if "=rec" in p or "=off" in p]
        assert moved or found["evicted"] > 0, \
            ("a cut that changes nothing tests nothing", rank, found)
        assert found["error"] is None, (rank, found)
        assert found["peak"] <= found["budget"], (rank, found)
