"""The guard's side of the layer peaks (spikeguard/plan/layer_room.py): its probes, and
the device's peaks per position that calibrate the slopes after every step.

The arithmetic (the peaks a layer's own plan cannot change, and the slopes one step's
peaks imply) is plan/layer_room.py's, which the simulator calls too. Here: what the window
saw at each decision and when each head's backward started, read against the emulated
device's peak per (phase, layer, micro-batch modulo 4) position (`meter.where_peak`; on
CUDA the device keeps none, so the slopes stay the shapes').
"""

from __future__ import annotations

from dataclasses import replace

from torch import nn

from spikeguard.plan.fsdp_bytes import FsdpBytes
from spikeguard.plan.layer_room import BACKWARD, FORWARD, LayerRoom, Probe, expert_grads
from spikeguard.runtime.device_state import HEAD_LAYER, PHASE_BACKWARD, PHASE_FORWARD, where_code

_PHASES = {FORWARD: PHASE_FORWARD, BACKWARD: PHASE_BACKWARD}


def expert_weight_grads(blocks) -> tuple[int, int]:
    """plan.layer_room.expert_grads for the first MoE block's experts: their largest 3-D
    parameter (E x ..., all local experts; the local shard of a sharded one), summed per
    expert as the built-in executor makes them; (0, 0) where the experts hold no stacked
    weight (calibration then finds them, on the emulated device)."""
    from spikeguard.memory.ledger import local_tensor

    experts = getattr(blocks[0], "experts", None) if blocks else None
    weights = [local_tensor(p.detach()) for p in experts.parameters()] if experts is not None else []
    weights = [w for w in weights if w.dim() == 3]
    if not weights:
        return 0, 0
    largest = max(weights, key=lambda w: w.numel() * w.element_size())
    return expert_grads(largest.numel() * largest.element_size(), largest.shape[0])


def head_logit_bytes(model: nn.Module) -> float:
    """Bytes of one token's logits (the last Linear's output): the head's backward starts
    by making their gradient, beside the logits and log-probabilities still alive."""
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    if not linears:
        return 0.0
    head = linears[-1]
    return float(head.out_features * head.weight.element_size())


class LayerPeaks:
    """The slopes in use (`room`, a frozen plan.layer_room.LayerRoom) and this step's probes."""

    def __init__(self, room: LayerRoom, num_layers: int, fsdp: FsdpBytes = FsdpBytes(),
                 logit_bytes: float = 0.0):
        self.room = room
        self.num_layers = num_layers
        self.fsdp = fsdp   # FSDP2's units (empty without FSDP2): their bytes apart
        self.logit_bytes = logit_bytes   # one token's logits (`head_logit_bytes`)
        self._probes: dict[tuple[int, int], Probe] = {}
        self._head_probes: dict[tuple[int, int], tuple[int, int]] = {}
        self._others: dict[tuple[int, int], int] = {}   # (mb, layer) -> at the decision

    def needs(self, in_use: int, num_routed: int, grads_to_come: int,
              layer_part: int = 0, layer: int = -1) -> tuple[int, int]:
        return self.room.needs(in_use, num_routed, grads_to_come, layer_part,
                               self.fsdp.layer_backward(layer))

    def whole_backward(self, entry_in_use: int, layer_part: int, num_routed: int,
                       grads_to_come: int, layer: int = -1) -> int:
        return self.room.whole_backward(entry_in_use, layer_part, num_routed, grads_to_come,
                                        self.fsdp.layer_backward(layer))

    @property
    def head_backward_per_token(self) -> float:
        return self.room.head_backward_per_token

    def no_head(self) -> None:
        """This model chunk has no head (a pipeline stage before the last)."""
        self.room = replace(self.room, head_backward_per_token=0.0)

    def record(self, micro_batch: int, layer: int, in_use: int, num_routed: int,
               grads_to_come: int, layer_part: int = 0, others: int = 0,
               position_peak: int = 0) -> None:
        """`others`: the bytes of the other micro-batches on the device at the decision;
        `position_peak`: the device's peak at this layer's forward position so far."""
        self._probes[(micro_batch, layer)] = Probe(
            micro_batch, layer, in_use, num_routed, grads_to_come, layer_part,
            fixed=self.fsdp.layer_backward(layer)[0], forward_peak_before=position_peak)
        self._others[(micro_batch, layer)] = others

    def backward_starts(self, micro_batch: int, layer: int, others: int) -> None:
        """Backward reached `layer` of `micro_batch` with `others` bytes of the other
        micro-batches on the device: its probe's base grows by what they added since the
        decision (plan/layer_room.py, Probe.others_added)."""
        key = (micro_batch, layer)
        probe = self._probes.get(key)
        if probe is not None:
            self._probes[key] = replace(probe, others_added=others - self._others[key])

    def evicted(self, micro_batch: int, deciding: int, layer: int, num_bytes: int) -> None:
        """`num_bytes` of `layer` went to host at the decision (or the entry) of layer
        `deciding`: the layers above `layer` will not find them on the device in their
        backward (they come back in `layer`'s own), so their probes' backward base drops by
        as much; read against a base that still counted them, the device's peak would give
        slopes too small by the bytes evicted, which a step that evicts less then runs out
        on (seen: tests/runtime/test_runtime_backward_peak.py at 0.8x, in backward). The
        forward base drops only for `deciding` itself, whose expert path runs after (its
        attention part ran before: plan/layer_room.py `Probe.evicted_first`); the layers
        between had their forward peak with those bytes on the device."""
        for key, probe in self._probes.items():
            if key[0] != micro_batch or key[1] <= layer:
                continue
            if key[1] >= deciding:
                self._probes[key] = replace(probe, in_use=probe.in_use - num_bytes,
                                            evicted_first=probe.evicted_first + num_bytes)
            else:
                self._probes[key] = replace(probe, evicted_later=probe.evicted_later + num_bytes)

    def record_head(self, micro_batch: int, in_use: int, num_tokens: int) -> None:
        """The head's backward starts at `in_use`: its slope is read off the whole peak,
        FSDP2's phase included (plan/fsdp_bytes.py: the two phases are not alive at once,
        so no constant is taken out of it)."""
        self._head_probes[(HEAD_LAYER, micro_batch)] = (in_use, num_tokens)

    def fsdp_forward_to_come(self, layer: int, num_tokens: int) -> int:
        """FSDP2's bytes still to come at a decision in `layer` (plan/fsdp_bytes.py
        `forward_to_come`), beside the head's backward reserve for `num_tokens`."""
        return self.fsdp.forward_to_come(layer, int(self.room.head_backward_per_token * num_tokens),
                                         int(self.logit_bytes * num_tokens))

    def calibrate(self, meter, failed: tuple[int, int] = (0, 0)) -> None:
        """New slopes from this step's peaks, then a fresh step. `failed`: (position code,
        bytes) of an allocation refused in an attempt being abandoned, a peak the device
        never counted but that the slopes must cover."""
        failed_code, failed_bytes = failed

        def peak(phase: str, layer: int, micro_batch: int) -> int:
            code = where_code(_PHASES[phase], layer, micro_batch)
            seen = meter.where_peak(code)
            return max(seen, failed_bytes) if code == failed_code else seen

        self.room = self.room.calibrated(peak, list(self._probes.values()), self._head_probes)
        self._probes.clear()
        self._head_probes.clear()
        self._others.clear()
