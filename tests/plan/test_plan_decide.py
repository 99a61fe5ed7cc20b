"""A layer's entry (spikeguard.plan.decide `entry_fallback`) on numbers worked out by hand:
where its least plan would overflow, the layers below give the bytes when they can and
that costs less than the layer's recompute; else it is recomputed whole.

    .venv/bin/python -m pytest tests/plan/test_plan_decide.py -q
"""

from __future__ import annotations

import pytest

from spikeguard.plan.catalogue import ExpertShape
from spikeguard.plan.cost import CostModel
from spikeguard.plan.decide import entry_fallback
from spikeguard.plan.forecast import Forecast
from spikeguard.plan.planner import Planner
from spikeguard.plan.room import EntryState, Seen, entry_overflow

pytestmark = pytest.mark.timeout(60)

SHAPE = ExpertShape(d_model=64, d_expert=96)
STAGES = {"gate_up": 4e-8, "silu": 1e-9, "act": 2e-9, "down": 3e-8}   # s per routed copy
ALL_STAGES_S = sum(STAGES.values())


class Evictor:
    """What the layers below hold, and what they were asked to move."""

    def __init__(self, evictable: int):
        self.left = evictable
        self.asked: list[int] = []

    def evictable(self) -> int:
        return self.left

    def evict(self, num_bytes: int) -> int:
        self.asked.append(num_bytes)
        freed = min(num_bytes, self.left)
        self.left -= freed
        return freed


class Slopes:
    """A whole layer's backward peak: 50 kB over its entry's in-use plus its part."""

    def whole_backward(self, entry_in_use, layer_part, num_routed, grads_to_come, fixed=(0, 0)):
        return entry_in_use + layer_part + 50_000


def _forecast() -> Forecast:
    return Forecast(num_layers=4, load_margin=0.25, head_bytes_per_token=10.0,
                    post_bytes_per_token=2.0, combine_bytes_per_token=1.0)


def _planner(s_per_byte: float) -> Planner:
    return Planner(SHAPE, CostModel(stage_s_per_token=dict(STAGES), d2h_s_per_byte=s_per_byte,
                                    h2d_s_per_byte=s_per_byte))


# attention part 1000 B, 40 routed copies; the least plan keeps 1000 + 40 * least per copy
SEEN = Seen(max_routed=30, layer_bytes_per_token=50.0, routed_per_token=2.0)


def _to_come(planner: Planner) -> int:
    return _forecast().still_to_come(1, 1000, 40, planner.min_bytes_per_token, 20)


def _entry(planner: Planner, overflow: int) -> EntryState:
    fits = 10_000 + 1000 + planner.min_bytes_per_token * 40 + _to_come(planner)
    return EntryState(layer=1, budget_bytes=fits - overflow, in_use_bytes=10_000,
                      num_tokens=20, min_bytes_per_token=planner.min_bytes_per_token, seen=SEEN)


def test_the_overflow_by_hand():
    planner = _planner(1e-12)
    entry = _entry(planner, 700)
    assert entry_overflow(entry, _forecast()) == (700, 700 - _to_come(planner))
    assert entry_overflow(_entry(planner, -5), _forecast())[0] == -5


def test_a_layer_that_fits_neither_evicts_nor_falls_back():
    planner, evictor = _planner(1e-12), Evictor(10**6)
    assert not entry_fallback(_entry(planner, 0), _forecast(), Slopes(), 0, evictor, planner)
    assert evictor.asked == []


def test_cheap_eviction_runs_the_layer_planned_moving_its_own_part_now():
    planner, evictor = _planner(1e-12), Evictor(10**6)
    # 1500 B over beside what is still to come: those are this layer's own forward's, moved
    # now; what is still to come is later layers' to find when they come
    over = _to_come(planner) + 1500
    assert planner.cost.offload_s_for_bytes(over) < planner.whole_recompute_s(40)
    assert not entry_fallback(_entry(planner, over), _forecast(), Slopes(), 0, evictor, planner)
    assert evictor.asked == [1500]
    # over only with what is to come: nothing moves yet
    evictor = Evictor(10**6)
    assert not entry_fallback(_entry(planner, _to_come(planner)), _forecast(), Slopes(), 0,
                              evictor, planner)
    assert evictor.asked == []


def test_what_later_layers_will_leave_counts_toward_the_overflow():
    # nothing evictable yet (a first layer): this layer's and the next one's attention
    # parts (1000 B each: layer 1 of 4, the last layer's not counted) and what their expert
    # paths keep at the least (40 copies, as the entry estimates them: SEEN's 2 per token
    # x 20 tokens, at the least plan's bytes per copy) can go before the end
    planner = _planner(1e-12)
    assert _forecast().later_evictable(1, 1000) == 2000
    least = planner.min_bytes_per_token * 40
    assert least > 0 and _forecast().later_evictable(1, 1000, least) == 2 * (1000 + least)
    later = 2 * (1000 + least)
    evictor = Evictor(0)
    assert not entry_fallback(_entry(planner, later), _forecast(), Slopes(), 0, evictor, planner)
    assert evictor.asked == []
    entry = _entry(planner, later + 1)
    assert entry_fallback(entry, _forecast(), Slopes(), 0, evictor, planner)
    # room is made now for its whole backward: entry in-use + part + 50 kB over the budget
    assert evictor.asked == [10_000 + 1000 + 50_000 - entry.budget_bytes]


def test_too_little_below_for_its_own_forward_falls_back_whole():
    planner = _planner(1e-12)
    over = _to_come(planner) + 1500
    evictor = Evictor(1499)
    assert entry_fallback(_entry(planner, over), _forecast(), Slopes(), 0, evictor, planner)
    assert len(evictor.asked) == 1   # for its whole backward, not its forward


def test_eviction_dearer_than_the_recompute_falls_back_whole():
    # the round trip of 4000 B at 1 us a byte each way, against 40 copies' recompute
    planner, evictor = _planner(1e-6), Evictor(10**6)
    assert planner.whole_recompute_s(40) == pytest.approx(40 * ALL_STAGES_S)
    assert planner.cost.offload_s_for_bytes(4000) > planner.whole_recompute_s(40)
    entry = _entry(planner, 4000)
    assert entry_fallback(entry, _forecast(), Slopes(), 0, evictor, planner)
    assert evictor.asked == [10_000 + 1000 + 50_000 - entry.budget_bytes]


def test_the_window_state_takes_each_fact_to_its_field():
    """window_state builds WindowState positionally: every field gets its own fact (each
    fact a different number here), as by keyword."""
    import dataclasses

    from spikeguard.plan.decide import LayerFacts, window_state
    from spikeguard.plan.room import WindowState

    numbers = iter(range(101, 200))
    facts = LayerFacts(**{f.name: (next(numbers), next(numbers)) if f.name == "fixed_backward"
                          else next(numbers) for f in dataclasses.fields(LayerFacts)})

    class Slopes:
        def needs(self, in_use, num_routed, grads_to_come, layer_part, fixed):
            return (in_use, num_routed, grads_to_come, layer_part, fixed), -in_use

    state = window_state(facts, 7, 9, Slopes())
    shared = {f.name for f in dataclasses.fields(WindowState)} & set(facts.__dict__)
    assert state == WindowState(
        **{name: getattr(facts, name) for name in shared}, in_use_bytes=7, evictable_bytes=9,
        layer_forward_peak_bytes=(7, facts.num_routed, facts.grads_to_come,
                                  facts.layer_part_bytes, facts.fixed_backward),
        layer_backward_peak_bytes=-7)
    assert len(shared) == len(dataclasses.fields(WindowState)) - 4
