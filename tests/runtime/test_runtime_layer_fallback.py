"""When even the least the expert path can keep does not fit, the adaptive guard decides
at a layer's entry to make room by evicting the layers below (where their bytes' round trip
costs less than the layer's recompute) or to recompute that whole layer, instead of
letting the micro-batch run out of memory and paying the safety net's re-run every step.
"""

import pytest
import torch

import spikeguard
from spikeguard.model import build_model, model_config

pytestmark = pytest.mark.timeout(120)

CFG = model_config("tiny", num_layers=3)
BATCHES = [torch.randint(0, 256, (8, 33), generator=torch.Generator().manual_seed(s))
           for s in (3, 4)]


def _step(model, guard=None):
    model.zero_grad(set_to_none=True)
    if guard is None:
        for tokens_BT in BATCHES:
            model(tokens_BT[:, :-1], tokens_BT[:, 1:]).loss.backward()
        return None
    with guard.step():
        for tokens_BT in BATCHES:
            model(tokens_BT[:, :-1], tokens_BT[:, 1:]).loss.backward()
    return guard.history[-1]


def _peak(policy):
    model = build_model(CFG, seed=0)
    return _step(model, spikeguard.attach(model, budget="1GiB", policy=policy))["peak_bytes"]


def _copies_priced(guard, s_per_byte: float) -> None:
    """Host copies at `s_per_byte` each way, held there (the calibration's timings would
    move the rates)."""
    guard.cost.d2h_s_per_byte = guard.cost.h2d_s_per_byte = s_per_byte
    guard.cost.freeze()
    guard.planner.refresh()


@pytest.mark.parametrize("copies", ["dear", "cheap"])
def test_layers_that_cannot_fit_are_recomputed_whole_or_make_room_without_reruns(copies):
    # Between what full recompute needs and what the expert path alone can reach.
    budget = (_peak("full") + _peak("offload")) // 2
    plain = build_model(CFG, seed=0)
    _step(plain)
    model = build_model(CFG, seed=0)
    guard = spikeguard.attach(model, budget=budget, policy="adaptive")
    # Dear: a byte's round trip costs more than recomputing a layer that would free it;
    # cheap: the layers below give the bytes (evicted lazily) and every layer runs planned.
    _copies_priced(guard, 1e-3 if copies == "dear" else 1e-15)
    records = [_step(model, guard) for _ in range(3)]
    for record in records:
        assert record["peak_bytes"] <= record["budget_bytes"] == budget
    # The first step has no measurement of the attention part yet: the safety net may
    # run. From then on the guard knows, and recomputes whole layers up front or evicts.
    for record in records[1:]:
        assert record["safety_net_reruns"] == 0
        if copies == "dear":
            assert record["full_layers"] > 0
        else:
            assert record["full_layers"] == 0 and record["evicted_bytes"] > 0
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(plain.parameters(), model.parameters()))


def test_calm_budgets_never_recompute_whole_layers():
    model = build_model(CFG, seed=0)
    guard = spikeguard.attach(model, budget=int(1.2 * _peak("none")), policy="adaptive")
    for _ in range(2):
        record = _step(model, guard)
        assert record["full_layers"] == 0
        assert record["decisions"]["recompute"] == record["decisions"]["offload"] == 0
