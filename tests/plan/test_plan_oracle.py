"""The oracle (spikeguard/plan/oracle.py): optimal with hindsight, checked by brute force.

Hand-sized problems with a known answer, randomised small ones against `exhaustive`, the
catalogue's own menu on the planner's byte model, an infeasible budget, and adaptive's
decision procedure (plan/decide.py, layer by layer, the forecast instead of hindsight)
walked on the same byte model: wherever the oracle finds a plan, adaptive must decide
without raising and stay under the budget.

    .venv/bin/python -m pytest tests/plan/test_plan_oracle.py
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from spikeguard.errors import BudgetInfeasible
from spikeguard.plan.catalogue import (ALL_OFFLOAD, ALL_SAVE, EXPERTS_RECOMPUTE, OPS, Action,
                                       ExpertShape)
from spikeguard.plan.cost import CostModel
from spikeguard.plan.decide import LayerFacts, decide_layer
from spikeguard.plan.forecast import Forecast
from spikeguard.plan.layer_room import LayerRoom
from spikeguard.plan.oracle import (Choice, Layer, LayerFigures, Option, Problem, exhaustive,
                                    least_budget, peak_of, problem_from_model, solve)
from spikeguard.plan.planner import Planner

pytestmark = pytest.mark.timeout(120)

SHAPE = ExpertShape(d_model=32, d_expert=48)


def _cost() -> CostModel:
    return CostModel(stage_s_per_token={"gate_up": 4e-8, "silu": 1e-9, "act": 2e-9, "down": 3e-8},
                     d2h_s_per_byte=3e-11, h2d_s_per_byte=2e-11)


def _opt(kept, own, seconds, label=None) -> Option:
    return Option(label if label is not None else (kept, seconds), kept, own, seconds)


def test_hand_sized_the_cut_goes_where_it_is_cheapest():
    # Two layers: keeping both (100 + 100) overflows the head's 250 budget less 60; the
    # first layer's cut costs 5 s, the second's 1 s: the oracle cuts the second.
    layers = (Layer(10, (_opt(100, 100, 0.0, "keep"), _opt(20, 100, 5.0, "cut"))),
              Layer(10, (_opt(100, 100, 0.0, "keep"), _opt(20, 100, 1.0, "cut"))))
    problem = Problem(layers, budget_bytes=250, end_bytes=60)
    sol = solve(problem)
    assert sol.feasible and sol.labels(problem) == ("keep", "cut")
    assert sol.seconds == 1.0 and sol.peak_bytes == 210   # 10 + 100 + 100
    # A prefix constraint: the second layer's own peak needs the first to be cut.
    tight = Problem((layers[0], Layer(10, (_opt(100, 150, 0.0, "keep"),))), 250, 0)
    sol = solve(tight)
    assert sol.labels(tight) == ("cut", "keep") and sol.seconds == 5.0


def test_infeasible_budget_is_reported_with_the_least_budget():
    layers = (Layer(10, (_opt(100, 100, 0.0), _opt(20, 100, 5.0))),) * 2
    problem = Problem(layers, budget_bytes=100, end_bytes=60)
    sol = solve(problem)
    assert not sol.feasible and sol.choices == ()
    # Least: both cut -> layer 2 reaches 10 + 20 + 100 = 130, the head 60 + 40.
    assert sol.least_budget_bytes == 130 == exhaustive(problem).least_budget_bytes
    assert solve(Problem(layers, 130, 60)).feasible


def _random_problem(rng: random.Random, num_layers: int, num_options: int) -> Problem:
    layers = []
    for _ in range(num_layers):
        opts = tuple(_opt(rng.randrange(0, 100), rng.randrange(0, 150),
                          round(rng.uniform(0, 10), 3), label=i) for i in range(num_options))
        layers.append(Layer(rng.randrange(0, 50), opts))
    total = sum(max(o.kept_bytes for o in l.options) for l in layers)
    return Problem(tuple(layers), budget_bytes=rng.randrange(100, 150 + total),
                   end_bytes=rng.randrange(0, 80))


@pytest.mark.parametrize("seed", range(40))
def test_random_small_problems_match_exhaustive_search(seed):
    rng = random.Random(seed)
    problem = _random_problem(rng, rng.randrange(1, 5), rng.randrange(1, 6))
    want, got = exhaustive(problem), solve(problem)
    assert got.feasible == want.feasible
    assert got.least_budget_bytes == want.least_budget_bytes == least_budget(problem)
    if want.feasible:
        assert got.seconds == pytest.approx(want.seconds, abs=1e-12)
        assert peak_of(problem, got.choices) <= problem.budget_bytes


def _figures(counts, attn=20_000, static=400_000, grads=50_000) -> list[LayerFigures]:
    """A micro-batch on the byte model with everything saved: each layer's attention part,
    its expert path kept all, the gradients still to come shrinking layer by layer."""
    planner = Planner(SHAPE, _cost())
    out, in_use = [], static
    for i, n in enumerate(counts):
        in_use += attn
        out.append(LayerFigures(in_use, n, grads * (len(counts) - i), attn))
        in_use += planner.fixed(ALL_SAVE, n).device_bytes
    return out


def _model_problem(counts, fraction: float, head=30_000):
    planner = Planner(SHAPE, _cost())
    room = LayerRoom.from_shape(SHAPE.bytes_per_token())
    figures = _figures(counts)
    end = figures[-1].in_use_bytes + planner.fixed(ALL_SAVE, counts[-1]).device_bytes + head
    plain = problem_from_model(planner, room, figures, end, 1 << 60)
    budget = int(fraction * peak_of(plain, (0,) * len(counts)))
    return planner, problem_from_model(planner, room, figures, end, budget)


@pytest.mark.parametrize("fraction", [1.0, 0.9, 0.8, 0.7])
def test_catalogue_menu_on_the_planner_byte_model_matches_exhaustive(fraction):
    # Two layers of the catalogue's 96 plans each: 9216 combinations, all tried.
    planner, problem = _model_problem([900, 1500], fraction)
    want, got = exhaustive(problem), solve(problem)
    assert got.feasible == want.feasible
    assert got.least_budget_bytes == want.least_budget_bytes
    if want.feasible:
        assert got.seconds == pytest.approx(want.seconds, rel=1e-12, abs=1e-15)
    if fraction == 1.0:   # the all-saved peak fits: nothing to pay
        assert got.seconds == 0.0 and set(got.labels(problem)) == {Choice(ALL_SAVE)}


def test_whole_layer_eviction_reaches_budgets_the_plans_alone_cannot():
    # Measured layers: each keeps its attention part and a shared part beside its expert
    # path; evicting it all at the next decision is the option adaptive's evictor has.
    planner = Planner(SHAPE, _cost())
    room = LayerRoom.from_shape(SHAPE.bytes_per_token())
    plain = _figures([900, 1500, 1200])
    shared = 15_000
    figures, grow = [], 0
    for f in plain:
        figures.append(LayerFigures(f.in_use_bytes + grow, f.num_routed, f.grads_to_come,
                                    f.layer_part_bytes, layer_bytes=f.layer_part_bytes))
        grow += shared
    end = figures[-1].in_use_bytes + planner.fixed(ALL_SAVE, 1200).device_bytes + 30_000
    no_evict = [LayerFigures(f.in_use_bytes, f.num_routed, f.grads_to_come, f.layer_part_bytes)
                for f in figures]
    least_plain = solve(problem_from_model(planner, room, no_evict, end, 1)).least_budget_bytes
    problem = problem_from_model(planner, room, figures, end, least_plain - 1)
    assert len(problem.layers[0].options) == 2 * len(problem.layers[2].options)
    sol = solve(problem)
    assert sol.feasible and any(c.evict for c in sol.labels(problem))
    # Two layers' worth of it against every combination (192 x 192 x 96).
    small = Problem(problem.layers[1:], problem.budget_bytes, problem.end_bytes)
    want = exhaustive(small)
    assert solve(small).seconds == pytest.approx(want.seconds, rel=1e-12, abs=1e-15)


def test_a_cut_on_the_model_moves_the_layer_with_most_routed_copies_first():
    # The cheapest bytes per second are the same plan in every layer, so the oracle pays
    # per byte cut: it never pays more than the static plans, and less than any of them
    # that fit when the cut is shallow.
    planner, problem = _model_problem([600, 600, 2400, 600], 0.85)
    sol = solve(problem)
    assert sol.feasible
    for static in (ALL_OFFLOAD, EXPERTS_RECOMPUTE):
        idx = [list(l.options).index(next(o for o in l.options if o.label == Choice(static)))
               for l in problem.layers]
        if peak_of(problem, idx) <= problem.budget_bytes:
            assert sol.seconds <= sum(l.options[i].seconds for l, i in zip(problem.layers, idx))


class _ListEvictor:
    """Earlier layers' kept bytes, evicted lowest layer first (the tracker's order does not
    matter to the byte model: any byte below counts alike)."""

    def __init__(self, kept: list[int], cost: CostModel):
        self.kept, self.cost, self.seconds = kept, cost, 0.0

    def evictable(self) -> int:
        return sum(self.kept)

    def evict(self, num_bytes: int) -> int:
        freed = 0
        for j, k in enumerate(self.kept):
            take = min(k, num_bytes - freed)
            self.kept[j] -= take
            freed += take
        self.seconds += self.cost.offload_s_for_bytes(freed)
        return freed


def _adaptive_walk(counts, problem: Problem, figures, head_bytes: int):
    """Adaptive's own procedure (plan/decide.py decide_layer) layer by layer on the same
    byte model: the forecast in place of hindsight, evictions counted. Returns (peak,
    seconds, evicted bytes), or raises BudgetInfeasible as the window would."""
    planner = Planner(SHAPE, _cost())
    room = LayerRoom.from_shape(SHAPE.bytes_per_token())
    num_tokens = max(counts) // 2
    forecast = Forecast(num_layers=len(counts), load_margin=0.25,
                        head_bytes_per_token=head_bytes / num_tokens)
    kept: list[int] = []
    evictor = _ListEvictor(kept, planner.cost)
    peak, seconds, max_routed, evicted = 0, 0.0, 0, 0
    for i, (layer, f) in enumerate(zip(problem.layers, figures)):
        max_routed = max(max_routed, f.num_routed)
        facts = LayerFacts(layer=i, budget_bytes=problem.budget_bytes, num_routed=f.num_routed,
                           layer_part_bytes=f.layer_part_bytes, max_routed=max_routed,
                           num_tokens=num_tokens, min_bytes_per_token=planner.min_bytes_per_token,
                           grads_to_come=f.grads_to_come, last_layer=i == len(counts) - 1)
        in_use = layer.base_bytes + sum(kept)
        out = decide_layer(facts, in_use, room, forecast, planner, evictor)
        evicted += in_use - out.in_use_bytes
        opt = next(o for o in layer.options if o.label == Choice(out.decision.plan))
        peak = max(peak, out.in_use_bytes + opt.own_peak_bytes)
        seconds += opt.seconds
        kept.append(opt.kept_bytes)
    return max(peak, problem.end_bytes + sum(kept)), seconds + evictor.seconds, evicted


@pytest.mark.parametrize("seed", range(60))
def test_adaptive_fits_wherever_the_oracle_does(seed):
    """And where only adaptive fits, precisely why: it evicted bytes of the layers below to
    the byte, where the oracle's plans move whole tensors; the budget it fits is then
    less than one tensor below the oracle's least (the largest, gate_up's 2F per copy)."""
    rng = random.Random(seed)
    counts = [rng.randrange(300, 3000) for _ in range(rng.randrange(2, 5))]
    planner, problem = _model_problem(counts, rng.uniform(0.4, 1.0), 30_000)
    oracle = solve(problem)
    try:
        peak, seconds, evicted = _adaptive_walk(counts, problem, _figures(counts), 30_000)
    except BudgetInfeasible:
        assert not oracle.feasible
        return
    if oracle.feasible:
        assert peak <= problem.budget_bytes
    elif peak <= problem.budget_bytes:
        tensor = SHAPE.bytes_per_token()["gate_up"] * max(counts)
        assert evicted > 0
        assert 0 < oracle.least_budget_bytes - problem.budget_bytes < tensor


def test_adaptive_does_not_fit_where_the_oracle_finds_nothing_by_far():
    counts = [2000, 2000, 2000]
    planner, problem = _model_problem(counts, 0.3)
    assert not solve(problem).feasible
    try:
        peak = _adaptive_walk(counts, problem, _figures(counts), 30_000)[0]
    except BudgetInfeasible:
        return
    assert peak > problem.budget_bytes


def test_the_next_layers_entry_is_the_layer_belows_to_fit():
    # Layer 1's attention and dispatch (under EP the exchange's rows) run before its
    # decision, beside all layer 0 keeps: nothing is evicted until that decision, so layer
    # 0's options carry it (less what each moves off), and the solution leaves room for it.
    planner = Planner(SHAPE, _cost())
    room = LayerRoom.from_shape(SHAPE.bytes_per_token())
    plain = _figures([900, 1500])
    entry = 5_000_000   # above layer 1's decision in-use, everything saved
    figures = [plain[0], replace(plain[1], entry_peak_bytes=plain[1].in_use_bytes + entry)]
    end = figures[-1].in_use_bytes + planner.fixed(ALL_SAVE, 1500).device_bytes + 30_000
    without = problem_from_model(planner, room, plain, end, 1 << 60)
    problem = problem_from_model(planner, room, figures, end, 1 << 60)
    all_saved = planner.fixed(ALL_SAVE, 900).device_bytes
    step = plain[1].in_use_bytes - plain[0].in_use_bytes
    for old, new in zip(without.layers[0].options, problem.layers[0].options):
        moved_off = all_saved - planner.fixed(new.label.plan, 900).device_bytes
        assert new.own_peak_bytes == max(old.own_peak_bytes, step + entry - moved_off)
    assert problem.layers[1] == without.layers[1]
    # At a budget the entry decides, the plans solved for it leave it room.
    budget = least_budget(problem)
    assert least_budget(without) < budget
    sol = solve(replace(problem, budget_bytes=budget))
    moved_off = all_saved - planner.fixed(sol.labels(problem)[0].plan, 900).device_bytes
    assert sol.feasible and plain[1].in_use_bytes + entry - moved_off <= budget
