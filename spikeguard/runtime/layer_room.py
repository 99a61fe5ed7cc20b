"""The two peaks of a MoE layer that no plan of its own changes, calibrated on the device.

Inside a layer's forward the expert path holds all its tensors at once, whatever the plan
(a recomputed or offloaded tensor is still computed, and lives until its consumer ran):
the per-expert GEMM outputs before their concatenation, the hidden activations, the
output. In the layer's backward every tensor of the path is back on the device (saved,
recomputed, or reloaded) while its activation gradients are made, beside what the layers
below still keep, and the gradients of the parameters not yet allocated. A plan only
decides what stays *between* the two; these two peaks can only be made to fit by taking
bytes of the layers below off the device (eviction to host), which is what the window
asks for when they would not fit.

Both are modelled as bytes in use at the decision + a per-routed-token slope (+ in
backward the gradients still to come, and the attention part's gradients, taken as large
as what that part keeps). The slopes start from the shapes (conservative:
every tensor of the path at once, its gradient as large again) and are then set, after
every step, from the peak the device really reached in that layer and phase, with a 5%
margin: the runtime's figure is corrected by the allocator's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from spikeguard.runtime.device_state import PHASE_BACKWARD, PHASE_FORWARD, where_code

MARGIN = 1.05


@dataclass
class _Probe:
    in_use: int
    num_routed: int
    grads_to_come: int
    layer_part: int


def head_logit_bytes(model: nn.Module) -> float:
    """Bytes of one token's logits (the last Linear's output): the head's backward starts
    by making their gradient, beside the logits and log-probabilities still alive."""
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    if not linears:
        return 0.0
    head = linears[-1]
    return float(head.out_features * head.weight.element_size())


@dataclass
class LayerRoom:
    forward_per_token: float
    backward_per_token: float
    # The head's backward, beyond what the head keeps, per token of the micro-batch.
    head_backward_per_token: float = 0.0
    num_layers: int = 0            # the head's position code is layer `num_layers`
    observed: bool = False
    _probes: dict[tuple[int, int], _Probe] = field(default_factory=dict)
    _head_probes: dict[int, tuple[int, int]] = field(default_factory=dict)

    @staticmethod
    def from_shape(bytes_per_token: dict[str, int], logit_bytes: float = 0.0,
                   num_layers: int = 0) -> "LayerRoom":
        path = sum(v for op, v in bytes_per_token.items() if op != "dispatch")
        # Forward: the GEMM pieces before their `cat` double the largest output.
        largest = max(bytes_per_token.values())
        return LayerRoom(forward_per_token=float(path + largest),
                         backward_per_token=float(2 * path),
                         head_backward_per_token=2 * logit_bytes, num_layers=num_layers)

    def record_head(self, micro_batch: int, in_use_after_forward: int, num_tokens: int) -> None:
        self._head_probes[micro_batch] = (in_use_after_forward, num_tokens)

    def needs(self, in_use: int, num_routed: int, grads_to_come: int,
              layer_part: int = 0) -> tuple[int, int]:
        """(forward peak, backward peak) of the layer about to run, in device bytes. The
        backward also makes the gradients of the layer's attention part, about as large
        as what that part keeps (`layer_part`, measured)."""
        forward = in_use + int(self.forward_per_token * num_routed)
        backward = (in_use + grads_to_come + layer_part
                    + int(self.backward_per_token * num_routed))
        return forward, backward

    def record(self, micro_batch: int, layer: int, in_use: int, num_routed: int,
               grads_to_come: int, layer_part: int = 0) -> None:
        self._probes[(micro_batch, layer)] = _Probe(in_use, num_routed, grads_to_come,
                                                    layer_part)

    def calibrate(self, meter, failed: tuple[int, int] = (0, 0)) -> None:
        """Slopes from what the device reached in each probed layer and micro-batch (the
        device keeps a peak per position and micro-batch modulo 4: beyond 4 resident ones
        a peak may be read against another's probe, which only errs high). `failed`:
        (position code, bytes) of an allocation refused in an attempt that is being
        abandoned, a peak the device never counted but that the slopes must cover."""
        failed_code, failed_bytes = failed

        def peak(code: int) -> int:
            seen = meter.where_peak(code)
            return max(seen, failed_bytes) if code == failed_code else seen

        fwd = bwd = 0.0
        for (mb, layer), p in self._probes.items():
            if p.num_routed <= 0:
                continue
            f_peak = peak(where_code(PHASE_FORWARD, layer, mb))
            b_peak = peak(where_code(PHASE_BACKWARD, layer, mb))
            if f_peak:
                fwd = max(fwd, (f_peak - p.in_use) / p.num_routed)
            if b_peak:
                bwd = max(bwd, (b_peak - p.in_use - p.grads_to_come - p.layer_part)
                          / p.num_routed)
        self._probes.clear()
        head = 0.0
        for mb, (in_use, num_tokens) in self._head_probes.items():
            reached = peak(where_code(PHASE_BACKWARD, self.num_layers, mb))
            if reached and num_tokens:
                head = max(head, (reached - in_use) / num_tokens)
        self._head_probes.clear()
        if head > 0:
            self.head_backward_per_token = head * MARGIN
        if fwd > 0 and bwd > 0:
            self.forward_per_token, self.backward_per_token = fwd * MARGIN, bwd * MARGIN
            self.observed = True
