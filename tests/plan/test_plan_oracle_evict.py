"""The oracle with evictions to the byte (spikeguard/plan/oracle_evict.py): exact against
exhaustive search, its lazy schedule, and a lower bound of adaptive's own decisions
(plan/decide.py walked on the same byte model, tests/plan/test_plan_oracle.py's walk).

    .venv/bin/python -m pytest tests/plan/test_plan_oracle_evict.py
"""

from __future__ import annotations

import random

import pytest

from spikeguard.errors import BudgetInfeasible
from spikeguard.plan.oracle import Layer, Problem, peak_of, solve
from spikeguard.plan.oracle_evict import (cost_of, evict_schedule, exhaustive_evict,
                                          solve_evict)
from tests.plan.test_plan_oracle import (_adaptive_walk, _cost, _figures, _model_problem,
                                         _opt, _random_problem)

pytestmark = pytest.mark.timeout(120)


def _linear(rate: float):
    return lambda n: rate * n


def test_hand_sized_evicting_a_few_bytes_beats_a_whole_cut():
    # Keeping both layers overflows the head by 10 bytes; cutting a layer costs 5 s, the
    # 10 bytes' round trip 1 s: evict them at the last decision.
    layers = (Layer(10, (_opt(100, 100, 0.0, "keep"), _opt(20, 100, 5.0, "cut"))),) * 2
    problem = Problem(layers, budget_bytes=250, end_bytes=60)
    assert solve(problem).seconds == 5.0
    sol = solve_evict(problem, _linear(0.1))
    assert sol.feasible and sol.choices == (0, 0) and sol.seconds == pytest.approx(1.0)
    assert sol.evict_at == (0, 10) and sol.evict_bytes == 10
    # Dearer bytes: the cut again.
    assert solve_evict(problem, _linear(1.0)).seconds == 5.0


def test_a_layer_that_does_not_fit_alone_is_infeasible_whatever_is_evicted():
    problem = Problem((Layer(10, (_opt(100, 300, 0.0),)),), budget_bytes=250)
    assert not solve_evict(problem, _linear(0.1)).feasible
    assert not exhaustive_evict(problem, _linear(0.1)).feasible


@pytest.mark.parametrize("seed", range(40))
def test_random_small_problems_match_exhaustive_search(seed):
    rng = random.Random(seed)
    problem = _random_problem(rng, rng.randrange(1, 5), rng.randrange(1, 6))
    evict_s = _linear(rng.choice([0.0, 0.01, 0.1, 1.0]))
    want, got = exhaustive_evict(problem, evict_s), solve_evict(problem, evict_s)
    assert got.feasible == want.feasible
    if want.feasible:
        assert got.seconds == pytest.approx(want.seconds, abs=1e-9)
        assert cost_of(problem, got.choices, evict_s) == pytest.approx(got.seconds, abs=1e-9)
        # Lazy: what goes in all is the combination's overflow, never more.
        over = max(0, peak_of(problem, got.choices) - problem.budget_bytes)
        assert got.evict_bytes == over == sum(evict_schedule(problem, got.choices))
        plain = solve(problem)
        if plain.feasible:   # eviction can only help
            assert got.seconds <= plain.seconds + 1e-12


@pytest.mark.parametrize("fraction", [0.9, 0.75, 0.6])
def test_the_catalogue_menu_on_the_model_matches_exhaustive(fraction):
    planner, problem = _model_problem([900, 1500], fraction)
    evict_s = planner.cost.offload_s_for_bytes
    want, got = exhaustive_evict(problem, evict_s), solve_evict(problem, evict_s)
    assert got.feasible == want.feasible
    if want.feasible:
        assert got.seconds == pytest.approx(want.seconds, rel=1e-12, abs=1e-15)


@pytest.mark.parametrize("seed", range(60))
def test_adaptive_never_costs_less_than_the_evicting_oracle(seed):
    """The limit holds: on the same byte and cost model, adaptive's plans and evictions
    (decided layer by layer, the forecast instead of hindsight) cost at least the
    oracle's; and wherever adaptive fits, the oracle does."""
    rng = random.Random(seed)
    counts = [rng.randrange(300, 3000) for _ in range(rng.randrange(2, 5))]
    planner, problem = _model_problem(counts, rng.uniform(0.4, 1.0), 30_000)
    oracle = solve_evict(problem, _cost().offload_s_for_bytes)
    try:
        peak, seconds, evicted = _adaptive_walk(counts, problem, _figures(counts), 30_000)
    except BudgetInfeasible:
        return
    if peak <= problem.budget_bytes:
        assert oracle.feasible
        assert seconds >= oracle.seconds * (1 - 1e-9)
