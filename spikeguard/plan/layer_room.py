"""The two peaks of a MoE layer that no plan of its own changes, and their calibration.

Inside a layer's forward the expert path holds all its tensors at once, whatever the plan
(a recomputed or offloaded tensor is still computed, and lives until its consumer ran):
the per-expert GEMM outputs before their concatenation, the hidden activations, the
output. In the layer's backward every tensor of the path is back on the device (saved,
recomputed, or reloaded) while its activation gradients are made, beside what the layers
below still keep, the gradients of the parameters not yet allocated, and the attention
part's own gradients. A plan only decides what stays *between* the two; these two peaks
can only be made to fit by taking bytes of the layers below off the device (eviction to
host), which is what the window asks for when they would not fit (plan/room.py,
`layer_shortfall_bytes`).

Both are modelled as bytes in use at the decision + a per-routed-token slope (+ in
backward the gradients still to come, and the attention part's gradients, taken as large
as what that part keeps). The slopes start from the shapes (conservative: every tensor of
the path at once, its gradient as large again) and are then set, after every step, from
the peak the device really reached in that layer, phase and micro-batch, with a 5% margin:
the runtime's figure is corrected by the allocator's. Under a pipeline the device's
backward peak also holds the micro-batches the schedule ran between the decision and that
backward (on stage 0 of 2 under 1F1B: the whole next micro-batch); they are taken out
(`Probe.others_added`), or the slope counted them and the forecast reserved them again
(measured on PP=2 x EP=2, `small`, stage 0: 25.6 KB per routed copy where the layers'
own came to 8.2 KB; every other step then recomputed the second micro-batch's layers
whole). The head's backward (the logits'
gradient beside the logits) is a slope per token of the micro-batch, calibrated the same
way. One arithmetic for the runtime (spikeguard/runtime/layer_room.py keeps its probes)
and the simulator (spikeguard/sim/walk.py): pure, frozen values.

Two terms of a layer's backward no per-token slope carries, both per-layer constants
whatever the load: the experts' weight gradients. Once they exist (any backward after the
step's first) each backward makes a fresh one beside them before adding it in
(`expert_grad_bytes`: the largest of the local experts' weights, all of them); and made
per expert (runtime/executor.py's stages), each expert's is a full-size tensor summed into
the one before, so one more copy and one expert's slice of it are alive at each sum
(`expert_grad_sum_bytes`; 0 for a grouped GEMM that writes them in place). A calibrated
slope has both already (it was read off the device's peaks); the shapes' slopes did not,
which is why, on CUDA (never calibrated), every step's backward overflowed at scale on the
first stages before they were counted (docs/simulator.md). A layer recomputed whole
(decided at its entry, runtime/window.py `layer_cannot_fit`) comes back whole in its
backward, as it was at its decision, then runs its backward as any layer
(`whole_backward`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Mapping, Sequence

MARGIN = 1.05
FORWARD, BACKWARD = "forward", "backward"
# The device tells micro-batches apart modulo this many (its peaks per position: the
# runtime's spikeguard/runtime/device_state.py where_code; the simulator aliases alike).
MICRO_BATCH_CODES = 4

# peak(phase, layer, micro_batch) -> the step's largest bytes in use there (0: none seen)
PeakAt = Callable[[str, int, int], int]


@dataclass(frozen=True)
class Probe:
    """What the window knew at one decision: the base the device's peaks are read against."""

    micro_batch: int
    layer: int
    in_use: int
    num_routed: int
    grads_to_come: int
    layer_part: int = 0
    # Pipeline: what the other micro-batches of the stage hold at this layer's backward
    # beyond what they held at the decision (the forwards the schedule ran in between,
    # less the backwards). The device's peak there includes them; the layer's own
    # working set is read net of them, since the forecast reserves them apart (the
    # schedule's `at_backward` forwards, the older ones' pending backward).
    others_added: int = 0
    # Bytes beside the layer's own in its backward that the byte model has apart, per
    # layer and not per routed copy (FSDP2's prefetched and unsharded gradients,
    # plan/fsdp_bytes.py): read off the peak before the slope, so calibration does not
    # spread a constant over the routed copies of one load.
    fixed: int = 0
    # Bytes of the layers below that went to host after this layer's forward ran (later
    # layers' evictions): its backward will not find them on the device, its forward peak
    # did. Off the backward's base only: taken off both, every eviction at a later layer
    # raised the forward slope it was read against by the bytes evicted, which made the
    # next step evict more (`small` at 0.85x: 19.1 KB per routed copy read where the
    # device's peaks give 7.9, and 61 MiB evicted a step where ~17 would have done).
    evicted_later: int = 0
    # Bytes of the layers below that this layer's own decision moved to host before its
    # expert path ran (`in_use` is after them), and the device's peak at the layer's
    # forward position when it decided (its attention part's, which ran before them).
    # Where the forward peak is no higher than that, the expert path never set it, and
    # read against `in_use` it counts the bytes evicted as the path's (14% more per
    # routed copy than calm steps on `tiny` at 0.8x): such a probe says nothing of the
    # forward slope.
    evicted_first: int = 0
    forward_peak_before: int = 0


@dataclass(frozen=True)
class LayerRoom:
    forward_per_token: float
    backward_per_token: float
    # The head's backward, beyond what the head keeps, per token of the micro-batch.
    head_backward_per_token: float = 0.0
    observed: bool = False
    # The experts' weight gradients in a layer's backward (see the module doc).
    expert_grad_bytes: int = 0
    expert_grad_sum_bytes: int = 0

    @staticmethod
    def from_shape(bytes_per_token: Mapping[str, int], logit_bytes: float = 0.0,
                   expert_grads: tuple[int, int] = (0, 0)) -> "LayerRoom":
        """Slopes before any step measured them: the expert path's tensors all at once, the
        per-expert GEMM pieces doubling the largest in forward, the gradients as large
        again in backward; the head's backward two logits per token."""
        path = sum(v for op, v in bytes_per_token.items() if op != "dispatch")
        return LayerRoom(forward_per_token=float(path + max(bytes_per_token.values())),
                         backward_per_token=float(2 * path),
                         head_backward_per_token=2 * logit_bytes,
                         expert_grad_bytes=expert_grads[0],
                         expert_grad_sum_bytes=expert_grads[1])

    def needs(self, in_use: int, num_routed: int, grads_to_come: int,
              layer_part: int = 0, fixed: tuple[int, int] = (0, 0)) -> tuple[int, int]:
        """(forward peak, backward peak) of the layer about to run, in device bytes.
        `fixed`: (during the layer's backward compute, at its end) bytes the byte model
        has apart (FSDP2's, plan/fsdp_bytes.py `layer_backward`); the second is a peak of
        its own, once the layer's activation gradients are gone."""
        forward = in_use + int(self.forward_per_token * num_routed)
        backward = (in_use + grads_to_come + layer_part + fixed[0]
                    + int(self.backward_per_token * num_routed) + self._expert_grads(grads_to_come))
        return forward, max(backward, in_use + grads_to_come + fixed[1])

    def _expert_grads(self, grads_to_come: int) -> int:
        """The experts' weight gradients in the layer's backward (see the module doc),
        unless a calibrated slope holds them: a fresh one beside those that exist (none
        to come: not the step's first backward), and the per-expert sums."""
        if self.observed:
            return 0
        return (0 if grads_to_come > 0 else self.expert_grad_bytes) + self.expert_grad_sum_bytes

    def whole_backward(self, entry_in_use: int, layer_part: int, num_routed: int,
                       grads_to_come: int, fixed: tuple[int, int] = (0, 0)) -> int:
        """The backward peak, in device bytes, of a layer recomputed whole from its entry
        (`entry_in_use`: before its attention ran): it comes back as it was at its decision
        (its attention and router part), then its backward runs as any layer's."""
        return self.needs(entry_in_use + layer_part, num_routed, grads_to_come, layer_part,
                          fixed)[1]

    def calibrated(self, peak: PeakAt, probes: Sequence[Probe],
                   head_probes: Mapping[tuple[int, int], tuple[int, ...]]) -> "LayerRoom":
        """The slopes one step's peaks imply: for each probe, the peak its layer reached
        in forward and in backward against the in-use the window saw (max over layers and
        micro-batches, 5% margin); `head_probes[(head layer, micro-batch)]` = (in use when
        the head's backward starts, tokens[, bytes beside it the byte model has apart]).
        Unchanged where nothing was seen."""
        fwd = bwd = 0.0
        for p in probes:
            if p.num_routed <= 0:
                continue
            f_peak = peak(FORWARD, p.layer, p.micro_batch)
            b_peak = peak(BACKWARD, p.layer, p.micro_batch)
            if f_peak and not (p.evicted_first and f_peak <= p.forward_peak_before):
                fwd = max(fwd, (f_peak - p.in_use) / p.num_routed)
            if b_peak:
                bwd = max(bwd, (b_peak - (p.in_use - p.evicted_later) - p.others_added
                                - p.grads_to_come - p.layer_part - p.fixed) / p.num_routed)
        head = 0.0
        for (layer, mb), (in_use, num_tokens, *fixed) in head_probes.items():
            reached = peak(BACKWARD, layer, mb)
            if reached and num_tokens:
                head = max(head, (reached - in_use - sum(fixed)) / num_tokens)
        out = self
        if head > 0:
            out = replace(out, head_backward_per_token=head * MARGIN)
        if fwd > 0 and bwd > 0:
            out = replace(out, forward_per_token=fwd * MARGIN, backward_per_token=bwd * MARGIN,
                          observed=True)
        return out



def expert_grads(largest_weight_bytes: int, num_local_experts: int,
                 summed_per_expert: bool = True) -> tuple[int, int]:
    """`LayerRoom.from_shape`'s `expert_grads` for experts whose largest weight (all local
    experts together) is `largest_weight_bytes`: (the fresh gradient, the sums' extra copy
    and one expert's slice; none for a grouped GEMM or a single expert)."""
    if not summed_per_expert or num_local_experts < 2:
        return largest_weight_bytes, 0
    return largest_weight_bytes, largest_weight_bytes + largest_weight_bytes // num_local_experts
