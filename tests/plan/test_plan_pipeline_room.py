"""A pipeline stage's decision inputs, read from torch's own 1F1B action list, by hand.

Stage 0 of PP=2 under 1F1B runs F0 F1 B0 B1: the second forward finds the first resident,
and the first one's backward runs before its own. What that means for the window's
inputs (spikeguard/plan/residency.py and room.py): the first one's backward makes every
gradient of the stage, its bytes are freed before the second one's backward, and what
its backward adds on top of the device is its excess over the in-use its forward left.
The schedule is torch.distributed.pipelining's Schedule1F1B (torch 2.13), built on a
stand-in stage: its action list needs the number of stages only, no process group.

    .venv/bin/python -m pytest tests/plan/test_plan_pipeline_room.py -q
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from torch.distributed.pipelining import Schedule1F1B

from spikeguard.plan.forecast import Forecast
from spikeguard.plan.residency import Residency, grads_at_backward, positions
from spikeguard.plan.room import WindowState, backward_above_end, decision_inputs

MiB = 1 << 20


def torch_1f1b(num_stages: int, micro_batches: int) -> dict:
    """rank -> torch's own action list of Schedule1F1B."""
    stage = SimpleNamespace(num_stages=num_stages, stage_index=0, group_rank=0)
    return Schedule1F1B(stage, micro_batches).pipeline_order


@pytest.mark.parametrize("micro_batches", [2, 4])
def test_an_older_micro_batchs_backward_makes_every_gradient_first(micro_batches):
    order = torch_1f1b(2, micro_batches)
    grads = {0: 4 * MiB, 1: 2 * MiB}          # layer -> its own and the ones above
    first, second, *rest = positions(order[0], 0)
    assert grads_at_backward(grads, first) == grads       # nothing runs before its backward
    assert second.older == (0,)
    assert grads_at_backward(grads, second) == {0: 4 * MiB, 1: 4 * MiB}
    # the last stage runs each backward right after its forward: none resident
    assert all(grads_at_backward(grads, p) == grads for p in positions(order[1], 1))


def test_the_forwards_that_may_evict_a_micro_batch_are_those_before_its_backward():
    """Stage 0 of PP=2, 4 micro-batches, 1F1B: F0 F1 B0 F2 B1 F3 B2 B3. Micro-batch 1 is
    an older resident of F2 only (B1 runs before F3), and B0 frees micro-batch 0 before
    F2; the hookless proof (runtime/hookless.py) walks F2's layers at the reserve F2 will
    read, whose log is not the live one. The last stage runs each backward at once."""
    order = torch_1f1b(2, 4)
    at = {"k": 1}
    residency = Residency(positions(order[0], 0), micro_batch=lambda: at["k"],
                          device_bytes=lambda mb: 5 * MiB if mb == 0 else 0)
    assert residency.later_forwards() == (2,)
    assert residency.freed_before(2) == (0,)
    at["k"] = 0
    assert residency.later_forwards() == (1,) and residency.freed_before(1) == ()
    third = residency.at_forward(2)
    assert third.position().forward == 2 and third.position().older == (1,)
    third.reserve(0, 8 * MiB)
    assert residency.log == [] and len(third.log) == 1
    # F2's reserve beside its backward: the forward before it (F3), less what micro-batch
    # 1, older, holds then (B1 frees it first): read now, it holds nothing yet; `held`
    # gives what it will hold once its forward is done (hookless_walk.py)
    assert third.reserve(0, 8 * MiB).backward_bytes == 8 * MiB
    held = residency.at_forward(2, {1: 3 * MiB})
    assert held.reserve(0, 8 * MiB).backward_bytes == 5 * MiB
    assert residency.at_forward(2, {0: 3 * MiB}).reserve(0, 8 * MiB).backward_bytes == 8 * MiB
    at["k"] = 3
    assert residency.later_forwards() == ()
    last = Residency(positions(order[1], 1), micro_batch=lambda: 1)
    assert last.later_forwards() == ()
    at["k"] = 9   # a position the schedule does not have
    assert residency.later_forwards() is None


def _last_forward_of_stage_0(first_keeps: int) -> tuple[Residency, Forecast]:
    residency = Residency(positions(torch_1f1b(2, 2)[0], 0), micro_batch=lambda: 1,
                          device_bytes=lambda mb: first_keeps if mb == 0 else 0)
    return residency, Forecast(num_layers=2, residency=residency)


def test_the_last_forward_of_stage_0_plans_its_backward_without_the_first():
    """Micro-batch 1, layer 1 (the stage's last decision), with micro-batch 0's 20 MiB in
    the in-use: its backward runs after micro-batch 0's, which frees them. Its layer's
    backward peak (in-use 50 + 18 MiB) is 4 MiB past a 64 MiB budget as the in-use reads
    it, 16 MiB under it once the first one is gone: no eviction is due, and its backward
    room (for reloads) holds those 20 MiB too. (The reserve was held at 0 before: the
    stage planned its last backward beside the whole first micro-batch.)"""
    residency, forecast = _last_forward_of_stage_0(first_keeps=20 * MiB)
    state = WindowState(layer=1, budget_bytes=64 * MiB, in_use_bytes=50 * MiB,
                        num_routed=1000, layer_part_bytes=2 * MiB, max_routed=1000,
                        num_tokens=512, min_bytes_per_token=100,
                        layer_forward_peak_bytes=60 * MiB,
                        layer_backward_peak_bytes=68 * MiB)
    room = decision_inputs(state, forecast)
    assert room.backward_reserve_bytes == -20 * MiB
    assert room.layer_shortfall_bytes == 0
    assert room.backward_room_bytes == (64 - 50 + 20) * MiB
    assert residency.log[0]["at_backward"] == 0 and residency.log[0]["resident"] == 1


def test_a_resident_backward_needs_only_its_excess_over_its_forwards_end():
    """Micro-batch 0's layers predicted backward peaks of 34 and 43 MiB (device bytes,
    each at its own decision, 18 and 28 MiB in use then); its forward left 37 MiB in use.
    A later forward's in-use holds those 37 already: with measured layer peaks its plan
    leaves 6 MiB, not the 34 - 18 = 16 MiB over the lower layer's decision in-use (which
    counted the layers above it, freed by then). With the shapes' guess only, the larger
    figure stays."""
    over_decision = max(34 * MiB - 18 * MiB, 43 * MiB - 28 * MiB)
    assert backward_above_end(43 * MiB, 37 * MiB, over_decision, measured=True) == 6 * MiB
    assert backward_above_end(43 * MiB, 37 * MiB, over_decision, measured=False) == 16 * MiB
    # never below the device as it is
    assert backward_above_end(30 * MiB, 37 * MiB, -1, measured=True) == 0
    assert backward_above_end(30 * MiB, 37 * MiB, -1, measured=False) == 0
