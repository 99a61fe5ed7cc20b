"""The planner: one decision per MoE layer per micro-batch, in the window after routing.

Given the exact routed token count of this layer and the headroom left for it (budget,
minus bytes in use, minus what is still to come), pick the plan of least added time whose
device bytes fit. If even the smallest plan does not fit, ask for the shortfall to be
evicted from earlier layers of the same micro-batch; if that cannot cover it either, say
what budget would work. The runtime, the benchmark and the simulator all call this.
"""

from __future__ import annotations

from dataclasses import dataclass

from spikeguard.errors import BudgetInfeasible
from spikeguard.memory.budget import format_bytes
from spikeguard.plan.catalogue import OPS, Action, ExpertShape, LayerPlan, valid_plans
from spikeguard.plan.cost import CostModel


@dataclass(frozen=True)
class Decision:
    plan: LayerPlan
    device_bytes: int     # what this layer's expert path will keep on the device
    added_s: float        # predicted time the plan adds
    evict_bytes: int = 0  # to offload from earlier layers first


@dataclass(frozen=True)
class _MenuItem:
    plan: LayerPlan
    device_bytes_per_token: int


class Planner:
    """Chooses among the valid plans of one layer; pure arithmetic, microseconds.

    Bytes and seconds are both linear in the routed tokens, so the ranking of plans by
    added time does not depend on the count: it is computed once per micro-batch
    (`refresh`, which picks up the cost model's online corrections), and a decision walks
    it to the first plan whose bytes fit.
    """

    def __init__(self, shape: ExpertShape, cost: CostModel):
        self.shape = shape
        self.cost = cost
        per_token = shape.bytes_per_token()
        self.menu = sorted(
            (_MenuItem(p, per_token["combine"] + sum(
                per_token[op] for op, a in zip(OPS, p.actions) if a is Action.SAVE))
             for p in valid_plans()),
            key=lambda m: -m.device_bytes_per_token)
        self.min_bytes_per_token = min(m.device_bytes_per_token for m in self.menu)
        self._ranked: list[tuple[float, int, LayerPlan]] = []
        self._smallest: tuple[float, int, LayerPlan] = (0.0, 0, self.menu[-1].plan)
        self.refresh()

    def refresh(self) -> None:
        """Rank the plans by added seconds per token with the cost model as it is now;
        among equally cheap plans, the one keeping the most first (fewest round trips)."""
        self._ranked = sorted(
            ((self.added_s(m.plan, 1), m.device_bytes_per_token, m.plan) for m in self.menu),
            key=lambda r: (r[0], -r[1]))
        self._smallest = min(self._ranked, key=lambda r: (r[1], r[0]))

    def ranked(self) -> list[tuple[float, int, LayerPlan]]:
        return self._ranked

    def added_s(self, plan: LayerPlan, num_routed: int) -> float:
        return num_routed * (self.cost.recompute_s_per_token(plan)
                             + self.cost.offload_s_per_token(plan, self.shape))

    def decide(self, num_routed: int, headroom_bytes: int, evictable_bytes: int = 0) -> Decision:
        """Least added time within `headroom_bytes`; evicts or raises when nothing fits."""
        for s_per_token, bytes_per_token, plan in self.ranked():
            need = bytes_per_token * num_routed
            if need <= headroom_bytes:
                return Decision(plan, need, s_per_token * num_routed)
        s_per_token, bytes_per_token, plan = self._smallest
        need = bytes_per_token * num_routed
        shortfall = need - headroom_bytes
        if shortfall <= evictable_bytes:
            return Decision(plan, need, s_per_token * num_routed, shortfall)
        raise BudgetInfeasible(
            f"no plan fits: this layer needs at least {format_bytes(need)} with its expert path "
            f"recomputed or offloaded, {format_bytes(shortfall - evictable_bytes)} more than the "
            f"headroom left after evicting earlier layers",
            needed_bytes=shortfall - evictable_bytes)

    def fixed(self, plan: LayerPlan, num_routed: int) -> Decision:
        """A static policy's decision, with the same bookkeeping."""
        per_token = self.shape.bytes_per_token()
        need = num_routed * (per_token["combine"] + sum(
            per_token[op] for op, a in zip(OPS, plan.actions) if a is Action.SAVE))
        return Decision(plan, need, self.added_s(plan, num_routed))
