"""The runtime's layer peaks (spikeguard/runtime/layer_room.py), for the simulated window.

The runtime's decision window checks each layer's own forward and backward peak, in use at
the decision + a slope x routed copies (+ gradients not yet allocated), and reserves the
head's backward in its forecast. The slopes start from the shapes and, on the emulated
device, are set after every step from the peaks the device reached per (phase, layer)
against the in-use the window probed (5% margin); on CUDA the device keeps no such peaks,
so they stay at the shapes'. This is the same arithmetic on the simulated device's figures
(sim/walk.py records the same per-(phase, layer) peaks and probes), kept as a frozen value
so that a memoised walk can key on it. It mirrors runtime code that the simulator may not
import; tests/sim/test_sim_layer_room.py checks both give the same figures. (Proposed:
move the runtime's arithmetic to spikeguard/plan/, and both import it from there.)
Mirrors the runtime as of commit eb9b8f6.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from spikeguard.plan.catalogue import ExpertShape

MARGIN = 1.05
FORWARD, BACKWARD = "F", "B"
MICRO_BATCH_CODES = 4   # runtime/device_state.py: micro-batches told apart, modulo


@dataclass(frozen=True)
class Probe:
    micro_batch: int
    layer: int
    in_use: int
    num_routed: int
    grads_to_come: int
    layer_part: int = 0


@dataclass(frozen=True)
class LayerRoom:
    forward_per_token: float
    backward_per_token: float
    head_backward_per_token: float = 0.0
    observed: bool = False

    @staticmethod
    def from_shape(shape: ExpertShape, logit_bytes: float) -> "LayerRoom":
        per = shape.bytes_per_token()
        path = sum(v for op, v in per.items() if op != "dispatch")
        return LayerRoom(float(path + max(per.values())), float(2 * path), 2 * logit_bytes)

    def needs(self, in_use: int, num_routed: int, grads_to_come: int,
              layer_part: int = 0) -> tuple[int, int]:
        """(forward peak, backward peak) of the layer about to run, in device bytes (the
        backward also makes the attention part's gradients, taken as large as the part)."""
        return (in_use + int(self.forward_per_token * num_routed),
                in_use + grads_to_come + layer_part + int(self.backward_per_token * num_routed))

    def calibrated(self, peaks: dict, probes: list[Probe], head_probes: dict) -> "LayerRoom":
        """The runtime's `LayerRoom.calibrate` on one step's figures: `peaks[(phase,
        layer, micro-batch modulo 4)]` the step's largest in-use there (the runtime's
        position codes), `probes` the window's, `head_probes[(layer, micro-batch modulo
        4)]` = (in use when the head's backward starts, tokens), the last per micro-batch."""
        fwd = bwd = 0.0
        for p in probes:
            if p.num_routed <= 0:
                continue
            f_peak = peaks.get((FORWARD, p.layer, p.micro_batch % MICRO_BATCH_CODES), 0)
            b_peak = peaks.get((BACKWARD, p.layer, p.micro_batch % MICRO_BATCH_CODES), 0)
            if f_peak:
                fwd = max(fwd, (f_peak - p.in_use) / p.num_routed)
            if b_peak:
                bwd = max(bwd, (b_peak - p.in_use - p.grads_to_come - p.layer_part)
                          / p.num_routed)
        head = 0.0
        for (layer, mb), (in_use, num_tokens) in head_probes.items():
            reached = peaks.get((BACKWARD, layer, mb % MICRO_BATCH_CODES), 0)
            if reached and num_tokens:
                head = max(head, (reached - in_use) / num_tokens)
        out = self
        if head > 0:
            out = replace(out, head_backward_per_token=head * MARGIN)
        if fwd > 0 and bwd > 0:
            out = replace(out, forward_per_token=fwd * MARGIN, backward_per_token=bwd * MARGIN,
                          observed=True)
        return out
