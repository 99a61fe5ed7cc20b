"""The planner: one decision per MoE layer per micro-batch, in the window after routing.

Given the exact routed token count of this layer, pick the plan of least added time that
fits twice:
  * forward: the bytes it keeps on the device fit the headroom (budget, minus bytes in
    use, minus what is still to come in this micro-batch);
  * backward: when this layer's offloaded tensors come back (and the layer below is
    prefetched while this layer's attention part is still alive), the device holds what
    it holds now plus the plan's kept and reloaded bytes: that must fit `backward_room`.
If even the smallest plan does not fit, ask for the shortfall to be evicted from earlier
layers of the same micro-batch; if that cannot cover it either, raise with the figure.
The runtime, the benchmark and the simulator all call this.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from spikeguard.errors import BudgetInfeasible
from spikeguard.memory.budget import format_bytes
from spikeguard.plan.catalogue import OPS, Action, ExpertShape, LayerPlan, valid_plans
from spikeguard.plan.cost import CostModel
from spikeguard.plan.frozen import quick_init


@quick_init
@dataclass(frozen=True)
class Decision:
    plan: LayerPlan
    device_bytes: int     # what this layer's expert path will keep on the device
    added_s: float        # predicted time the plan adds
    evict_bytes: int = 0  # to offload from earlier layers first


@dataclass(frozen=True)
class Ranked:
    """One plan with its per-token figures (all linear in the routed token count)."""

    s_per_token: float
    device_bytes_per_token: int
    offload_bytes_per_token: int
    plan: LayerPlan


class Planner:
    """Chooses among the valid plans of one layer; pure arithmetic, microseconds.

    Bytes and seconds are both linear in the routed tokens, so the ranking of plans by
    added time does not depend on the count: it is computed at most once per micro-batch
    (`refresh` marks it stale, picking up the cost model's online corrections), and a
    decision walks it to the first plan whose bytes fit. The first plan of any ranking is
    the one that keeps everything (it adds no time and keeps the most): when it fits, as on
    every calm step, the decision needs no ranking at all.
    """

    def __init__(self, shape: ExpertShape, cost: CostModel):
        self.shape = shape
        self.cost = cost
        self.menu = valid_plans()
        self._per_token = shape.bytes_per_token()
        self.min_bytes_per_token = min(self.device_bytes_per_token(p) for p in self.menu)
        self._ranked: list[Ranked] = []
        self._stale = True
        self._per_plan: dict[LayerPlan, tuple[int, int, tuple[str, ...]]] = {}

    def device_bytes_per_token(self, plan: LayerPlan) -> int:
        return self._per_token["combine"] + sum(
            self._per_token[op] for op, a in zip(OPS, plan.actions) if a is Action.SAVE)

    def offload_bytes_per_token(self, plan: LayerPlan) -> int:
        return sum(self._per_token[op] for op, a in zip(OPS, plan.actions) if a is Action.OFFLOAD)

    def layer_bytes(self, plan: LayerPlan) -> tuple[int, int]:
        """(device, offloaded) bytes a plan keeps whatever the routed count: 0 for the
        built-in expert path; an adapter whose experts save per-layer constants (a
        low-precision copy of the weights, say) overrides it."""
        return 0, 0

    def refresh(self) -> None:
        """The cost model may have moved: rank again before the next decision that needs it."""
        self._stale = True

    def _rank(self) -> None:
        """Rank the plans by added seconds per token with the cost model as it is now;
        among equally cheap plans, the one keeping the most first (fewest round trips).
        What is fixed per plan (bytes, recomputed stages) is computed once, so this is a
        few additions per plan."""
        stage_s = self.cost.stage_s_per_token
        ranked = []
        for p in self.menu:
            device, offload, stages = self._fixed_per_plan(p)
            s = sum(stage_s[x] for x in stages) + self.cost.offload_s_for_bytes(offload)
            ranked.append(Ranked(s, device, offload, p))
        self._ranked = sorted(ranked, key=lambda r: (r.s_per_token, -r.device_bytes_per_token))
        self._stale = False

    def _fixed_per_plan(self, plan: LayerPlan) -> tuple[int, int, tuple[str, ...]]:
        hit = self._per_plan.get(plan)   # one hash of the plan, not two (every decision)
        if hit is None:
            hit = self._per_plan[plan] = (self.device_bytes_per_token(plan),
                                          self.offload_bytes_per_token(plan),
                                          self.cost.recompute_stages(plan))
        return hit

    def ranked(self) -> list[Ranked]:
        if self._stale:
            self._rank()
        return self._ranked

    def _keep_all(self) -> tuple[Optional[LayerPlan], int]:
        """The menu's plan that neither recomputes nor offloads (first in every ranking),
        and its device bytes per token (`_fixed_per_plan`'s); found once per menu (an
        adapter may set its own menu after `__init__`), not at every decision, which then
        hashes no plan (a plan's hash is its five enums' Python-level hashes)."""
        found = self.__dict__.get("_keep_all_of")
        if found is None or found[0] is not self.menu:
            plan = next((p for p in self.menu if not any(
                a is not Action.SAVE for a in p.actions)), None)
            found = self._keep_all_of = (self.menu, plan,
                                         self._fixed_per_plan(plan)[0] if plan else 0)
        return found[1], found[2]

    def added_s(self, plan: LayerPlan, num_routed: int) -> float:
        return num_routed * (self.cost.recompute_s_per_token(plan)
                             + self.cost.offload_s_per_token(plan, self.shape))

    def decide(self, num_routed: int, headroom_bytes: int, evictable_bytes: int = 0,
               backward_room: Optional[int] = None, deferrable_bytes: int = 0) -> Decision:
        """Least added time within `headroom_bytes` (and `backward_room`, when given);
        evicts or raises when nothing fits. `deferrable_bytes`: of a forward shortfall,
        what only the rest of the micro-batch needs and its later layers will be able to
        move then (the decision evicts only the rest now)."""
        # `_keep_all` and `_fits` written out, and no `layer_bytes` call where it is this
        # class's (0, 0) (the simulator's `1t` makes 140k decisions a run, walking ~9 plans
        # of the ranking in each); `_infeasible` holds what runs only when nothing fits
        found = self.__dict__.get("_keep_all_of")
        if found is None or found[0] is not self.menu:
            self._keep_all()
            found = self._keep_all_of
        keep_all = found[1]
        plain = type(self).layer_bytes is Planner.layer_bytes and "layer_bytes" not in self.__dict__
        if keep_all is not None:
            need = found[2] * num_routed + (0 if plain else self.layer_bytes(keep_all)[0])
            if need <= headroom_bytes and (backward_room is None or need <= backward_room):
                return Decision(keep_all, need, 0.0)
        if plain:
            for r in self.ranked():
                need = r.device_bytes_per_token * num_routed   # this class's fixed bytes: 0
                if need <= headroom_bytes and (backward_room is None or need
                                               + r.offload_bytes_per_token * num_routed
                                               <= backward_room):
                    return Decision(r.plan, need, r.s_per_token * num_routed)
        else:
            layer_bytes = self.layer_bytes
            for r in self.ranked():
                fixed_device, fixed_offload = layer_bytes(r.plan)
                need = r.device_bytes_per_token * num_routed + fixed_device
                if need <= headroom_bytes and (backward_room is None or need + fixed_offload
                                               + r.offload_bytes_per_token * num_routed
                                               <= backward_room):
                    return Decision(r.plan, need, r.s_per_token * num_routed)
        return self._infeasible(num_routed, headroom_bytes, evictable_bytes, backward_room,
                                deferrable_bytes)

    def _infeasible(self, num_routed: int, headroom_bytes: int, evictable_bytes: int,
                    backward_room: Optional[int], deferrable_bytes: int) -> Decision:
        """`decide` where no plan fits as it is: take the plan with the smallest shortfall
        over both passes, and evict that much from earlier layers (evicted bytes leave the
        device in both); raise when even that cannot cover it."""
        def shortfalls(r: Ranked) -> tuple[int, int]:
            fixed_device, fixed_offload = self.layer_bytes(r.plan)
            need = r.device_bytes_per_token * num_routed + fixed_device
            backward = (need + r.offload_bytes_per_token * num_routed + fixed_offload
                        - backward_room) if backward_room is not None else 0
            return need - headroom_bytes, backward

        smallest = min(self.ranked(), key=lambda r: (max(shortfalls(r)), r.s_per_token))
        need = smallest.device_bytes_per_token * num_routed + self.layer_bytes(smallest.plan)[0]
        forward, backward = shortfalls(smallest)
        now = max(forward - deferrable_bytes, backward)
        if now <= evictable_bytes:
            return Decision(smallest.plan, need, smallest.s_per_token * num_routed, max(0, now))
        room = f"forward headroom {format_bytes(headroom_bytes)}"
        if backward_room is not None:
            room += f", backward room {format_bytes(backward_room)}"
        raise BudgetInfeasible(
            f"no plan fits: the least this layer's expert path can keep on the device is "
            f"{format_bytes(need)} ({format_bytes(smallest.offload_bytes_per_token * num_routed)} "
            f"more come back from host in backward), {format_bytes(now - evictable_bytes)} "
            f"more than the room left after evicting earlier layers ({room})",
            needed_bytes=now - evictable_bytes)

    def _fits(self, r: Ranked, num_routed: int, headroom_bytes: int,
              backward_room: Optional[int]) -> Optional[int]:
        """The device bytes plan `r` keeps for `num_routed` copies, if it fits both passes
        as they are (no eviction); else None."""
        fixed_device, fixed_offload = self.layer_bytes(r.plan)
        need = r.device_bytes_per_token * num_routed + fixed_device
        if need > headroom_bytes:
            return None
        if backward_room is not None and \
                need + r.offload_bytes_per_token * num_routed + fixed_offload > backward_room:
            return None
        return need

    def fits(self, num_routed: int, headroom_bytes: int, backward_room: Optional[int]) -> bool:
        """Whether some plan of the menu fits as it is, with no eviction: `decide`'s own
        test, without the ranking's choice (the hookless proof asks it of later layers).
        Keeping everything first, as `decide` does: on a calm step it fits. Where it does
        not, the menu's plans in menu order: whether one fits needs their bytes, never
        their seconds, so no ranking is made (the cost model moves every step, so a
        ranking is a fresh sort: a pipeline's start proofs, walking later forwards at the
        most each layer routed lately, made one or two a calm step: 1% of its CPU)."""
        keep_all, keep_all_per_token = self._keep_all()
        if keep_all is not None:
            need = keep_all_per_token * num_routed + self.layer_bytes(keep_all)[0]
            if need <= headroom_bytes and (backward_room is None or need <= backward_room):
                return True
        return any(self._fits(r, num_routed, headroom_bytes, backward_room) is not None
                   for r in self._unranked())

    def _unranked(self) -> list[Ranked]:
        """The menu's plans with their bytes per token, in menu order (no seconds: 0.0),
        built once per menu."""
        found = self.__dict__.get("_unranked_of")
        if found is None or found[0] is not self.menu:
            found = self._unranked_of = (self.menu, [
                Ranked(0.0, *self._fixed_per_plan(p)[:2], p) for p in self.menu])
        return found[1]

    def whole_recompute_s(self, num_routed: int) -> float:
        """The seconds of recomputing every stage of the expert path for `num_routed`
        copies: the least a layer recomputed whole (attention too) costs. The largest
        per-token figure is found once per ranking and stage rates (the cost model may move
        between rankings), not at every call: the simulator asks it a million times."""
        ranked, cost = self.ranked(), self.cost
        rates = tuple(cost.stage_s_per_token.items())
        hit = self.__dict__.get("_whole_of")
        if hit is None or hit[0] is not ranked or hit[1] is not cost or hit[2] != rates:
            hit = self._whole_of = (ranked, cost, rates,
                                    max(cost.recompute_s_per_token(r.plan) for r in ranked))
        return num_routed * hit[3]

    def least(self, num_routed: int) -> Decision:
        """The plan keeping the least on the device (when nothing fits and the forward must
        still finish, as on an expert-parallel rank)."""
        r = min(self.ranked(), key=lambda r: (r.device_bytes_per_token, r.s_per_token))
        return Decision(r.plan, r.device_bytes_per_token * num_routed + self.layer_bytes(r.plan)[0],
                        r.s_per_token * num_routed)

    def fixed(self, plan: LayerPlan, num_routed: int) -> Decision:
        """A static policy's decision, with the same bookkeeping (every layer of a static
        policy asks: the per-plan part is `_fixed_per_plan`'s, and a plan that neither
        recomputes nor offloads adds no time)."""
        device, offload, stages = self._fixed_per_plan(plan)
        added = self.added_s(plan, num_routed) if offload or stages else 0.0
        return Decision(plan, device * num_routed + self.layer_bytes(plan)[0], added)
