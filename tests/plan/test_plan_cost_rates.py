"""A cost model's rates as a file (spikeguard/plan/cost_rates.py, `train --cost-rates`):
written and read back exactly, every mistake in a file refused in one line naming it, and
a model given rates is frozen (timings no longer move them)."""

from __future__ import annotations

import json

import pytest

from spikeguard.errors import UsageError
from spikeguard.plan.catalogue import EXPERT_STAGES
from spikeguard.plan.cost import CostModel
from spikeguard.plan.cost_rates import load_rates, rates_of, use_rates, write_rates


def _calibrated() -> CostModel:
    cost = CostModel()
    cost.stage_s_per_token = {s: (i + 1) * 1.25e-9 for i, s in enumerate(EXPERT_STAGES)}
    cost.d2h_s_per_byte, cost.h2d_s_per_byte = 3e-10, 4e-10
    return cost


def test_rates_round_trip_exactly_and_freeze(tmp_path):
    path = tmp_path / "rates.json"
    write_rates(_calibrated(), path)
    cost = use_rates(CostModel(), load_rates(path))
    assert rates_of(cost) == rates_of(_calibrated())
    assert cost.frozen
    before = rates_of(cost)
    cost.observe(EXPERT_STAGES[0], 4096, 1.0)
    cost.observe_copy("d2h", 1 << 20, 1.0)
    assert rates_of(cost) == before


def test_an_existing_file_is_kept(tmp_path):
    path = tmp_path / "rates.json"
    path.write_text("mine")
    with pytest.raises(Exception, match="exists"):
        write_rates(_calibrated(), path)
    assert path.read_text() == "mine"


def _with(**changes) -> dict:
    data = rates_of(_calibrated())
    data.update(changes)
    return data


@pytest.mark.parametrize("content, words", [
    ("{not json", "is not a rates file \\(JSON\\)"),
    (json.dumps({"format": "other", "version": 1}), "is not a rates file \\(spikeguard-cost-rates"),
    (json.dumps(_with(version=2)), "version 1"),
    (json.dumps(_with(stage_s_per_token={"gate_up": 1e-9})), "must give exactly gate_up"),
    (json.dumps(_with(d2h_s_per_byte=0)), "d2h_s_per_byte must be a positive number"),
    (json.dumps(_with(h2d_s_per_byte="fast")), "h2d_s_per_byte must be a positive number"),
    (json.dumps(_with(stage_s_per_token={s: float("nan") for s in EXPERT_STAGES})),
     "must be a positive number"),
    (json.dumps(_with(copies_overlap=1)), "copies_overlap must be true or false"),
])
def test_a_bad_rates_file_is_refused_in_one_line(tmp_path, content, words):
    path = tmp_path / "rates.json"
    path.write_text(content)
    with pytest.raises(UsageError, match=words) as err:
        load_rates(path)
    assert "\n" not in str(err.value) and str(path) in str(err.value)


def test_a_missing_file_or_a_folder_is_refused(tmp_path):
    with pytest.raises(UsageError, match="no such file"):
        load_rates(tmp_path / "absent.json")
    with pytest.raises(UsageError, match="is a folder"):
        load_rates(tmp_path)
