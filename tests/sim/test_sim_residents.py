"""The walk's memo key holds only the sums of what the older resident micro-batches hold
(sim/forward_memo.py `forward`): which of them an eviction takes is spread again over the
split at hand (sim/residents.py `spread`). Here `spread` is checked against the runtime's
own Residency.evict, through the walk's tracker, for many splits and request sequences,
and the reserve a forward reads from the walk's figures against Residency.reserve.

    .venv/bin/python -m pytest tests/sim/test_sim_residents.py -q
"""

from __future__ import annotations

import random

import pytest

from spikeguard.plan.residency import SchedulePosition
from spikeguard.sim.residents import ResidentTracker, relative, residency, spread


def _evicted_by_runtime(evictable: dict, older: tuple, requests: list) -> tuple:
    """`relative` after Residency.evict was asked `requests` bytes, one call each."""
    pos = SchedulePosition(forward=len(older), phase="steady", resident=len(older),
                           to_add=0, at_backward=0, older=older)
    res = residency([pos] * (len(older) + 1), len(older), {}, {})
    tracker = ResidentTracker(evictable)
    for n in requests:
        res.evict(tracker, n)
    return relative(res, tracker), sum(tracker.evicted.values())


@pytest.mark.parametrize("seed", range(200))
def test_spread_is_what_residency_evict_takes(seed):
    rng = random.Random(seed)
    first = rng.randrange(0, 4)
    older = tuple(range(first, first + rng.randrange(1, 9)))
    evictable = {o: rng.choice([0, 0, rng.randrange(1, 1000)]) for o in older}
    evictable[older[-1] + 1] = rng.randrange(1000)   # a live forward that is not older
    requests = [rng.randrange(1, 1500) for _ in range(rng.randrange(1, 5))]
    taken, total = _evicted_by_runtime(evictable, older, requests)
    assert spread(total, [evictable[o] for o in reversed(older)]) == taken


def test_a_remembered_forward_takes_from_the_split_at_hand():
    """Two forwards whose older resident micro-batches hold the same sums split
    differently: the second is the first's memo entry, its resident evictions spread over
    its own split, and equal to what a walker without the memo computes for it."""
    from spikeguard.sim.config import load_config
    from spikeguard.sim.engine import device_cost
    from spikeguard.sim.shape import build
    from spikeguard.sim.walk import StageWalker

    cfg = load_config("500b", overrides={"workload.steps": 2})
    dm = build(cfg)
    cost = device_cost(cfg, dm)

    def walker():
        return StageWalker(cfg, dm, dm.stages[0], "adaptive", cost)

    w = walker()
    k = next(i for i, p in enumerate(w.positions) if len(p.older) >= 3)
    older = w.positions[k].older
    counts = (int(dm.tokens * cfg.model.top_k * 1.5),) * len(dm.stages[0].chunks[0])
    per = int(w.capacity * 0.05)
    device = {o: per for o in older}

    def forward(wk, in_use, evictable):
        return wk.forward(0, counts, in_use, k, {}, device, None, 0, 0, evictable)

    # an in-use at which this forward evicts from the older resident micro-batches
    in_use = next((u for u in (int(w.capacity * (0.70 + i / 200)) for i in range(40))
                   if forward(walker(), u, dict(device)).resident_evictions), None)
    assert in_use is not None, "no forward here evicts older residents: pick another case"
    first = forward(w, in_use, dict(device))
    remembered = len(w._memo)
    taken = first.resident_freed
    newest, middle = older[-1], older[-2]
    split = {**device, newest: taken // 2, middle: device[middle] + per - taken // 2}
    second = forward(w, in_use, split)
    assert len(w._memo) == remembered             # looked up, not computed again
    assert second.resident_evictions != first.resident_evictions
    assert second == forward(walker(), in_use, split)


@pytest.mark.parametrize("seed", range(20))
def test_a_forward_reads_the_older_ones_once_as_the_runtime_would(seed):
    """`residency(..., older_bytes)` (the walk's figures, read for the memo key) reserves
    what the runtime's Residency.reserve reads from the host and device bytes itself, at
    every whole micro-batch and layer, asked in any order and again."""
    from spikeguard.plan.residency import Residency

    rng = random.Random(seed)
    older = tuple(range(rng.randrange(0, 3), rng.randrange(3, 9)))
    pos = SchedulePosition(forward=older[-1] + 1, phase="steady", resident=len(older),
                           to_add=rng.randrange(0, 4), at_backward=rng.randrange(0, 16),
                           older=older)
    positions = [pos] * (pos.forward + 1)
    device = {o: rng.randrange(0, 10**9) for o in older + (pos.forward + 5,)}
    host = {(o, layer): rng.randrange(1, 10**8) for o in older + (pos.forward + 5,)
            for layer in range(3) if rng.random() < 0.4}
    reload = max([n for (o, _), n in host.items() if o in older], default=0)
    walk = residency(positions, pos.forward, host, device,
                     (reload, sum(device[o] for o in older)))
    runtime = Residency(positions, micro_batch=lambda: pos.forward,
                        host_bytes=lambda: dict(host), device_bytes=lambda k: device.get(k, 0))
    for _ in range(30):
        layer, whole = rng.randrange(0, 6), rng.choice([0, 1, rng.randrange(1, 10**10)])
        assert tuple(walk.reserve(layer, whole)) == tuple(runtime.reserve(layer, whole))
