"""Under expert parallelism the byte model is exact too: per layer and operator, what the
ledger measures on each rank equals the catalogue's prediction for the rows that rank's
experts received, plus the forecast's per-token reservation for what combine keeps after
the reverse all-to-all.

    .venv/bin/python -m pytest tests/parallel/test_parallel_ep_bytes.py -q
"""

from __future__ import annotations

import pytest
import torch

from spikeguard.parallel.launch_utils import run_spawned

import ep_workers

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]


def test_ep_bytes_per_op_are_predicted_exactly(tmp_path):
    world = 2
    run_spawned(ep_workers.bytes_worker, world, (str(tmp_path), 8, 8),
                store_path=tmp_path / "store", timeout_s=150)
    for rank in range(world):
        found = torch.load(tmp_path / f"bytes_rank{rank}.pt", weights_only=False)
        shape, tokens = found["shape"], found["tokens"]
        for layer in (0, 1):
            measured, received = found[layer]["bytes"], found[layer]["received"]
            predicted = shape.predict(received)
            for op in ("dispatch", "gate_up", "silu", "act", "down"):
                assert measured[op] == predicted[op], (rank, layer, op, measured, predicted)
            assert measured["combine"] == predicted["combine"] + found["combine_per_token"] * tokens, \
                (rank, layer, measured["combine"], predicted["combine"], found["combine_per_token"] * tokens)
