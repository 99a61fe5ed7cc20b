"""The catalogue is the operators (issue 23, item 2): each operator of the expert path is
declared once in spikeguard/plan/catalogue.py (`OPERATORS`), every table of operators
the package reads is derived from those declarations, and the few that cannot be (the
model's stage functions, which the model room owns) must cover exactly the catalogue.

    .venv/bin/python -m pytest tests/plan/test_plan_operators.py -q
"""

from __future__ import annotations

import pytest
import torch

from spikeguard.model.experts import SwiGLUExperts, stage_functions
from spikeguard.plan import catalogue
from spikeguard.plan.catalogue import (OPERATORS, Action, ExpertShape, Operator,
                                       derived_tables, valid_plans)
from spikeguard.plan.cost import CostModel, stage_seconds
from spikeguard.runtime import executor, hookless
from spikeguard.sim.device_bytes import LayerBytes

pytestmark = pytest.mark.timeout(60)

SHAPE = ExpertShape(d_model=8, d_expert=6)
# A stage added after `down`, element-wise over its rows: the test's new operator.
SCALE = Operator("scale", "z_ND", ("down",), tuple(Action), lambda D, F: D,
                 traffic=lambda D, F: 2 * D)


def test_the_packages_tables_are_the_declarations():
    tables = derived_tables()
    assert catalogue.OPS == tables["OPS"] == tuple(op.name for op in OPERATORS)
    assert catalogue.EXPERT_STAGES == tuple(op.name for op in OPERATORS if op.inputs)
    assert executor.STAGE_INPUTS is catalogue.STAGE_INPUTS
    for op in OPERATORS:
        assert catalogue.ALLOWED[op.name] == op.allowed
        assert catalogue.CONSUMERS[op.name] == tuple(
            o.name for o in OPERATORS if op.name in o.inputs)
    per = SHAPE.bytes_per_token()
    assert {k: v for k, v in per.items() if k != "combine"} == {
        op.name: op.elements(8, 6) * SHAPE.elem_bytes for op in OPERATORS}
    # The hookless attribution splits the operators between the stages and combine.
    assert set(hookless.STAGE_OPS) | set(hookless.COMBINE_OPS) == set(catalogue.OPS) | {"combine"}
    assert not set(hookless.STAGE_OPS) & set(hookless.COMBINE_OPS)


def test_the_module_docstring_table_names_every_operator():
    rows = [line.split() for line in catalogue.__doc__.splitlines()]
    named = {(r[0], r[1]) for r in rows if len(r) >= 2}
    assert all((op.name, op.tensor) in named for op in OPERATORS)


def test_the_models_stages_and_the_cost_model_cover_exactly_the_catalogue():
    experts = SwiGLUExperts(2, 8, 6)
    assert tuple(stage_functions(experts, [1, 1])) == catalogue.EXPERT_STAGES
    rated = CostModel.from_rates(SHAPE, 1e12, 1e11, 1e10, copies_overlap=False)
    assert tuple(rated.stage_s_per_token) == catalogue.EXPERT_STAGES
    timed = CostModel()
    timed.calibrate(SHAPE, num_experts=2, device=torch.device("cpu"), num_routed=64, reps=1)
    assert set(timed.stage_s_per_token) == set(catalogue.EXPERT_STAGES)


@pytest.mark.parametrize("exchanged", [False, True])
def test_the_simulators_storages_are_the_catalogues_bytes(exchanged):
    """What the simulator's layer keeps per operator under ALL_SAVE is the catalogue's
    bytes for that many routed copies, operator by operator."""
    shape = ExpertShape(d_model=8, d_expert=6, combine_after_exchange=exchanged)
    lb = LayerBytes(shape=shape, num_heads=2, num_experts=4, num_local_experts=4, top_k=2,
                    shared_width=0, grad_bytes=0, exchanged=exchanged)
    kept = {}
    for op, size in lb.storages(catalogue.ALL_SAVE, tokens=1024, num_routed=2048):
        kept[op] = kept.get(op, 0) + size
    per = shape.bytes_per_token()
    assert {op: kept.get(op, 0) for op in catalogue.OPS} == {
        op: 2048 * per[op] for op in catalogue.OPS}


def test_an_added_operator_appears_in_every_derived_table():
    tables = derived_tables(OPERATORS + (SCALE,))
    assert tables["OPS"][-1] == tables["EXPERT_STAGES"][-1] == "scale"
    assert tables["STAGE_INPUTS"]["scale"] == ("down",)
    assert tables["CONSUMERS"]["down"] == ("scale",)
    assert tables["ALLOWED"]["scale"] == tuple(Action)
    rates = stage_seconds(SHAPE, 1e12, 1e11, operators=OPERATORS + (SCALE,))
    assert rates["scale"] == 2 * 8 * SHAPE.elem_bytes / 1e11
    assert set(rates) == set(tables["EXPERT_STAGES"])


def test_an_operator_without_its_work_fails_loudly():
    bare = Operator("norm", "n_ND", ("down",), (Action.SAVE,), lambda D, F: D)
    with pytest.raises(ValueError, match="operator 'norm' declares neither flops nor traffic"):
        stage_seconds(SHAPE, 1e12, 1e11, operators=OPERATORS + (bare,))


def test_the_menu_is_unchanged_by_the_declarations():
    """96 plans, as before the catalogue declared its operators (issue 3's count)."""
    assert len(valid_plans()) == 96
