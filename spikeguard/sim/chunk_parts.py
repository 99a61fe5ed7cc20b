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

    def evict(self, num_bytes: int, passed: list, index: int) -> int:
        """Move storages to host in save order, each no larger than what is still needed
        (runtime/hooks.py `SavedTensorTracker.evict` chooses alike); the larger ones met
        before the need is met go to `passed` as (bytes, `index`, op), for the evictor's
        last pick. The bytes moved."""
        freed, kept = 0, []
        for op, size in self.storages:
            if freed < num_bytes and size <= num_bytes - freed:
                self._to_host(op, size)
                freed += size
                continue
            if freed < num_bytes:
                passed.append((size, index, op))
            kept.append((op, size))
        if freed:
            self.storages = kept
        return freed

    def evict_one(self, op: str, size: int) -> int:
        """Move the first storage of `op` and `size` to host (the evictor's last pick)."""
        storages = list(self.storages)
        storages.remove((op, size))
        self.storages = storages
        self._to_host(op, size)
        return size

    def _to_host(self, op: str, size: int) -> None:
        if self.on_host is None:
            self.on_host = Counter()
        self.on_host[op] += size
        self.kept -= size
        self.evictable -= size


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
        """This micro-batch's layers, earliest first, each storage no larger than what is
        still needed, then the smallest one passed over; then older resident ones."""
        freed, passed = 0, []
        for j, layer in enumerate(self.layers):
            if freed >= num_bytes:
                break
            moved = layer.evict(num_bytes - freed, passed, j)
            freed += moved
            self.probes[:] = [self._moved_below(probe, j, moved) for probe in self.probes]
        if freed < num_bytes and passed:   # the smallest that covers the rest
            size, j, op = min(passed, key=lambda p: p[0])
            moved = self.layers[j].evict_one(op, size)
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
