"""The planner: least added time within the headroom, eviction, infeasibility, decision time.

N = routed token copies of one layer. Costs come from a fixed CostModel (no calibration),
so every expected decision is computed independently by brute force over the menu.

    .venv/bin/python -m pytest tests/plan/test_plan_planner.py -q -s   # -s shows the timing
"""

from __future__ import annotations

import re
import statistics
import time

import pytest

from spikeguard.errors import BudgetInfeasible
from spikeguard.plan.catalogue import (ALL_SAVE, EXPERTS_RECOMPUTE, OPS, Action, ExpertShape,
                                       LayerPlan, valid_plans)
from spikeguard.plan.cost import CostModel
from spikeguard.plan.planner import Planner

pytestmark = pytest.mark.timeout(120)

SHAPE = ExpertShape(d_model=64, d_expert=96)
NUM_ROUTED = 1000


def _cost() -> CostModel:
    # Distinct stage costs, so that the least-time plan is (nearly always) unique.
    return CostModel(stage_s_per_token={"gate_up": 4e-8, "silu": 1e-9, "act": 2e-9, "down": 3e-8},
                     d2h_s_per_byte=3e-11, h2d_s_per_byte=2e-11)


@pytest.fixture(scope="module")
def planner() -> Planner:
    return Planner(SHAPE, _cost())


def _device_bytes(plan: LayerPlan, num_routed: int) -> int:
    """Independent arithmetic: combine always, plus every SAVEd operator."""
    per = SHAPE.bytes_per_token()
    return num_routed * (per["combine"] + sum(per[op] for op in OPS if plan.action(op) is Action.SAVE))


def _all_save_bytes(num_routed: int) -> int:
    return sum(SHAPE.predict(num_routed).values())


def _min_bytes(num_routed: int) -> int:
    return min(_device_bytes(p, num_routed) for p in valid_plans())


def test_device_bytes_of_every_plan(planner):
    assert _device_bytes(ALL_SAVE, NUM_ROUTED) == _all_save_bytes(NUM_ROUTED)
    assert planner.min_bytes_per_token * NUM_ROUTED == _min_bytes(NUM_ROUTED)
    for plan in valid_plans():
        assert planner.fixed(plan, NUM_ROUTED).device_bytes == _device_bytes(plan, NUM_ROUTED)


def _offload_bytes(plan: LayerPlan, num_routed: int) -> int:
    per = SHAPE.bytes_per_token()
    return num_routed * sum(per[op] for op in OPS if plan.action(op) is Action.OFFLOAD)


def test_fits_is_whether_some_plan_fits_both_passes_whatever_the_costs():
    """`fits` (the hookless proofs' question) against brute force over the menu, on a grid
    around every plan's thresholds, with the backward's room and without; and with two
    cost models far apart, whose rankings differ: the answer reads bytes only."""
    planners = [Planner(SHAPE, _cost()), Planner(SHAPE, CostModel(
        stage_s_per_token={"gate_up": 1e-12, "silu": 1e-6, "act": 1e-12, "down": 1e-6},
        d2h_s_per_byte=1e-6, h2d_s_per_byte=1e-6))]
    assert [r.plan for r in planners[0].ranked()] != [r.plan for r in planners[1].ranked()]
    for n in (0, 1, 37, NUM_ROUTED):
        needs = sorted({_device_bytes(p, n) for p in valid_plans()})
        totals = sorted({_device_bytes(p, n) + _offload_bytes(p, n) for p in valid_plans()})
        heads = sorted({max(0, b + d) for b in needs for d in (-1, 0, 1)})
        rooms = [None] + sorted({max(0, b + d) for b in totals for d in (-1, 0)})
        for head in heads:
            for room in rooms:
                want = any(_device_bytes(p, n) <= head and (
                    room is None or _device_bytes(p, n) + _offload_bytes(p, n) <= room)
                    for p in valid_plans())
                for planner in planners:
                    assert planner.fits(n, head, room) is want, (n, head, room)


@pytest.mark.parametrize("extra", [0, 1, 10**9])
def test_all_save_when_it_fits(planner, extra):
    headroom = _all_save_bytes(NUM_ROUTED) + extra
    decision = planner.decide(NUM_ROUTED, headroom)
    assert decision.plan == ALL_SAVE
    assert decision.added_s == 0.0 and decision.evict_bytes == 0
    assert decision.device_bytes == _all_save_bytes(NUM_ROUTED)


def test_one_byte_short_of_all_save_is_not_all_save(planner):
    decision = planner.decide(NUM_ROUTED, _all_save_bytes(NUM_ROUTED) - 1)
    assert decision.plan != ALL_SAVE and decision.added_s > 0


def test_chosen_plan_fits_and_is_the_cheapest_that_fits(planner):
    lo, hi = _min_bytes(NUM_ROUTED), _all_save_bytes(NUM_ROUTED)
    for i in range(41):
        headroom = lo + (hi - lo) * i // 40
        decision = planner.decide(NUM_ROUTED, headroom)
        assert decision.evict_bytes == 0
        assert decision.device_bytes <= headroom
        assert decision.device_bytes == _device_bytes(decision.plan, NUM_ROUTED)
        fitting = [p for p in valid_plans() if _device_bytes(p, NUM_ROUTED) <= headroom]
        best_s = min(planner.added_s(p, NUM_ROUTED) for p in fitting)
        assert decision.added_s == pytest.approx(best_s, rel=1e-12, abs=0.0), headroom


def test_offload_costs_its_copies_on_cpu_and_recompute_its_region():
    cost = _cost()
    planner = Planner(SHAPE, cost)
    per = SHAPE.bytes_per_token()
    offload_act = LayerPlan.of(act=Action.OFFLOAD)
    expected = NUM_ROUTED * per["act"] * (cost.d2h_s_per_byte + cost.h2d_s_per_byte)
    assert planner.added_s(offload_act, NUM_ROUTED) == pytest.approx(expected, rel=1e-12)
    # silu recomputed: region (silu, act) re-runs both stages in backward.
    recompute_silu = LayerPlan.of(silu=Action.RECOMPUTE)
    expected = NUM_ROUTED * (cost.stage_s_per_token["silu"] + cost.stage_s_per_token["act"])
    assert planner.added_s(recompute_silu, NUM_ROUTED) == pytest.approx(expected, rel=1e-12)
    # EXPERTS_RECOMPUTE: act is consumed by down, so the region runs gate_up .. down.
    expected = NUM_ROUTED * sum(cost.stage_s_per_token[s] for s in ("gate_up", "silu", "act", "down"))
    assert planner.added_s(EXPERTS_RECOMPUTE, NUM_ROUTED) == pytest.approx(expected, rel=1e-12)


def test_below_the_smallest_plan_evicts_exactly_the_shortfall(planner):
    need = _min_bytes(NUM_ROUTED)
    for headroom, evictable in [(need - 1, 1), (need - 5000, 10**6), (0, need), (-300, need + 300)]:
        decision = planner.decide(NUM_ROUTED, headroom, evictable)
        assert decision.evict_bytes == need - headroom
        assert decision.device_bytes == need == _device_bytes(decision.plan, NUM_ROUTED)


@pytest.mark.parametrize("headroom,evictable", [(0, 0), (1000, 0), (0, 999), (-1, 0)])
def test_no_plan_and_not_enough_to_evict_is_infeasible(planner, headroom, evictable):
    need = _min_bytes(NUM_ROUTED)
    if evictable:
        evictable = need - headroom - 1    # one byte short
    with pytest.raises(BudgetInfeasible) as info:
        planner.decide(NUM_ROUTED, headroom, evictable)
    assert info.value.needed_bytes == need - headroom - evictable > 0
    assert re.search(r"\d+(\.\d+)? (B|KiB|MiB|GiB)", str(info.value))


def test_decision_time_for_8_layers_of_64_experts():
    """Prints the time of the decisions of one micro-batch of an 8-layer, 64-expert model
    (medium preset widths, 8192 routed copies a layer). Printed, never asserted."""
    shape = ExpertShape(d_model=256, d_expert=128)
    planner = Planner(shape, CostModel())
    num_routed = 8192
    all_save = sum(shape.predict(num_routed).values())
    tight = planner.min_bytes_per_token * num_routed + (all_save - planner.min_bytes_per_token
                                                         * num_routed) // 3
    for label, headroom in (("calm (all save fits)", all_save), ("spike (1/3 of the range)", tight)):
        samples = []
        for _ in range(50):
            start = time.perf_counter()
            for _layer in range(8):
                decision = planner.decide(num_routed, headroom)
            samples.append((time.perf_counter() - start) * 1e6)
        assert decision.device_bytes <= headroom
        print(f"\nplanner: 8 layers x 64 experts, N=8192, {label}: "
              f"{statistics.median(samples):.0f} us per micro-batch "
              f"({statistics.median(samples) / 8:.1f} us per layer decision), "
              f"plan {decision.plan.describe()}")


def test_backward_room_rules_out_plans_whose_reload_would_not_fit(planner):
    """An offloaded tensor comes back in backward while what is in use now still is:
    a plan fits only if its kept plus reloaded bytes fit the backward room."""
    all_save = _all_save_bytes(NUM_ROUTED)
    unconstrained = planner.decide(NUM_ROUTED, headroom_bytes=all_save // 2)
    off = planner.offload_bytes_per_token(unconstrained.plan) * NUM_ROUTED
    assert off > 0, "at half the bytes the cheapest plan offloads (CPU copies are cheap)"
    room = unconstrained.device_bytes + off - 1
    constrained = planner.decide(NUM_ROUTED, all_save // 2, backward_room=room)
    assert constrained.plan != unconstrained.plan
    assert constrained.device_bytes + planner.offload_bytes_per_token(constrained.plan) \
        * NUM_ROUTED <= room


@pytest.mark.parametrize("overlap", [False, True])
def test_the_ranking_prices_every_plan_as_added_s_does(overlap):
    """refresh() caches what is fixed per plan; its seconds must still be added_s's, also
    after the cost model moves (online corrections) and with copies that overlap."""
    cost = CostModel(stage_s_per_token={"gate_up": 3e-8, "silu": 1e-9, "act": 2e-9, "down": 2e-8},
                     copies_overlap=overlap)
    planner = Planner(SHAPE, cost)
    for scale in (1.0, 7.0):
        cost.stage_s_per_token["gate_up"] *= scale
        cost.d2h_s_per_byte *= scale
        planner.refresh()
        ranked = planner.ranked()
        assert len(ranked) == len(valid_plans())
        for r in ranked:
            assert r.s_per_token == pytest.approx(planner.added_s(r.plan, 1), rel=1e-12, abs=0)
            assert r.device_bytes_per_token == _device_bytes(r.plan, 1)
        assert [r.s_per_token for r in ranked] == sorted(r.s_per_token for r in ranked)


def test_the_keep_all_shortcut_decides_as_the_ranking_would():
    """When everything fits, decide answers without ranking; the answer must be what a walk
    of the full ranking gives, at the fitting edge and one byte short of it."""
    planner = Planner(SHAPE, _cost())
    need = _all_save_bytes(NUM_ROUTED)
    for headroom, room in ((need, None), (need, need), (need - 1, None), (need, need - 1),
                           (10 * need, 10 * need)):
        fast = planner.decide(NUM_ROUTED, headroom, 0, room)
        walk = next((r for r in planner.ranked()
                     if r.device_bytes_per_token * NUM_ROUTED <= headroom and
                     (room is None or (r.device_bytes_per_token + r.offload_bytes_per_token)
                      * NUM_ROUTED <= room)), None)
        assert walk is not None and fast.plan == walk.plan, (headroom, room)
        assert fast.device_bytes == walk.device_bytes_per_token * NUM_ROUTED
    assert planner.ranked()[0].plan == ALL_SAVE and planner.ranked()[0].s_per_token == 0


class _ConstantBytes(Planner):
    """A planner whose layers keep bytes whatever the count (as titan_blocks' adapter)."""

    def layer_bytes(self, plan: LayerPlan) -> tuple[int, int]:
        return (3000, 0) if plan.action("gate_up") is Action.SAVE else (1000, 500)


@pytest.mark.parametrize("kind", [Planner, _ConstantBytes])
def test_decide_takes_the_first_ranked_plan_that_fits_both_passes(kind):
    """decide's loop (written out, no layer_bytes call where it is Planner's own) against
    the ranking walked with `_fits` as it is written, over headrooms and backward rooms on
    both sides of every plan's edge: the same plan, the same bytes and seconds."""
    planner = kind(SHAPE, _cost())
    edges = set()
    for r in planner.ranked():
        device, offload = planner.layer_bytes(r.plan)
        need = r.device_bytes_per_token * NUM_ROUTED + device
        back = need + offload + r.offload_bytes_per_token * NUM_ROUTED
        edges |= {need - 1, need, back - 1, back}
    edges = sorted(edges)
    checked = 0
    for headroom in edges:
        for room in [None] + edges:
            walk = next((r for r in planner.ranked()
                         if planner._fits(r, NUM_ROUTED, headroom, room) is not None), None)
            if walk is None:
                continue
            d = planner.decide(NUM_ROUTED, headroom, 0, room)
            assert d.plan == walk.plan, (kind.__name__, headroom, room)
            assert d.device_bytes == planner._fits(walk, NUM_ROUTED, headroom, room)
            assert d.added_s == walk.s_per_token * NUM_ROUTED and d.evict_bytes == 0
            checked += 1
    assert checked > 100
