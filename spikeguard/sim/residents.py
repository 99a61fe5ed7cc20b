"""The pipeline residency as the simulator's walk reads it: the runtime's own objects.

The walk (spikeguard/sim/walk.py) hands the runtime's reading of a schedule
(plan/residency.py: positions, Residency) what it reads from torch's pipeline IR and what
the walk's resident micro-batches hold; a forward's chunk (sim/chunk.py) evicts older
resident micro-batches through the same Residency calls the runtime's window makes.
"""

from __future__ import annotations

from types import SimpleNamespace


def positions_of(ops: list) -> list:
    """The runtime's own reading of a schedule (plan/residency.positions), fed
    the attributes it reads from torch's pipeline IR. All chunks of a stage count as one
    (under the interleaved schedule the unit resident is a micro-batch chunk)."""
    from spikeguard.plan.residency import positions

    actions = [SimpleNamespace(computation_type=SimpleNamespace(value=op.kind), stage_index=0)
               for op in ops]
    return positions(actions, 0)


class ResidentTracker:
    """The two tracker calls Residency.evictable/evict make (runtime/hooks.py's
    SavedTensorTracker), over what the walk's resident micro-batches could send to host
    (their saved storages of 16 KiB or more)."""

    def __init__(self, evictable: dict):
        self.left = dict(evictable)
        self.evicted: dict = {}

    def evictable(self, micro_batch: int, before_layer: int) -> int:
        return self.left.get(micro_batch, 0)

    def evict(self, micro_batch: int, before_layer: int, num_bytes: int) -> int:
        take = min(num_bytes, self.left.get(micro_batch, 0))
        if take > 0:
            self.left[micro_batch] -= take
            self.evicted[micro_batch] = self.evicted.get(micro_batch, 0) + take
        return max(take, 0)


def relative(residency, residents: ResidentTracker) -> tuple:
    """Evictions as (index among the older micro-batches, newest first, bytes)."""
    if not residents.evicted:
        return ()
    order = sorted(residency.position().older, reverse=True)
    return tuple((order.index(mb), n) for mb, n in residents.evicted.items())


def residency(schedule_positions, forward: int, host: dict, device: dict):
    """The runtime's Residency object, reading this walk's host and device bytes."""
    from spikeguard.plan.residency import Residency

    return Residency(schedule_positions, micro_batch=lambda: forward,
                     host_bytes=lambda: dict(host), device_bytes=lambda k: device.get(k, 0))
