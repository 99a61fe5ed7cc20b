"""Evicting a layer's saved tensors does not teach the guard that layers need more.

The layer peaks (plan/layer_room.py) read each layer's forward and backward peaks against
the in-use the window saw at its decision. When a later layer's decision moves bytes of
the layers below to host, the layers in between will not find them in their backward, so
their backward base drops; but their forward peak was reached with those bytes on the
device. Taken off the forward base too (as it was until this test), every eviction
inflated the forward slope by the bytes it moved, and the next step evicted more: on
`small` at 0.85x, 19.1 KB per routed copy read where the device's peaks give 7.9, and
61 MiB evicted a step where 15 do (the oracle's bench, docs/oracle.md).
"""

import pytest
import torch

import spikeguard
from spikeguard.plan.layer_room import FORWARD, LayerRoom
from spikeguard.model import build_model, model_config
from spikeguard.runtime.layer_room import LayerPeaks

pytestmark = pytest.mark.timeout(120)

CFG = model_config("tiny", d_expert=256, num_layers=4)
BATCHES = [torch.randint(0, 256, (8, 33), generator=torch.Generator().manual_seed(s))
           for s in (1, 2)]
K = 1000


def test_an_eviction_lowers_the_forward_base_of_the_deciding_layer_only():
    peaks = LayerPeaks(LayerRoom(1.0, 1.0), num_layers=3)
    for layer, in_use in enumerate((10 * K, 20 * K, 30 * K)):
        peaks.record(0, layer, in_use, num_routed=100, grads_to_come=0)
    peaks.evicted(0, 2, 0, 4 * K)    # layer 2's decision moves 4 KB of layer 0 to host
    # forward peaks: each layer's own rise of 1 KB over its decision's in-use (layer 2's
    # after the eviction); backward peaks: 2 KB over what its backward finds
    forward = {0: 11 * K, 1: 21 * K, 2: 27 * K}
    backward = {0: 12 * K, 1: 18 * K, 2: 28 * K}

    def peak(phase, layer, mb):
        return (forward if phase == FORWARD else backward)[layer] if mb == 0 else 0

    room = peaks.room.calibrated(peak, list(peaks._probes.values()), {})
    assert room.forward_per_token == pytest.approx(10 * 1.05)    # 1 KB / 100 copies
    assert room.backward_per_token == pytest.approx(20 * 1.05)   # 2 KB / 100 copies


@pytest.mark.parametrize("expert_rise, slope", [(3 * K, 10.0), (9 * K, 90.0)])
def test_a_forward_peak_from_before_the_decisions_eviction_is_not_read(expert_rise, slope):
    """Layer 1 decides at 20 KB in use (its attention part's peak so far: 21 KB) and moves
    4 KB of layer 0 to host before its expert path runs. A path rising 3 KB above the
    16 KB left never reaches 21 KB: the position's peak is the attention's, and says
    nothing of the path (read, it would give 50 per copy); layer 0's 1 KB / 100 copies
    stands. A path rising 9 KB sets the peak, and is read against the 16 KB: 90."""
    peaks = LayerPeaks(LayerRoom(1.0, 1.0), num_layers=2)
    peaks.record(0, 0, 10 * K, num_routed=100, grads_to_come=0, position_peak=10 * K)
    peaks.record(0, 1, 20 * K, num_routed=100, grads_to_come=0, position_peak=21 * K)
    peaks.evicted(0, 1, 0, 4 * K)
    forward = {0: 11 * K, 1: max(21 * K, 16 * K + expert_rise)}

    def peak(phase, layer, mb):
        return forward[layer] if phase == FORWARD else 12 * K

    room = peaks.room.calibrated(peak, list(peaks._probes.values()), {})
    assert room.forward_per_token == pytest.approx(slope * 1.05)


def _step(model, guard):
    with guard.step():
        for tokens_BT in BATCHES:
            model(tokens_BT[:, :-1], tokens_BT[:, 1:]).loss.backward()
    model.zero_grad(set_to_none=True)
    return guard.history[-1]


def _slope_after(budget, steps=3):
    model = build_model(CFG, seed=0)
    guard = spikeguard.attach(model, budget=budget, policy="adaptive")
    records = [_step(model, guard) for _ in range(steps)]
    return guard.layer_room.room.forward_per_token, records


@pytest.mark.parametrize("fraction", [0.9, 0.8])
def test_the_forward_slope_under_eviction_is_the_calm_one(fraction):
    """The same model and data, every step alike: the forward slope calibrated where the
    guard evicts is the one calibrated where it keeps everything and evicts nothing."""
    probe = build_model(CFG, seed=0)
    peak = _step(probe, spikeguard.attach(probe, budget="1GiB", policy="none"))["peak_bytes"]
    calm, calm_records = _slope_after(1 << 30)
    assert all(r["evicted_bytes"] == 0 for r in calm_records)
    tight, records = _slope_after(int(fraction * peak))
    assert records[-1]["evicted_bytes"] > 0
    assert all(r["peak_bytes"] <= r["budget_bytes"] for r in records)
    assert tight == pytest.approx(calm, rel=0.01), (tight, calm)
