"""Pipeline layout arithmetic, without processes: the schedule's residency read from its
action list, the (pp, dp, ep) coordinates of a rank, the layer cut, the layout checks.

    .venv/bin/python -m pytest tests/parallel/test_parallel_pp_layout.py -q
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from spikeguard.errors import UsageError
from spikeguard.parallel.mesh import ParallelLayout
from spikeguard.plan.residency import Residency, positions
from spikeguard.parallel.pipeline_stages import layer_split


def _actions(ops: str, stage: int = 0) -> list:
    """'FFBFB..' -> IR-like actions of one stage; None entries are bubbles."""
    kind = {"F": "F", "B": "B", "I": "I", "W": "W"}
    return [None] + [SimpleNamespace(stage_index=stage,
                                     computation_type=SimpleNamespace(value=kind[c]))
                     for c in ops]


def _view(ops: str) -> list:
    return [(p.phase, p.resident, p.to_add, p.at_backward, p.older)
            for p in positions(_actions(ops), 0)]


def test_1f1b_stage_0_of_2_keeps_two_resident():
    assert _view("FFBFBFBB") == [("warmup", 0, 1, 1, ()), ("warmup", 1, 0, 1, (0,)),
                                 ("steady", 1, 0, 1, (1,)), ("steady", 1, 0, 0, (2,))]


def test_1f1b_stage_0_of_3_warms_up_with_three():
    view = _view("FFFBFBBB")
    assert [v[2] for v in view] == [2, 1, 0, 0]          # to_add: the warm-up still to come
    assert [v[3] for v in view] == [2, 2, 1, 0]          # resident at its own backward
    assert view[2][4] == (0, 1)                          # older resident, backward first


def test_last_stage_never_holds_two():
    assert all(v[1:4] == (0, 0, 0) for v in _view("FBFBFBFB"))


def test_other_stages_and_split_backward_are_read_right():
    acts = _actions("FIFW") + _actions("FFBB", stage=1)
    assert [(p.resident, p.to_add) for p in positions(acts, 0)] == [(0, 0), (0, 0)]
    assert [(p.resident, p.to_add) for p in positions(acts, 1)] == [(0, 1), (1, 0)]


def test_residency_reserves_whole_micro_batches_and_logs_once_per_layer():
    current = {"mb": 0}
    r = Residency(positions(_actions("FFFBFBBB"), 0), micro_batch=lambda: current["mb"],
                  host_bytes=lambda: {(0, 1): 300, (0, 0): 100, (5, 0): 999},
                  device_bytes=lambda mb: 1000)
    assert r.reserve(0, 50) == (100, 100)
    r.reserve(0, 50)
    current["mb"] = 2   # mb 0 and 1 resident; mb 0's largest host layer comes back first
    # both older ones are freed before its backward
    assert r.reserve(0, 50) == (300, 50 - 2000)
    assert [(e["micro_batch"], e["to_add"]) for e in r.log] == [(0, 2), (2, 0)]
    r.enabled = False
    assert r.reserve(1, 50) == (0, 0)


class _Tracker:
    """Stands in for SavedTensorTracker: evictable bytes per micro-batch, evictions seen."""

    def __init__(self, evictable: dict):
        self.left, self.calls = dict(evictable), []

    def evictable(self, mb, before_layer):
        return self.left.get(mb, 0)

    def evict(self, mb, before_layer, num_bytes):
        freed = min(num_bytes, self.left.get(mb, 0))
        self.left[mb] = self.left.get(mb, 0) - freed
        self.calls.append((mb, freed))
        return freed


def test_resident_micro_batches_are_evicted_newest_first():
    """At stage 0 of 3's third forward, micro-batches 0 and 1 are resident: 1's backward
    comes after 0's, so its tensors go to the host first."""
    r = Residency(positions(_actions("FFFBFBBB"), 0), micro_batch=lambda: 2)
    tracker = _Tracker({0: 100, 1: 30, 2: 999})
    assert r.evictable(tracker) == 130          # the micro-batch in flight is not counted
    r.reserve(0, 10)
    assert r.evict(tracker, 50) == 50
    assert tracker.calls == [(1, 30), (0, 20)]
    assert r.log[-1]["evicted_resident_bytes"] == 50
    r.enabled = False
    assert r.evictable(tracker) == 0


def test_mesh_coordinates_put_ep_peers_next_to_each_other():
    layout = ParallelLayout(8, pp=2, ep=2)
    assert layout.dp == 2
    assert [layout.coords(r) for r in range(8)] == [
        (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1)]


@pytest.mark.parametrize("layout,kwargs,match", [
    (ParallelLayout(6, pp=4), {}, "must divide the number of processes"),
    (ParallelLayout(4, pp=2, ep=2), {"num_experts": 7}, "divide the number of experts"),
    (ParallelLayout(3, pp=3), {}, "3 pipeline stages must divide the 4 layers"),
    (ParallelLayout(2, pp=2), {"stages_per_rank": 4}, "8 pipeline stages"),
    (ParallelLayout(2, pp=2), {"micro_batches": 3}, "multiple of --pp"),
    (ParallelLayout(0, pp=2), {}, "positive"),
])
def test_layout_mistakes_are_usage_errors(layout, kwargs, match):
    args = {"num_layers": 4, "num_experts": 8, "micro_batches": 4, **kwargs}
    with pytest.raises(UsageError, match=match):
        layout.check(**args)


def test_layers_are_cut_evenly():
    assert layer_split(4, 2) == [(0, 2), (2, 4)]
    with pytest.raises(UsageError, match="3 pipeline stages must divide the 4 layers"):
        layer_split(4, 3)
