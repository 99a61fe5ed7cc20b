"""The pieces of one simulated chunk forward (sim/chunk.py) that hold state as it goes: a
layer as its forward left it, the backward peaks the window predicted, and the evictor that
moves saved storages to host as runtime/hooks.py does.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Optional, Sequence

from spikeguard.plan.catalogue import LayerPlan


@dataclass
class Layer:
    """One layer of the chunk as its forward left it."""

    plan: Optional[LayerPlan]     # None: recomputed whole
    num_routed: int
    kept: int
    # (op, bytes) evictable, still on the device, save order: the layer figures' own
    # tuple until something is evicted (a list of its own then; most layers never are)
    storages: Sequence
    evictable: int                # their bytes
    # evicted bytes per op (None until something is: most layers never are)
    on_host: Optional[Counter] = None

    def evict(self, num_bytes: int) -> int:
        freed = 0
        if type(self.storages) is not list:
            self.storages = list(self.storages)
        while self.storages and freed < num_bytes:
            op, size = self.storages.pop(0)
            if self.on_host is None:
                self.on_host = Counter()
            self.on_host[op] += size
            freed += size
        self.kept -= freed
        self.evictable -= freed
        return freed


class BackwardPeaks:
    """The largest backward peak the window predicted for a micro-batch, and the largest
    excess of one over the in-use it was predicted at (runtime/window.py keeps the same
    pair per micro-batch, `_predicted_backward`): plan/decide.py's `note_backward`."""

    def __init__(self):
        self.peak = 0
        self.over = 0

    def note(self, backward: int, at: int) -> None:
        if backward > self.peak:   # max(), written out: once per layer decision
            self.peak = backward
        if backward - at > self.over:
            self.over = backward - at


class ChunkEvictor:
    """plan/decide.py's Evictor over the simulated chunk: this micro-batch's earlier layers
    first (each layer's storages in order), then older resident micro-batches. As the
    runtime's layer peaks do, the probes of the layers above an evicted one lose what it
    moved (runtime/layer_room.py `LayerPeaks.evicted`). Copy time is the caller's, from
    the bytes moved."""

    def __init__(self, layers: list, probes: list, residency, residents):
        self.layers, self.probes = layers, probes
        self.residency, self.residents = residency, residents
        self.deciding = 0   # the layer whose entry or decision evicts
        self.moved = 0   # bytes sent to host, from this micro-batch's layers and older ones
        self.resident_moved = 0   # of them, older resident micro-batches' bytes
        self._evictable_at: tuple = ()   # (layers, moved) `_evictable` was summed at
        self._evictable = 0

    def evictable(self) -> int:
        """Summed again only once a layer was added or something moved: a layer's bytes
        change only through `evict`, the older ones' only through the residency's `evict`
        from here (asked at every entry and decision, ~160k times on `1t`)."""
        at = (len(self.layers), self.moved)
        if self._evictable_at != at:
            own = sum([layer.evictable for layer in self.layers])
            self._evictable = own + self.residency.evictable(self.residents)
            self._evictable_at = at
        return self._evictable

    def _moved_below(self, probe: tuple, j: int, moved: int) -> tuple:
        """A probe once `moved` bytes of layer `j` went to host at layer `deciding`: the
        deciding layer's base drops (its expert path runs after); the layers' between only
        in backward (plan/layer_room.py `Probe.evicted_later`, `evicted_first`)."""
        p, rel, n, ev, later, first = probe
        if p <= j or not moved:
            return probe
        if p >= self.deciding:
            return p, rel - moved, n, ev, later, first + moved
        return p, rel, n, ev, later + moved, first

    def evict(self, num_bytes: int) -> int:
        freed = 0
        for j, layer in enumerate(self.layers):
            if freed >= num_bytes:
                break
            moved = layer.evict(num_bytes - freed)
            freed += moved
            self.probes[:] = [self._moved_below(probe, j, moved) for probe in self.probes]
        if freed < num_bytes:
            before = sum(self.residents.evicted.values())
            self.residency.evict(self.residents, num_bytes - freed)
            resident = sum(self.residents.evicted.values()) - before
            self.resident_moved += resident
            freed += resident
        self.moved += freed
        return freed
