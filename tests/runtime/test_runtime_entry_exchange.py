"""Under expert parallelism a layer's entry check counts the dispatch exchange's rows.

The built-in dispatcher holds the rows it sends and the rows it receives at once, beside
what the layer grows by up to its decision, and frees both before the decision: in no
growth the window measures. Without them in the entry check (plan/room.py
`entry_overflow`), adaptive ran out in the regrouping copy of the received rows and the
safety net re-ran the micro-batch (`medium`, EP=2, 0.7x: one re-run per rank every other
step; here `small` with top-4 narrow experts at 0.6x, every step). With them the layer
below makes the room at the entry (or the layer is recomputed whole), and no step re-runs.

    .venv/bin/python -m pytest tests/runtime/test_runtime_entry_exchange.py -q
"""

from __future__ import annotations

import json

import pytest

from spikeguard.parallel.launch_utils import run_spawned

import entry_exchange_workers

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(300)]


def test_adaptive_makes_room_for_the_dispatch_exchange_at_the_entry(tmp_path):
    world, steps = 2, 2
    run_spawned(entry_exchange_workers.adaptive_steps_worker, world, (str(tmp_path), 0.6, steps),
                store_path=tmp_path / "store", timeout_s=240)
    for rank in range(world):
        records = json.loads((tmp_path / f"steps_rank{rank}.json").read_text())
        assert len(records) == steps, (rank, records)
        for record in records:
            assert record["safety_net_reruns"] == 0, (rank, record)
            assert record["peak_bytes"] <= record["budget_bytes"], (rank, record)
            assert record["evicted_bytes"] > 0 and record["decisions"]["offload"] > 0, \
                ("a cut that changes nothing tests nothing", rank, record)
