"""The pipeline residency as the simulator's walk reads it: the runtime's own objects.

The walk (spikeguard/sim/walk.py) hands the runtime's reading of a schedule
(plan/residency.py: positions, Residency) what it reads from torch's pipeline IR and what
the walk's resident micro-batches hold; a forward's chunk (sim/chunk.py) evicts older
resident micro-batches through the same Residency calls the runtime's window makes.
"""

from __future__ import annotations

from types import SimpleNamespace

from spikeguard.plan.residency import Reserve, Residency, positions, reserve_at


def positions_of(ops: list) -> list:
    """The runtime's own reading of a schedule (plan/residency.positions), fed
    the attributes it reads from torch's pipeline IR. All chunks of a stage count as one
    (under the interleaved schedule the unit resident is a micro-batch chunk)."""
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
        self.changes = 0   # evictions so far: what ForwardResidency's sum is valid for

    def evictable(self, micro_batch: int, before_layer: int) -> int:
        return self.left.get(micro_batch, 0)

    def evict(self, micro_batch: int, before_layer: int, num_bytes: int) -> int:
        take = min(num_bytes, self.left.get(micro_batch, 0))
        if take > 0:
            self.left[micro_batch] -= take
            self.changes += 1
            self.evicted[micro_batch] = self.evicted.get(micro_batch, 0) + take
        return max(take, 0)


def relative(residency, residents: ResidentTracker) -> tuple:
    """Evictions as (index among the older micro-batches, newest first, bytes)."""
    if not residents.evicted:
        return ()
    order = sorted(residency.position().older, reverse=True)
    return tuple((order.index(mb), n) for mb, n in residents.evicted.items())


def spread(num_bytes: int, evictable_newest_first: list) -> tuple:
    """`relative`'s figure for an eviction of `num_bytes` in all from the older resident
    micro-batches that can give `evictable_newest_first`: Residency.evict takes from the
    newest first, each as far as it can, however the bytes were asked for (one call or
    several), so the total alone says which ones give what."""
    out, left = [], num_bytes
    for index, n in enumerate(evictable_newest_first):
        if left <= 0:
            break
        take = min(left, n)
        if take > 0:
            out.append((index, take))
            left -= take
    return tuple(out)


def residency(schedule_positions, forward: int, host: dict, device: dict,
              older_bytes: tuple | None = None):
    """The runtime's Residency object, reading this walk's host and device bytes.
    `older_bytes`: (the older resident micro-batches' largest layer on host, their device
    bytes), where the walk has read them already (the figures `reserve` would read)."""
    out = ForwardResidency(schedule_positions, micro_batch=lambda: forward,
                           host_bytes=lambda: dict(host),
                           device_bytes=lambda k: device.get(k, 0))
    if older_bytes is not None:
        out.read_older(older_bytes)
    return out


def _reserves(pos, reload: int, device: int):
    """`ForwardResidency.reserve` at one forward's position and older bytes: `reserve_at`,
    remembered per whole micro-batch (a decision asks twice, uniform loads' layers alike)."""
    table: dict = {}

    def reserve(layer: int, whole_micro_batch_bytes: int) -> Reserve:
        hit = table.get(whole_micro_batch_bytes)
        if hit is None:
            hit = table[whole_micro_batch_bytes] = reserve_at(pos, whole_micro_batch_bytes,
                                                              reload, device)
        return hit
    return reserve


class ForwardResidency(Residency):
    """plan/residency.py's Residency as one forward of the walk consults it. What the
    older resident micro-batches hold, on host and device, does not change while one
    forward decides (the walk applies that forward's evictions after it returns), so
    `reserve` reads it once per forward, not at each of its three calls per layer (a
    fifth of the adaptive walk's time on `1t`), and keeps no log (the walk reads none).
    The arithmetic is the runtime's, `reserve_at`."""

    _older = None
    _order = None
    _evictable_of = None   # the tracker `_evictable` was summed over, at its `changes`
    _evictable_at = -1

    def position(self):
        """The forward's place in the schedule: fixed for this object's life."""
        if self._order is None:
            self._pos = super().position()
            self._order = ()   # set: the base _evict_order asks position() again
            self._order = super()._evict_order()
        return self._pos

    def _evict_order(self) -> list[int]:
        self.position()
        return self._order

    def read_older(self, older_bytes: tuple[int, int]) -> None:
        """The older ones' (largest layer on host, device bytes), as the walk read them:
        `reserve` reads nothing more, and is one table lookup per call from now on."""
        if self.position() is not None and self.enabled:
            self._older = older_bytes
            self.reserve = _reserves(self._pos, *older_bytes)

    def evictable(self, tracker) -> int:
        """The base's sum, again only after the tracker moved something (it is asked at
        every decision, over up to pp older micro-batches)."""
        if self._evictable_of is not tracker or self._evictable_at != tracker.changes:
            self._evictable = super().evictable(tracker)
            self._evictable_of, self._evictable_at = tracker, tracker.changes
        return self._evictable

    def reserve(self, layer: int, whole_micro_batch_bytes: int) -> Reserve:
        reserves = self.__dict__.get("_reserves")
        if reserves is not None and self.enabled:   # the same whole: uniform loads' layers
            hit = reserves.get(whole_micro_batch_bytes)
            if hit is not None:
                return hit
        pos = self.position()
        if pos is None or not self.enabled:
            return Reserve(0, 0)
        if self._older is None:
            older = set(pos.older)
            reload = max((n for (mb, _), n in self.host_bytes().items() if mb in older),
                         default=0)
            self._older = (reload, sum(self.device_bytes(mb) for mb in older))
            self._reserves = {}
        hit = self._reserves.get(whole_micro_batch_bytes)
        if hit is None:   # a decision asks twice (forward headroom, backward room)
            hit = self._reserves[whole_micro_batch_bytes] = reserve_at(
                pos, whole_micro_batch_bytes, *self._older)
        return hit
