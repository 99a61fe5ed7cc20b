"""The byte model's figures of one layer, remembered for the tokens of a micro-batch.

sim/device_bytes.py's `LayerBytes` is arithmetic on the shapes, pure, and the chunk walk
(sim/chunk.py) asks it the same questions again and again: a plan, a routed count, the
micro-batch's tokens (fixed for a run), on every stage, device and step. Asked afresh each
time, that arithmetic (dictionaries of per-operator bytes, the plan's recompute region, the
saved storages' list) was about a third of the adaptive walk's time on `1t`. Here each
answer is computed once by `LayerBytes` itself and looked up after; nothing is computed
differently. The tables are bounded (cleared past `_MEMO` entries, as LayerBytes' own
backward memo is).

Plans are looked up by identity (the planner's menu and the static policies' plans live
as long as the run); the plan itself is kept beside its figures, so an object that took a
dead plan's id is recomputed, never confused with it.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

from spikeguard.plan.catalogue import LayerPlan
from spikeguard.sim.device_bytes import LayerBytes

_MEMO = 1 << 16   # entries per table, at most


class Planned(NamedTuple):
    """A layer under a plan, for one routed count: what the chunk asks of LayerBytes."""

    kept: int                   # kept(plan, T, n)
    storages: tuple             # storages(plan, T, n), save order
    evictable: int              # their bytes
    at_decision: int            # at_decision(T, n)
    over_decision: int          # forward_over_decision(plan, T, n)


class Full(NamedTuple):
    """A layer recomputed whole, for one routed count."""

    kept: int                   # full_kept(T, n)
    forward_over: int           # full_forward_over(T, n)


class LayerFigures:
    """`LayerBytes` at `tokens`, remembered."""

    def __init__(self, lb: LayerBytes, tokens: int):
        self.lb, self.T = lb, tokens
        self.flow = lb.flow(tokens)
        self.layer_part = lb.layer_part(tokens)
        self._planned: dict = {}
        self._full: dict = {}
        self._at: dict = {}
        self._backward: dict = {}

    def planned(self, plan: LayerPlan, count: int) -> Planned:
        key = (id(plan), count)
        hit = self._planned.get(key)
        if hit is None or hit[0] is not plan:
            lb, T = self.lb, self.T
            storages = tuple(lb.storages(plan, T, count))
            hit = _put(self._planned, key, (plan, Planned(
                lb.kept(plan, T, count), storages, sum(n for _, n in storages),
                self.at_decision(count), lb.forward_over_decision(plan, T, count))))
        return hit[1]

    def full(self, count: int) -> Full:
        hit = self._full.get(count)
        if hit is None:
            hit = _put(self._full, count, Full(self.lb.full_kept(self.T, count),
                                               self.lb.full_forward_over(self.T, count)))
        return hit

    def at_decision(self, count: int) -> int:
        hit = self._at.get(count)
        if hit is None:
            hit = _put(self._at, count, self.lb.at_decision(self.T, count))
        return hit

    def backward_over(self, plan: Optional[LayerPlan], count: int, first: bool,
                      on_host) -> int:
        """The layer's backward peak above its start (`plan` None: recomputed whole);
        looked up only when nothing of it was evicted (`on_host` empty)."""
        lb, T = self.lb, self.T
        if plan is None:
            key = (None, count, first)
            hit = self._backward.get(key)
            if hit is None:
                hit = _put(self._backward, key, (None, lb.full_backward_over(T, count, first)))
            return hit[1]
        if on_host:
            return lb.backward_over(plan, T, count, first, on_host)
        key = (id(plan), count, first)
        hit = self._backward.get(key)
        if hit is None or hit[0] is not plan:
            hit = _put(self._backward, key, (plan, lb.backward_over(plan, T, count, first, on_host)))
        return hit[1]


def _put(table: dict, key, value):
    if len(table) >= _MEMO:
        table.clear()
    table[key] = value
    return value
