"""The layer peaks' arithmetic (spikeguard/plan/layer_room.py), which the runtime and the
simulator both call: the shapes' starting slopes and `needs` by hand, and the runtime's
reading of its device's position codes (runtime/layer_room.py) giving the same slopes as
the pure calibration on the same peaks.

    .venv/bin/python -m pytest tests/plan/test_plan_layer_room.py -q
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from spikeguard.plan.catalogue import ExpertShape
from spikeguard.plan.layer_room import (BACKWARD, FORWARD, MARGIN, MICRO_BATCH_CODES,
                                        LayerRoom, Probe, expert_grads)
from spikeguard.runtime.device_state import HEAD_LAYER, PHASE_BACKWARD, PHASE_FORWARD, where_code
from spikeguard.runtime.layer_room import LayerPeaks

SHAPE = ExpertShape(d_model=128, d_expert=256, combine_after_exchange=True)
LOGIT = 256 * 4.0
LAYERS = 4


def test_the_shapes_slopes_and_needs_by_hand():
    per = SHAPE.bytes_per_token()   # dispatch 512, gate_up 2048, silu 1024, act 1024, down 0, combine 8
    path = 2048 + 1024 + 1024 + 0 + 8
    room = LayerRoom.from_shape(per, LOGIT)
    assert (room.forward_per_token, room.backward_per_token) == (path + 2048, 2 * path)
    assert room.head_backward_per_token == 2 * LOGIT and not room.observed
    assert room.needs(1000, 10, 300, 50) == (1000 + 10 * (path + 2048),
                                             1000 + 300 + 50 + 10 * 2 * path)



def test_the_experts_weight_gradients_in_the_shapes_backward():
    """The experts' largest weight w (all local experts): summed per expert, one more copy
    and one expert's slice at each sum; once the gradients exist (none to come), a fresh
    one beside them too. A grouped GEMM only the fresh one. A calibrated slope has them."""
    w, e = 8 << 20, 4
    assert expert_grads(w, e) == (w, w + w // e)
    assert expert_grads(w, e, summed_per_expert=False) == (w, 0) == expert_grads(w, 1)
    per = SHAPE.bytes_per_token()
    plain = LayerRoom.from_shape(per, LOGIT)
    room = LayerRoom.from_shape(per, LOGIT, expert_grads(w, e))
    first = plain.needs(1000, 10, 300, 50)[1]
    later = plain.needs(1000, 10, 0, 50)[1]
    assert room.needs(1000, 10, 300, 50) == (plain.needs(1000, 10, 300, 50)[0], first + w + w // e)
    assert room.needs(1000, 10, 0, 50)[1] == later + w + w + w // e
    # recomputed whole: back as at its decision (entry + attention part), then its backward
    assert room.whole_backward(1000, 50, 10, 0) == room.needs(1050, 10, 0, 50)[1]
    assert replace(room, observed=True).needs(1000, 10, 0, 50)[1] == later

def test_a_step_sets_the_slopes_from_the_peaks_it_reached():
    room = LayerRoom.from_shape(SHAPE.bytes_per_token(), LOGIT)
    probes = [Probe(0, 1, in_use=1000, num_routed=10, grads_to_come=200, layer_part=100)]
    peaks = {(FORWARD, 1, 0): 1500, (BACKWARD, 1, 0): 2300, (BACKWARD, LAYERS, 0): 5000}
    out = room.calibrated(lambda p, ly, mb: peaks.get((p, ly, mb), 0), probes,
                          {(LAYERS, 0): (4000, 100)})
    assert out.forward_per_token == 50 * MARGIN             # (1500 - 1000) / 10
    assert out.backward_per_token == 100 * MARGIN           # (2300 - 1000 - 200 - 100) / 10
    assert out.head_backward_per_token == 10 * MARGIN       # (5000 - 4000) / 100
    assert out.observed
    # Nothing seen: nothing changes.
    assert room.calibrated(lambda *a: 0, probes, {}) == room


class _Meter:
    def __init__(self, peaks: dict):
        phase = {FORWARD: PHASE_FORWARD, BACKWARD: PHASE_BACKWARD}
        self.by_code = {where_code(phase[p], layer, mb): v for (p, layer, mb), v in peaks.items()}

    def where_peak(self, code: int) -> int:
        return self.by_code.get(code, 0)


def test_the_runtime_reads_its_device_as_the_pure_calibration_does():
    rng = random.Random(0)
    for trial in range(20):
        peaks, probes, heads = {}, [], {}
        for mb in range(rng.randint(1, 6)):
            for layer in range(LAYERS):
                in_use = rng.randint(10**6, 5 * 10**7)
                probes.append(Probe(mb, layer, in_use, rng.randint(0, 4096),
                                    rng.choice((0, 15_000_000)), rng.randint(0, 6 * 10**6)))
                for phase in (FORWARD, BACKWARD):
                    key = (phase, layer, mb % MICRO_BATCH_CODES)
                    peaks[key] = max(peaks.get(key, 0), in_use + rng.randint(0, 3 * 10**7))
            # the head's position is HEAD_LAYER, apart from every (global) layer number
            heads[(HEAD_LAYER, mb)] = (rng.randint(10**7, 6 * 10**7), 1024)
            key = (BACKWARD, HEAD_LAYER, mb % MICRO_BATCH_CODES)
            peaks[key] = max(peaks.get(key, 0), heads[(HEAD_LAYER, mb)][0] + rng.randint(0, 4 * 10**6))
        start = LayerRoom.from_shape(SHAPE.bytes_per_token(), LOGIT)
        runtime = LayerPeaks(start, LAYERS)
        for p in probes:
            runtime.record(p.micro_batch, p.layer, p.in_use, p.num_routed, p.grads_to_come,
                           p.layer_part)
        for (_, mb), (in_use, tokens) in heads.items():
            runtime.record_head(mb, in_use, tokens)
        runtime.calibrate(_Meter(peaks))
        pure = start.calibrated(
            lambda p, ly, mb: peaks.get((p, ly, mb % MICRO_BATCH_CODES), 0), probes, heads)
        assert runtime.room == pure, trial


def test_a_pipeline_stages_backward_slope_is_read_net_of_the_other_micro_batches():
    """Stage 0 of PP=2 (1F1B: F0 F1 B0 B1): micro-batch 0's layer decided at 19 MB in use;
    by its backward the schedule had run micro-batch 1's forward, 20 MB more, which the
    device's peak there (48 MB) holds. The layer's own working set is 48 - 19 - 20 - 2
    (gradients) - 3 (attention part) = 4 MB over 1000 copies; read against the decision's
    in-use alone it was 24 MB, and the forecast then reserved micro-batch 1 again."""
    room = LayerRoom.from_shape(SHAPE.bytes_per_token(), LOGIT)
    M = 1_000_000
    probe = Probe(0, 1, in_use=19 * M, num_routed=1000, grads_to_come=2 * M,
                  layer_part=3 * M, others_added=20 * M)
    peaks = {(FORWARD, 1, 0): 25 * M, (BACKWARD, 1, 0): 48 * M}
    out = room.calibrated(lambda p, ly, mb: peaks.get((p, ly, mb), 0), [probe], {})
    assert out.backward_per_token == pytest.approx(4000 * MARGIN)
    # the runtime's probes: the other micro-batches' bytes at the decision (5 MB) and when
    # backward reaches the layer (25 MB) give the same slope
    runtime = LayerPeaks(room, LAYERS)
    runtime.record(0, 1, 19 * M, 1000, 2 * M, 3 * M, others=5 * M)
    runtime.backward_starts(0, 1, others=25 * M)
    runtime.backward_starts(3, 1, others=99 * M)     # no probe there: nothing changes
    runtime.calibrate(_Meter(peaks))
    assert runtime.room == out
