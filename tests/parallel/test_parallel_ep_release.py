"""The EP exchange lets go of its input and its output when it returns, in forward and in
backward, and so does the dispatcher's flag point.

gloo's work item keeps the exchange's tensors until its worker thread drops it, after the
wait has returned; a tensor nothing else held (the backward's contiguous gradient) was then
freed on that thread whenever it ran, and the emulated device's peak of a step moved from
step to step with the same data and plans (docs/oracle.md, EP). `release.exchange`
returns once the backend holds no reference to the input: dropped by the caller, it is gone.
The work item keeps its output longer than its input (three references to it once
complete, torch 2.13), and the flag point's row was handed as it was: both were freed on
gloo's thread after the program dropped them (rows 1.9-2.6 MB of `small` at EP=2 in one
run of three; the flag point's 240 B in about one round of four), and a layer's entry
check on rank 1 saw them or not with the same data
(tests/runtime/test_runtime_entry_exchange.py failed in one CI run). The independent meter
(tests/meter.py) names every storage freed off the main thread: here 300 flag points and
600 exchanges a rank leave at most 2. A rarer late release is left, about 1 in 1,000
collectives of this case (an output whose use count was already the caller's alone when
the exchange returned: 1-2 in 7 of 12 rank-runs of 600 rounds; with the output unwaited
1 in 3 of 8, alike at these 2 KB rows). With the flag point's row handed as it was, 70
of 300 rounds freed it late; without the output's wait, `small`'s rows were freed late in
one run of three.

    .venv/bin/python -m pytest tests/parallel/test_parallel_ep_release.py -q
"""

from __future__ import annotations

import pytest
import torch

from spikeguard.parallel.launch_utils import run_spawned

import ep_workers

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]


def test_exchange_and_flag_point_tensors_are_freed_where_dropped(tmp_path):
    world = 2
    run_spawned(ep_workers.exchange_release_worker, world, (str(tmp_path), 300),
                store_path=tmp_path / "store", timeout_s=150)
    for rank in range(world):
        found = torch.load(tmp_path / f"release_rank{rank}.pt", weights_only=False)
        assert found["right"], rank
        assert found["late"] == {"forward": 0, "backward": 0}, (rank, found["late"])
        assert len(found["elsewhere"]) <= 2, (rank, found["elsewhere"][:8])
