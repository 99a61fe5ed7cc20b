"""What spikeguard hands gloo under transformers' and torchtitan's EP is freed on the main
thread.

gloo's work item holds a collective's tensors until its worker thread drops it, after the
wait has returned; a tensor nothing else held was freed on that thread whenever it ran,
and a step's peak moved with the same data (spikeguard.parallel.release). Each collective
spikeguard makes there (the flag points' all-gathers, the settlement's zero counts and
rows, the replay of a backward span, transformers' combine, handed a view, and a token
exchange as torchtitan's dispatcher makes it, the functional all-to-all whose output is
returned unwaited) returns once gloo let go: counted here by the storages freed off the
main thread after the call returned. The combine and the torchtitan exchange run (their
sums are checked) but their counts are not asserted: the rows they receive go with the
same work item as their input, in an order the input's let-go does not fix (CI here: 1
late in 300 rounds with the release on, 2 with it off; the torchtitan kind 0-1 on, 4
off). The torchtitan exchange is asserted otherwise: through `released` it returns with
the rows handed in let go of by gloo, at once (its output is the functional all-to-all's,
unwaited, and only a wait ends its work item).

    .venv/bin/python -m pytest tests/parallel/test_parallel_release.py -q
"""

from __future__ import annotations

import pytest
import torch

from spikeguard.parallel.launch_utils import run_spawned

import release_workers

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]


def test_what_spikeguard_hands_gloo_is_freed_on_the_main_thread(tmp_path):
    world = 2
    run_spawned(release_workers.release_worker, world, (str(tmp_path), 300),
                store_path=tmp_path / "store", timeout_s=150)
    for rank in range(world):
        found = torch.load(tmp_path / f"release_rank{rank}.pt", weights_only=False)
        assert found["right"], rank
        assert found["ops"] == 3, (rank, found)
        late = {kind: n for kind, n in found["late"].items()
                if kind not in ("combine", "titan_exchange")}
        assert late == dict.fromkeys(late, 0), (rank, found["late"])
        # torchtitan's exchange through `released` returns with the rows handed in let go
        # of, at once (its unwaited output waited first: without that the let-go would
        # wait its 10 s for a work item that only a wait ends)
        assert found["held"]["held"] == 0 and found["held"]["slowest_s"] < 5, (rank, found)

