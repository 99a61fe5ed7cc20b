"""The planner's inputs (spikeguard.plan.room) on numbers worked out by hand.

    .venv/bin/python -m pytest tests/plan/test_plan_room.py -q
"""

from __future__ import annotations

import dataclasses

import pytest

from spikeguard.plan.catalogue import ExpertShape
from spikeguard.plan.forecast import Forecast
from spikeguard.plan.room import (EntryState, Seen, WindowState, decision_inputs, entry_estimate,
                                  entry_overflow, forward_transient_bytes_per_routed,
                                  layer_cannot_fit)


class FakeResidency:
    """Residency.reserve's contract: returns (forward reserve, backward reserve)."""

    def __init__(self, forward: int, backward: int):
        self.forward, self.backward = forward, backward
        self.wholes: list[tuple[int, int]] = []

    def reserve(self, layer: int, whole_micro_batch_bytes: int) -> tuple[int, int]:
        self.wholes.append((layer, whole_micro_batch_bytes))
        return self.forward, self.backward


def _forecast(residency=None) -> Forecast:
    # 4 layers; per token: head 10, shared expert 2, combine 1; load margin 25%.
    return Forecast(num_layers=4, load_margin=0.25, head_bytes_per_token=10.0,
                    post_bytes_per_token=2.0, combine_bytes_per_token=1.0, residency=residency)


# Layer 1 of 4, attention part 1000 B, 40 routed copies at most so far, 5 B per copy at the
# least, 20 tokens:  future routed 40 * 1.25 = 50;  post-expert (2 + 1) * 20 = 60;
# each later layer 1000 + 60 + 5 * 50 = 1310;  head 10 * 20 = 200;  2 layers remain;
# one whole micro-batch 4 * 1310 + 200 = 5440;  still to come 60 + 2 * 1310 + 200 = 2880.
STILL_TO_COME, WHOLE = 2880, 5440


def _state(**changes) -> WindowState:
    base = WindowState(layer=1, budget_bytes=100_000, in_use_bytes=50_000, num_routed=32,
                       layer_part_bytes=1000, max_routed=40, num_tokens=20,
                       min_bytes_per_token=5, transient_bytes_per_routed=7, prefetch=True,
                       last_layer=False, evictable_bytes=1234, backward_extra_bytes=250)
    return dataclasses.replace(base, **changes)


def test_forecast_figures_by_hand():
    residency = FakeResidency(forward=300, backward=700)
    f = _forecast(residency)
    assert f.still_to_come(1, 1000, 40, 5, 20) == STILL_TO_COME + 300
    assert f.backward_reserve(1, 1000, 40, 5, 20) == 700
    assert residency.wholes == [(1, WHOLE), (1, WHOLE)]
    assert _forecast().still_to_come(1, 1000, 40, 5, 20) == STILL_TO_COME
    assert _forecast().backward_reserve(1, 1000, 40, 5, 20) == 0


def test_the_forecast_changes_nothing():
    f = _forecast(FakeResidency(forward=300, backward=700))
    before = dataclasses.asdict(dataclasses.replace(f, residency=None))
    first = (f.still_to_come(1, 1000, 40, 5, 20), f.backward_reserve(1, 1000, 40, 5, 20))
    again = (f.still_to_come(1, 1000, 40, 5, 20), f.backward_reserve(1, 1000, 40, 5, 20))
    assert first == again
    assert dataclasses.asdict(dataclasses.replace(f, residency=None)) == before
    assert not hasattr(f, "backward_reserved_bytes")


def test_decision_inputs_by_hand():
    room = decision_inputs(_state(), _forecast(FakeResidency(forward=300, backward=700)))
    # headroom: 100000 - 50000 - (2880 + 300) - 32 * 7
    assert room.headroom_bytes == 46_596
    # backward room: 100000 - 50000 - 1000 (prefetch margin) - 700 (reserve) - 250 (extra)
    assert room.backward_room_bytes == 48_050
    assert (room.prefetch_margin_bytes, room.backward_reserve_bytes, room.to_come_bytes) == \
        (1000, 700, 3180)
    assert room.planner_args() == (32, 46_596, 1234, 48_050)


@pytest.mark.parametrize("changes", [{"last_layer": True}, {"prefetch": False}])
def test_no_prefetch_margin_without_prefetch_or_on_the_last_layer(changes):
    room = decision_inputs(_state(**changes), _forecast())
    assert room.prefetch_margin_bytes == 0
    assert room.backward_room_bytes == 100_000 - 50_000 - 250
    assert room.headroom_bytes == 100_000 - 50_000 - STILL_TO_COME - 32 * 7


def test_unknown_tokens_forecast_with_the_routed_count():
    calls = []

    class Spy:
        def still_to_come(self, *args):
            calls.append(args)
            return 0

        def backward_reserve(self, *args):
            calls.append(args)
            return 0

    decision_inputs(_state(num_tokens=0), Spy())
    assert calls == [(1, 1000, 40, 5, 32)] * 2


def test_seen_after_and_next_micro_batch():
    seen = Seen().after(num_routed=60, layer_part_bytes=1000, num_tokens=20)
    assert seen == Seen(60, 50.0, 3.0)
    seen = seen.after(num_routed=20, layer_part_bytes=1200, num_tokens=20)
    assert seen == Seen(60, 60.0, 3.0)     # each a maximum of its own
    assert seen.after(90, 5000, 0) == Seen(90, 60.0, 3.0)   # no tokens: no per-token figure
    assert seen.next_micro_batch() == Seen(0, 60.0, 3.0)


def _entry(budget: int, seen: Seen) -> EntryState:
    return EntryState(layer=1, budget_bytes=budget, in_use_bytes=10_000, num_tokens=20,
                      min_bytes_per_token=5, seen=seen)


def test_layer_entry_by_hand():
    # attention part 50 B/token * 20 = 1000; routed 2 * 20 = 40 (larger than the 30 seen);
    # the least: 1000 + 5 * 40 = 1200; still to come (layer 1 of 4, as above) 2880.
    seen = Seen(max_routed=30, layer_bytes_per_token=50.0, routed_per_token=2.0)
    assert entry_estimate(_entry(0, seen)) == (1000, 40)
    need = 10_000 + 1200 + STILL_TO_COME
    assert not layer_cannot_fit(_entry(need, seen), _forecast())
    assert layer_cannot_fit(_entry(need - 1, seen), _forecast())
    # a larger count already seen in this micro-batch wins over the per-token figure
    busy = dataclasses.replace(seen, max_routed=100)
    assert entry_estimate(_entry(0, busy)) == (1000, 100)
    assert layer_cannot_fit(_entry(need, busy), _forecast())


def test_layer_entry_with_the_dispatch_exchange_by_hand():
    # Under EP the dispatch holds its sent rows (8 B per token: 160) and received ones (4 B
    # per routed copy: 4 * 40 = 160) beside the attention part (1000), gone by the decision:
    # a peak of 10_000 + 1000 + 320 = 11_320, over the least plan's 11_200 but not over the
    # least plan and what is still to come (STILL_TO_COME, later).
    seen = Seen(max_routed=30, layer_bytes_per_token=50.0, routed_per_token=2.0)
    rows = dict(sent_bytes_per_token=8, received_bytes_per_routed=4)
    for budget in (11_320, 11_319, 11_100):
        plain, exchange = _entry(budget, seen), dataclasses.replace(_entry(budget, seen), **rows)
        overflow, own = entry_overflow(plain, _forecast())
        assert own == 11_200 - budget and overflow == own + STILL_TO_COME
        assert entry_overflow(exchange, _forecast()) == (overflow, max(own, 11_320 - budget))
    # with little else to come, the dispatch is the larger of the two, in both figures
    tight = dataclasses.replace(_entry(11_000, seen), num_tokens=20, **rows)
    assert entry_overflow(tight, FixedToCome(0)) == (320, 320)
    assert entry_overflow(dataclasses.replace(tight, **dict.fromkeys(rows, 0)),
                          FixedToCome(0)) == (200, 200)


class FixedToCome:
    def __init__(self, bytes_to_come: int):
        self.bytes_to_come = bytes_to_come

    def still_to_come(self, *args) -> int:
        return self.bytes_to_come


def test_no_layer_entry_check_before_an_attention_part_was_measured():
    assert entry_estimate(_entry(0, Seen(500, 0.0, 9.0))) is None
    assert not layer_cannot_fit(_entry(0, Seen(500, 0.0, 9.0)), _forecast())


def test_forward_transient_is_the_gate_up_output_on_cuda_only():
    shape = ExpertShape(d_model=64, d_expert=96, elem_bytes=2)
    assert forward_transient_bytes_per_routed(shape, on_cuda=True) == 2 * 96 * 2
    assert forward_transient_bytes_per_routed(shape, on_cuda=False) == 0


@pytest.mark.multiprocess
def test_room_imports_no_torch():
    import subprocess
    import sys

    code = ("import sys, spikeguard.plan.room; "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
