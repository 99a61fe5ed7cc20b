"""The one decision procedure (spikeguard.plan.decide) on numbers: the layer-entry check
asks what the layer's decision will ask, so a layer it lets through finds a plan.

    .venv/bin/python -m pytest tests/plan/test_plan_decide.py -q
"""

from __future__ import annotations

import pytest

from spikeguard.errors import BudgetInfeasible
from spikeguard.plan import decide
from spikeguard.plan.catalogue import ExpertShape
from spikeguard.plan.cost import CostModel
from spikeguard.plan.forecast import Forecast
from spikeguard.plan.layer_room import LayerRoom
from spikeguard.plan.planner import Planner
from spikeguard.plan.room import EntryState, Seen, layer_cannot_fit

SHAPE = ExpertShape(d_model=16, d_expert=32)
# Earlier layers measured 50 B of attention part and 2 routed copies per token: at 20
# tokens the layer is expected to bring a 1000 B part and 40 copies.
SEEN, TOKENS, PART, ROUTED = Seen(40, 50.0, 2.0), 20, 1000, 40
LAST = 3   # of 4: nothing of the forward is still to come, no prefetch margin


class Counting:
    """An Evictor over a number of bytes, recording what was asked."""

    def __init__(self, evictable: int):
        self.left, self.asked = evictable, []

    def evictable(self) -> int:
        return self.left

    def evict(self, num_bytes: int) -> int:
        self.asked.append(num_bytes)
        moved = min(self.left, num_bytes)
        self.left -= moved
        return moved


@pytest.fixture
def parts():
    planner = Planner(SHAPE, CostModel())
    forecast = Forecast(num_layers=4, head_bytes_per_token=0.0)
    return planner, forecast, LayerRoom.from_shape(SHAPE.bytes_per_token())


def _facts(planner: Planner, budget: int):
    def facts_at(part: int, routed: int) -> decide.LayerFacts:
        return decide.LayerFacts(layer=LAST, budget_bytes=budget, num_routed=routed,
                                 layer_part_bytes=part, max_routed=max(SEEN.max_routed, routed),
                                 num_tokens=TOKENS,
                                 min_bytes_per_token=planner.min_bytes_per_token,
                                 grads_to_come=0, prefetch=True, last_layer=True)
    return facts_at


def _entry(planner: Planner, budget: int, in_use: int = 0) -> EntryState:
    return EntryState(LAST, budget, in_use, TOKENS, planner.min_bytes_per_token, SEEN)


def _gap_budget(parts, below: int = 0) -> int:
    """The least budget at which the least plan's forward bytes fit beside `below` bytes of
    earlier layers (the old entry check passes) on the last layer of 4: the offloaded
    bytes coming back in its backward do not."""
    planner, forecast, _ = parts
    least = below + PART + planner.least(ROUTED).device_bytes
    assert not layer_cannot_fit(_entry(planner, least, below), forecast)
    assert layer_cannot_fit(_entry(planner, least - 1, below), forecast)
    return least


def test_the_entry_falls_back_where_the_decision_would_find_no_plan(parts):
    planner, forecast, slopes = parts
    budget = _gap_budget(parts)
    facts = _facts(planner, budget)(PART, ROUTED)
    with pytest.raises(BudgetInfeasible):   # what the layer met after routing before
        decide.decide_layer(facts, PART, slopes, forecast, planner, Counting(0))
    assert decide.decision_fails(facts, PART, 0, slopes, forecast, planner)
    entry = _entry(planner, budget)
    assert not decide.entry_fallback(entry, forecast, slopes, 0, Counting(0))   # the old gap
    assert decide.entry_fallback(entry, forecast, slopes, 0, Counting(0), planner=planner,
                                 facts_at=_facts(planner, budget))


def test_no_fallback_where_eviction_lets_the_decision_fit(parts):
    planner, forecast, slopes = parts
    below = 40_000   # earlier layers' saved bytes, all of which may go to host
    budget = _gap_budget(parts, below)
    facts = _facts(planner, budget)(PART, ROUTED)
    evictor = Counting(below)
    decide.decide_layer(facts, below + PART, slopes, forecast, planner, evictor)
    assert sum(evictor.asked) > 0   # the decision fits by moving earlier layers out
    assert not decide.decision_fails(facts, below + PART, below, slopes, forecast, planner)
    evictor = Counting(below)
    assert not decide.entry_fallback(_entry(planner, budget, below), forecast, slopes, 0,
                                     evictor, planner=planner, facts_at=_facts(planner, budget))
    assert evictor.asked == []   # asking the decision moved nothing


def test_asking_the_decision_agrees_with_it_across_budgets(parts):
    planner, forecast, slopes = parts
    budget = _gap_budget(parts)
    for extra in range(0, 40_000, 250):
        for evictable in (0, 2_000):
            facts = _facts(planner, budget + extra)(PART, ROUTED)
            try:
                decide.decide_layer(facts, PART, slopes, forecast, planner, Counting(evictable))
                raised = False
            except BudgetInfeasible:
                raised = True
            assert decide.decision_fails(facts, PART, evictable, slopes, forecast,
                                         planner) == raised
