"""FSDP2's bytes in the byte model: when its gathered parameters and reduce buffers are alive.

FSDP2 units run in a fixed order (embedding, blocks, norm and head; spikeguard/runtime/
fsdp.py reads each one's real sizes). Measured on the emulated device (torch 2.13, gloo,
one rank and two; tests/runtime/test_runtime_fsdp_bytes.py), a unit's life is:

  * forward: its unsharded parameters are gathered at its entry and freed after its
    forward, unless it does not reshard after forward (torchtitan's norm and head, and
    the root): those stay until their backward is done;
  * backward of unit u: its parameters are gathered again (the in-use the window saw
    at u's decision had them), the unit before it in forward order is all-gathered too
    (FSDP2's backward prefetch, issued in u's pre-backward), u's unsharded gradients are
    made, and the reduce-scatter input of the unit reduced just before (the one after u in
    forward order) is still kept, until u's own reduce (one buffer in flight, FSDP2's
    default `reduce_scatter_max_input_buffers`);
  * u's reduce: its parameters are freed first (resharded), then its unsharded gradients,
    the padded reduce-scatter input and the sharded output are alive together.

So above the in-use of u's decision, u's backward holds
    during its compute:  prefetched(before u) + unsharded grads(u) + kept input(after u)
    at its reduce:       prefetched(before u) + unsharded grads(u) + input(u) + output(u)
                         - gathered(u)
and the forward, at a decision in guarded layer L, will still add
    the gathered parameters of the later units that stay gathered (the head's)
    + what the head's FSDP2 phase adds beyond the head's own backward reserve
    - gathered(L) if L reshards after forward.
The head's backward has two phases that are not alive at once (traced op by op on
torchtitan's deepseek_v3 debug model, one rank, torch 2.13): first the loss's backward,
where the log-probabilities' gradient and the logits' gradient are made (two logits per
token above the head's start: its peak there), before FSDP2's pre-backward of the head
has run; then the head's own backward, where the previous unit is prefetched and the
head's unsharded gradients are made, while only the logits' gradient is left of the
first phase. So the head's peak is the larger of the two, never their sum: the first is
the head's per-token reserve (plan/layer_room.py `head_backward_per_token`, which the
forecast counts), the second is one logit per token + `head_backward()`, and only its
excess over the first is FSDP2's (`forward_to_come`). Added to the reserve instead, the
uncalibrated first step counted the head's prefetch and gradients twice (113 KiB on that
model) and found no plan at layer 0 under torchtitan's EP at 0.05 of the way from full
recompute's peak to the all-saved one; the calibration then read the head's slope net of
a term that was not in its peak. The compute term of a layer's backward sits beside the
layer's per-routed-token slope (plan/layer_room.py) and is taken out of the device's
peaks before the slope is read, so that calibration learns the activations' part alone.
Pure numbers, frozen values.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class FsdpUnit:
    """One FSDP2 unit (one `fully_shard` call's state), its bytes on this rank."""

    layer: Optional[int]          # the guarded layer it belongs to, None for the others
    unsharded_bytes: int          # gathered parameters (compute dtype); also their grads
    reduce_input_bytes: int       # padded unsharded gradients, flat, reduce dtype
    reduce_output_bytes: int      # the sharded gradients, reduce dtype
    reshard_after_forward: bool = True


@dataclass(frozen=True)
class FsdpBytes:
    """The units of one model in forward order, and what they add at each point."""

    units: tuple[FsdpUnit, ...] = ()

    @property
    def active(self) -> bool:
        return bool(self.units)

    @functools.cached_property
    def _last_unit(self) -> dict[Optional[int], int]:
        """Guarded layer -> the position of its last unit (a layer with no unit has no
        key), worked out once: every decision asks."""
        return {u.layer: i for i, u in enumerate(self.units)}

    def _gathered(self, i: Optional[int]) -> int:
        return self.units[i].unsharded_bytes if i is not None and 0 <= i < len(self.units) else 0

    def _kept_input(self, i: int) -> int:
        return self.units[i + 1].reduce_input_bytes if i + 1 < len(self.units) else 0

    def unit_backward(self, i: int) -> tuple[int, int]:
        """(during compute, at its reduce): bytes unit i's backward holds above the in-use
        that had its parameters gathered (see the module doc)."""
        u = self.units[i]
        prefetched = self._gathered(i - 1) if i > 0 else 0
        compute = prefetched + u.unsharded_bytes + self._kept_input(i)
        reduce = (prefetched + u.unsharded_bytes + u.reduce_input_bytes
                  + u.reduce_output_bytes - u.unsharded_bytes)
        return compute, reduce

    def layer_backward(self, layer: int) -> tuple[int, int]:
        """`unit_backward` of guarded `layer`'s unit; (0, 0) where it has none."""
        i = self._last_unit.get(layer)
        return self.unit_backward(i) if i is not None else (0, 0)

    def head_backward(self) -> int:
        """The head's backward, during its compute, above the in-use when it starts (its
        parameters are still gathered then): the last unit before the root."""
        i = self._head_index()
        return self.unit_backward(i)[0] if i is not None else 0

    def _head_index(self) -> Optional[int]:
        """The last unit that is not the root's (the root is the last, without a layer:
        it holds what no other unit took, often nothing)."""
        candidates = [i for i, u in enumerate(self.units) if u.layer is None and u.unsharded_bytes]
        last_layer = max((i for i, u in enumerate(self.units) if u.layer is not None), default=-1)
        after = [i for i in candidates if i > last_layer]
        return after[0] if after else None

    def forward_to_come(self, layer: int, head_reserve_bytes: int = 0,
                        logit_grad_bytes: int = 0) -> int:
        """What FSDP2 will add, above the in-use at a decision in guarded `layer`, by the
        head's backward peak (see the module doc): `head_reserve_bytes`, the head's own
        backward reserve the forecast already counts; `logit_grad_bytes`, the logits'
        gradient still alive in the head's FSDP2 phase. Never negative."""
        i = self._last_unit.get(layer)
        if i is None:
            return 0
        kept = sum(u.unsharded_bytes for u in self.units[i + 1:] if not u.reshard_after_forward)
        freed = self.units[i].unsharded_bytes if self.units[i].reshard_after_forward else 0
        head = max(0, self.head_backward() + logit_grad_bytes - head_reserve_bytes)
        return max(0, kept + head - freed)
