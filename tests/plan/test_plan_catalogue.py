"""Operator catalogue: the byte model per routed token, checkpoint regions, the plan menu.

N = routed token copies, D = model width, F = expert hidden width.

    .venv/bin/python -m pytest tests/plan/test_plan_catalogue.py -q
"""

from __future__ import annotations

import pytest

from spikeguard.plan.catalogue import (ALL_OFFLOAD, ALL_SAVE, ALLOWED, EXPERTS_RECOMPUTE, OPS,
                                       Action, ExpertShape, LayerPlan, is_valid, region_of,
                                       valid_plans)

pytestmark = pytest.mark.timeout(120)

S, R, O = Action.SAVE, Action.RECOMPUTE, Action.OFFLOAD


def test_bytes_per_token_by_hand():
    # D=4, F=3, float32, float32 combine weight. Combine's int64 index is not combine's:
    # dispatch's gather keeps it before the decision window (it counts under "router").
    shape = ExpertShape(d_model=4, d_expert=3)
    assert shape.bytes_per_token() == {"dispatch": 16, "gate_up": 24, "silu": 12, "act": 12,
                                       "down": 16, "combine": 16 + 4}
    half = ExpertShape(d_model=4, d_expert=3, elem_bytes=2, weight_bytes=2)
    assert half.bytes_per_token()["gate_up"] == 12
    assert half.bytes_per_token()["combine"] == 8 + 2


def test_predict_is_linear_in_routed_tokens():
    shape = ExpertShape(d_model=256, d_expert=128)
    one = shape.predict(1)
    assert shape.predict(0) == {op: 0 for op in one}
    assert shape.predict(8192) == {op: 8192 * n for op, n in one.items()}
    assert set(one) == set(OPS) | {"combine"}


@pytest.mark.parametrize("recomputed,region", [
    ((), ()),
    (("silu",), ("silu", "act")),
    (("act",), ("act", "down")),
    (("gate_up",), ("gate_up", "silu", "act")),
    (("gate_up", "silu"), ("gate_up", "silu", "act")),
    (("gate_up", "silu", "act"), ("gate_up", "silu", "act", "down")),
    (("silu", "act"), ("silu", "act", "down")),
    (("gate_up", "act"), ("gate_up", "silu", "act", "down")),
])
def test_region_spans_first_producer_to_last_consumer(recomputed, region):
    assert region_of(recomputed) == region


@pytest.mark.parametrize("actions,valid", [
    ((S, S, S, S, S), True),
    ((O, O, O, O, O), True),
    ((S, R, R, R, S), True),
    ((O, R, R, R, O), True),
    ((S, O, R, S, S), True),    # gate_up is outside silu's region (silu, act)
    ((S, S, S, R, O), True),    # down is the region's last stage: its output leaves it
    ((S, R, S, S, S), True),    # silu cached by SAC inside gate_up's region
    ((S, R, O, S, S), False),   # silu inside gate_up's region cannot be offloaded
    ((S, R, S, O, S), True),    # act is that region's output, saved by down outside it
    ((S, R, O, R, S), False),   # silu inside (gate_up .. down) cannot be offloaded
    ((O, R, O, O, O), False),
    ((R, S, S, S, S), False),   # dispatch is never recomputed (it may be an all-to-all)
    ((S, S, S, S, R), False),   # down is never recomputed (combine would join the region)
])
def test_is_valid_by_hand(actions, valid):
    assert is_valid(LayerPlan(actions)) is valid


def test_valid_plans_is_the_menu_of_96():
    menu = valid_plans()
    assert len(menu) == 96
    assert len(set(menu)) == 96
    assert all(is_valid(p) for p in menu)
    assert all(a in ALLOWED[op] for p in menu for op, a in p.as_dict().items())
    for named in (ALL_SAVE, EXPERTS_RECOMPUTE, ALL_OFFLOAD):
        assert named in menu
    # Every valid plan is on the menu: count them independently of valid_plans.
    import itertools
    count = sum(is_valid(LayerPlan(a)) for a in itertools.product(tuple(Action), repeat=len(OPS)))
    assert count == 96


def test_layer_plan_helpers():
    plan = LayerPlan.of(silu=R, act=O)
    assert plan.actions == (S, S, R, O, S)
    assert plan.action("silu") is R and plan.recomputed() == ("silu",)
    assert plan.region() == ("silu", "act")
    assert plan.describe() == "dispatch=sav gate_up=sav silu=rec act=off down=sav"


def test_valid_plans_are_the_same_objects_in_a_fresh_list():
    """Every planner gets the same (frozen) plan objects, so what is remembered per plan
    object (the simulator's layer figures, by identity) serves all of them; the list is
    each caller's own (an adapter may change its planner's menu)."""
    first, second = valid_plans(), valid_plans()
    assert first is not second
    assert all(a is b for a, b in zip(first, second, strict=True))
    first.pop()
    assert len(valid_plans()) == 96
