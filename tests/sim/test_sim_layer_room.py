"""The simulator's copy of the runtime's layer-peak arithmetic gives the runtime's figures.

spikeguard/sim/layer_room.py mirrors spikeguard/runtime/layer_room.py (the simulator does
not import the runtime): the shapes' starting slopes, `needs`, and the calibration from
per-position peaks and the window's probes must agree number for number, so that a change
on one side fails here until the other follows.
"""

from __future__ import annotations

import random

from spikeguard.plan.catalogue import ExpertShape
from spikeguard.runtime.device_state import PHASE_BACKWARD, PHASE_FORWARD, where_code
from spikeguard.runtime.layer_room import LayerRoom as RuntimeRoom
from spikeguard.sim.layer_room import BACKWARD, FORWARD, LayerRoom, Probe

SHAPE = ExpertShape(d_model=128, d_expert=256, combine_after_exchange=True)
LOGIT = 256 * 4.0
LAYERS = 4


class _Meter:
    def __init__(self, peaks: dict):
        phase = {FORWARD: PHASE_FORWARD, BACKWARD: PHASE_BACKWARD}
        self.by_code = {where_code(phase[p], layer, mb): v for (p, layer, mb), v in peaks.items()}

    def where_peak(self, code: int) -> int:
        return self.by_code.get(code, 0)


def _same(sim: LayerRoom, runtime: RuntimeRoom) -> None:
    assert sim.forward_per_token == runtime.forward_per_token
    assert sim.backward_per_token == runtime.backward_per_token
    assert sim.head_backward_per_token == runtime.head_backward_per_token
    assert sim.observed == runtime.observed


def test_the_shapes_slopes_and_needs_are_the_runtimes():
    sim = LayerRoom.from_shape(SHAPE, LOGIT)
    runtime = RuntimeRoom.from_shape(SHAPE.bytes_per_token(), LOGIT, LAYERS)
    _same(sim, runtime)
    for args in ((10_000_000, 2048, 0, 0), (55_000_000, 3100, 15_553_024, 5_361_664)):
        assert sim.needs(*args) == runtime.needs(*args)


def test_a_calibration_is_the_runtimes():
    rng = random.Random(0)
    for trial in range(20):
        peaks, probes, heads = {}, [], {}
        for mb in range(rng.randint(1, 6)):
            for layer in range(LAYERS):
                in_use = rng.randint(10**6, 5 * 10**7)
                probes.append(Probe(mb, layer, in_use, rng.randint(0, 4096),
                                    rng.choice((0, 15_000_000)), rng.randint(0, 6 * 10**6)))
                for phase in (FORWARD, BACKWARD):
                    key = (phase, layer, mb % 4)
                    peaks[key] = max(peaks.get(key, 0), in_use + rng.randint(0, 3 * 10**7))
            heads[(LAYERS, mb)] = (rng.randint(10**7, 6 * 10**7), 1024)
            key = (BACKWARD, LAYERS, mb % 4)
            peaks[key] = max(peaks.get(key, 0), heads[(LAYERS, mb)][0] + rng.randint(0, 4 * 10**6))
        runtime = RuntimeRoom.from_shape(SHAPE.bytes_per_token(), LOGIT, LAYERS)
        for p in probes:   # the runtime keeps the last probe of a (micro-batch, layer)
            runtime.record(p.micro_batch, p.layer, p.in_use, p.num_routed, p.grads_to_come,
                           p.layer_part)
        for (_, mb), (in_use, tokens) in heads.items():
            runtime.record_head(mb, in_use, tokens)
        runtime.calibrate(_Meter(peaks))
        sim = LayerRoom.from_shape(SHAPE, LOGIT).calibrated(peaks, probes, heads)
        _same(sim, runtime)
