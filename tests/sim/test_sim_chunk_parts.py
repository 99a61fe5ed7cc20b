"""The simulated chunk's evictor (sim/chunk_parts.py `ChunkEvictor`) sums what could go to
host again only after a layer was added or something moved: here its answer is checked
against the sum made afresh (the layers', and the runtime's Residency.evictable over the
older resident micro-batches) after every step of random chunks.

    .venv/bin/python -m pytest tests/sim/test_sim_chunk_parts.py -q
"""

from __future__ import annotations

import random

import pytest

from spikeguard.plan.residency import Residency, SchedulePosition
from spikeguard.sim.chunk_parts import ChunkEvictor, Layer
from spikeguard.sim.residents import ResidentTracker, residency


def _fresh(evictor: ChunkEvictor, res, tracker: ResidentTracker) -> int:
    return sum(layer.evictable for layer in evictor.layers) + Residency.evictable(res, tracker)


@pytest.mark.parametrize("seed", range(60))
def test_the_evictable_sum_follows_appends_and_evictions(seed):
    rng = random.Random(seed)
    older = tuple(range(rng.randrange(0, 5)))
    pos = SchedulePosition(forward=len(older), phase="steady", resident=len(older),
                           to_add=0, at_backward=0, older=older)
    res = residency([pos] * (len(older) + 1), len(older), {}, {})
    tracker = ResidentTracker({o: rng.choice([0, rng.randrange(1, 5000)]) for o in older})
    layers: list = []
    evictor = ChunkEvictor(layers, [], res, tracker)
    for step in range(30):
        assert evictor.evictable() == _fresh(evictor, res, tracker)
        if rng.random() < 0.4:
            storages = tuple(("op%d" % j, rng.randrange(1, 900)) for j in range(rng.randrange(4)))
            size = sum(n for _, n in storages)
            layers.append(Layer(None, 1, size + rng.randrange(100), storages, size))
        else:
            evictor.deciding = len(layers)
            evictor.evict(rng.choice([0, rng.randrange(1, 3000)]))
    assert evictor.evictable() == _fresh(evictor, res, tracker)
