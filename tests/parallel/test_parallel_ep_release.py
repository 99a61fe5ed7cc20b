"""The EP exchange lets go of its input when it returns, in forward and in backward.

gloo's work item keeps the exchange's tensors until its worker thread drops it, after the
wait has returned; a tensor nothing else held (the backward's contiguous gradient) was then
freed on that thread whenever it ran, and the emulated device's peak of a step moved from
step to step with the same data and plans (docs/oracle.md, EP). `expert_parallel.exchange`
returns once the backend holds no reference to the input: dropped by the caller, it is gone.

    .venv/bin/python -m pytest tests/parallel/test_parallel_ep_release.py -q
"""

from __future__ import annotations

import pytest
import torch

from spikeguard.parallel.launch_utils import run_spawned

import ep_workers

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]


def test_exchange_input_is_freed_when_dropped(tmp_path):
    world = 2
    run_spawned(ep_workers.exchange_release_worker, world, (str(tmp_path), 300),
                store_path=tmp_path / "store", timeout_s=150)
    for rank in range(world):
        found = torch.load(tmp_path / f"release_rank{rank}.pt", weights_only=False)
        assert found["right"], rank
        assert found["late"] == {"forward": 0, "backward": 0}, (rank, found["late"])
