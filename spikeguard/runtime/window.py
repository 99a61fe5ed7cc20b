"""The decision window: the planner's inputs, gathered where the routed counts are known.

One part of the guard (spikeguard.runtime.guard), and the one place where memory is
decided: `decide` runs in every MoE layer of every micro-batch right after routing;
`layer_cannot_fit` runs at a layer's entry, before its attention. The arithmetic of both
is spikeguard.plan.room's, which the simulator (spikeguard/sim/walk.py) calls too: the
window only reads what its collaborators know into room's plain-number states.

Its collaborators are passed in (ledger, planner, tracker, forecast, layer peaks, the
offload engine's prefetch switch, the open step's recorder); its own state is declared in
`__init__`: what it remembers of earlier decisions (`seen`), the micro-batch it is in
(`num_tokens`, `grads_to_come`, `layer_entry_in_use`), each resident micro-batch's
predicted backward above the in-use its forward left (`pending_backward`; during its own
forward, the largest backward peak predicted so far). An infeasible plan raises at once
(BudgetInfeasible), under expert parallelism too: the net's protocol settles it.
"""

from __future__ import annotations

import functools
import time
from typing import Callable, Optional

import torch

from spikeguard.errors import BudgetInfeasible
from spikeguard.memory.budget import format_bytes
from spikeguard.memory.ledger import Ledger
from spikeguard.plan.catalogue import ALL_OFFLOAD, ALL_SAVE, EXPERTS_RECOMPUTE
from spikeguard.plan.forecast import Forecast
from spikeguard.plan.planner import Decision
from spikeguard.plan.room import (EntryState, Seen, WindowState, backward_above_end,
                                  decision_inputs, entry_estimate,
                                  forward_transient_bytes_per_routed, layer_cannot_fit)
from spikeguard.runtime.history import StepRecorder
from spikeguard.runtime.hooks import Context, SavedTensorTracker
from spikeguard.runtime.layer_room import LayerPeaks
from spikeguard.runtime.offload import OffloadEngine

STATIC_PLANS = {"none": ALL_SAVE, "full": ALL_SAVE, "experts": EXPERTS_RECOMPUTE,
                "offload": ALL_OFFLOAD}


class DecisionWindow:
    """Turns the ledger, the forecast and the counts into a plan, per layer and micro-batch."""

    def __init__(self, *, policy: str, budget_bytes: int, ledger: Ledger, planner, shape,
                 ctx: Context, tracker: SavedTensorTracker, engine: OffloadEngine,
                 forecast: Forecast, layer_room: LayerPeaks, num_layers: int, on_cuda: bool,
                 recorder: Callable[[], Optional[StepRecorder]]):
        self.policy = policy
        self.budget_bytes = budget_bytes
        self.ledger = ledger
        self.planner = planner
        self.shape = shape
        self.ctx = ctx
        self.tracker = tracker
        self.engine = engine
        self.forecast = forecast
        self.layer_room = layer_room
        self.num_layers = num_layers
        self.on_cuda = on_cuda
        self.recorder = recorder   # the open step's recorder, or None outside a step
        # Earlier decisions: the largest routed count of this micro-batch (reset per
        # micro-batch), the largest attention part and routed copies per token (kept).
        self.seen = Seen()
        self.num_tokens = 0
        # Layer -> gradient bytes this micro-batch's backward adds by that layer's backward
        # (its own and the layers' above, and those outside the layers; see the guard).
        self.grads_to_come: dict[int, int] = {}
        self.layer_entry_in_use = 0      # the device's figure at the current layer's entry
        # Micro-batch -> how far its backward is predicted to reach above the in-use at
        # its forward's end, until its backward is done (a pipeline holds several
        # micro-batches; plan/room.py, backward_above_end). During its forward: the
        # largest backward peak predicted so far, in device bytes (`_backward_peak`).
        self.pending_backward: dict[int, int] = {}
        # mb -> (largest backward peak predicted, largest excess over its decision's in-use)
        self._backward_peak: dict[int, tuple[int, int]] = {}

    # ---- what the guard tells the window ----------------------------------------------
    def begin_micro_batch(self, num_tokens: int, grads_to_come: dict[int, int]) -> None:
        self.seen = self.seen.next_micro_batch()
        if self.forecast.residency is not None:   # older micro-batches' backward makes them
            grads_to_come = self.forecast.residency.grads_at_backward(grads_to_come)
        # A new attempt (or a net re-run) of this micro-batch predicts its backward afresh.
        self.pending_backward.pop(self.ctx.micro_batch, None)
        self._backward_peak.pop(self.ctx.micro_batch, None)
        self.grads_to_come = grads_to_come
        self.num_tokens = num_tokens

    def enter_layer(self, in_use: int) -> None:
        self.layer_entry_in_use = in_use

    def backward_done(self, micro_batch: int, grad=None) -> None:
        """Backward has reached the first layer's input: its working set is behind it."""
        self.pending_backward.pop(micro_batch, None)

    def others_bytes(self, micro_batch: int) -> int:
        """What the ledger attributes to the other micro-batches on the device now."""
        return self.ledger.activation_bytes - self.ledger.bytes_by(micro_batch=micro_batch)

    def watch_backward(self, out, layer: int) -> None:
        """When backward reaches this layer's output, the layer peaks learn what the other
        micro-batches hold then (pipeline: the forwards the schedule ran since)."""
        out = out[0] if isinstance(out, (tuple, list)) else out
        if self.policy == "adaptive" and torch.is_tensor(out) and out.requires_grad:
            out.register_hook(functools.partial(self._layer_backward_starts,
                                                self.ctx.micro_batch, layer))

    def _layer_backward_starts(self, mb: int, layer: int, grad) -> None:
        self.layer_room.backward_starts(mb, layer, self.others_bytes(mb))

    def observe_forward(self, mb: int, out, num_tokens: int, layers: list[int]) -> None:
        """A forward is done: the forecast learns what the head and the shared part kept,
        the layer peaks where the head's backward starts."""
        post = max(self.ledger.bytes_by(mb, layer, "shared") for layer in layers)
        # The head keeps its saved bytes until backward starts, and its backward adds the
        # logits' gradient and the softmax beside them: both are reserved as the head's.
        head = self.ledger.bytes_by(mb, self.num_layers, "head")
        self.forecast.observe(head + int(self.layer_room.head_backward_per_token * num_tokens),
                              post, num_tokens)
        if mb in self._backward_peak:
            peak, over = self._backward_peak.pop(mb)
            self.pending_backward[mb] = backward_above_end(
                peak, self.ledger.in_use(), over, self.layer_room.room.observed)
        # The head's backward is measured from what is in use when it starts: the loss's
        # gradient is its first (the caller may have dropped the logits by then).
        self.layer_room.record_head(mb, self.ledger.in_use(), num_tokens)
        loss = getattr(out, "loss", None)
        if torch.is_tensor(loss) and loss.requires_grad:
            loss.register_hook(functools.partial(self._head_backward_starts, mb, num_tokens))

    def _head_backward_starts(self, mb: int, num_tokens: int, grad) -> None:
        self.layer_room.record_head(mb, self.ledger.in_use(), num_tokens)

    # ---- the decision -----------------------------------------------------------------
    def decide(self, layer: int, num_routed: int) -> Decision:
        start = time.perf_counter()
        if self.policy != "adaptive":
            decision = self.planner.fixed(STATIC_PLANS[self.policy], num_routed)
        else:
            decision = self._adaptive(layer, num_routed)
        step = self.recorder()
        if step is not None:
            step.plan_us.append((time.perf_counter() - start) * 1e6)
        return decision

    def _adaptive(self, layer: int, num_routed: int) -> Decision:
        mb = self.ctx.micro_batch
        layer_part = self.ledger.bytes_by(mb, layer) - self.ledger.bytes_by(mb, layer, "dispatch")
        # What the layer's entry check will expect of the next layers: the device's growth
        # since this layer's entry (its saved part and the forward tensors still alive
        # now, the dispatched rows among them), not only what its attention part saved.
        growth = self.ledger.in_use() - self.layer_entry_in_use
        seen = self.seen = self.seen.after(num_routed, max(layer_part, growth), self.num_tokens)
        evictable = self.tracker.evictable(mb, layer)
        residency = self.forecast.residency  # pipeline: resident micro-batches may go too
        if residency is not None:
            evictable += residency.evictable(self.tracker)
        in_use = self.ledger.in_use()
        self.layer_room.record(mb, layer, in_use, num_routed, self.grads_to_come.get(layer, 0),
                               layer_part, self.others_bytes(mb))
        room = decision_inputs(self._window_state(layer, num_routed, layer_part, seen,
                                                  evictable, in_use), self.forecast)
        if room.layer_shortfall_bytes > 0:
            # The layer's own peaks do not fit beside the layers below, whatever its
            # plan: move bytes of those to host first, then decide on what is left.
            self._evict(mb, layer, room.layer_shortfall_bytes)
            before, in_use = in_use, self.ledger.in_use()
            evictable = max(0, evictable - (before - in_use))
            room = decision_inputs(self._window_state(layer, num_routed, layer_part, seen,
                                                      evictable, in_use), self.forecast)
        try:
            decision = self.planner.decide(*room.planner_args())
        except BudgetInfeasible as err:
            raise BudgetInfeasible(
                f"micro-batch {mb}, layer {layer}: {err}; a budget of at least "
                f"{format_bytes(self.budget_bytes + err.needed_bytes)} would let the "
                f"planner fit it without the safety net",
                needed_bytes=self.budget_bytes + err.needed_bytes,
                budget_bytes=self.budget_bytes) from None
        if decision.evict_bytes:
            self._evict(mb, layer, decision.evict_bytes)
        return decision

    def _window_state(self, layer: int, num_routed: int, layer_part: int, seen: Seen,
                      evictable: int, in_use: int) -> WindowState:
        forward_peak, backward_peak = self.layer_room.needs(
            in_use, num_routed, self.grads_to_come.get(layer, 0), layer_part, layer)
        self._predicted_backward(self.ctx.micro_batch, backward_peak, in_use)
        return WindowState(
            layer=layer, budget_bytes=self.budget_bytes, in_use_bytes=in_use,
            num_routed=num_routed, layer_part_bytes=layer_part, max_routed=seen.max_routed,
            num_tokens=self.num_tokens, min_bytes_per_token=self.planner.min_bytes_per_token,
            transient_bytes_per_routed=forward_transient_bytes_per_routed(self.shape,
                                                                          self.on_cuda),
            prefetch=self.engine.prefetch_enabled, last_layer=layer >= self.num_layers - 1,
            evictable_bytes=evictable, layer_forward_peak_bytes=forward_peak,
            layer_backward_peak_bytes=backward_peak,
            resident_backward_bytes=self._resident_backward(), **self.fsdp_extra(layer))

    def fsdp_extra(self, layer: int) -> dict[str, int]:
        """WindowState's FSDP2 terms at a decision in `layer` (plan/fsdp_bytes.py): what its
        units add by the forward's last backward peak, and beside this layer's reloads."""
        fsdp = self.layer_room.fsdp
        return {"forward_extra_bytes": fsdp.forward_to_come(layer),
                "backward_extra_bytes": fsdp.layer_backward(layer)[0]}

    def _evict(self, mb: int, layer: int, num_bytes: int) -> None:
        residency = self.forecast.residency
        freed = self.tracker.evict(mb, layer, num_bytes,
                                   functools.partial(self.layer_room.evicted, mb))
        if residency is not None and freed < num_bytes:
            freed += residency.evict(self.tracker, num_bytes - freed)
        step = self.recorder()
        if step:
            step.evicted_bytes += freed

    def layer_cannot_fit(self, layer: int) -> bool:
        """Before a layer's forward runs: would it overflow even with its expert path at the
        least the planner can keep? Then recompute the whole layer (attention included)
        rather than discover it mid-layer and pay the safety net's re-run. Needs the
        attention part's bytes per token, measured on earlier layers; never on the first."""
        if self.policy != "adaptive":
            return False
        entry = EntryState(layer, self.budget_bytes, self.ledger.in_use(), self.num_tokens,
                           self.planner.min_bytes_per_token, self.seen,
                           self._resident_backward(),
                           self.fsdp_extra(layer)["forward_extra_bytes"])
        if not layer_cannot_fit(entry, self.forecast):
            return False
        step = self.recorder()
        if step is not None:
            step.full_layers += 1
        # Recomputed whole, the layer still comes back whole in its backward, with its
        # gradients, beside what the layers below keep: make that fit now, by eviction.
        estimate = entry_estimate(entry)
        if estimate is not None:
            part, routed = estimate
            backward = self.layer_room.whole_backward(entry.in_use_bytes, part, int(routed),
                                                      self.grads_to_come.get(layer, 0), layer)
            mb = self.ctx.micro_batch
            # Its backward is a working set later micro-batches must leave room for too.
            self._predicted_backward(mb, backward, entry.in_use_bytes)
            short = backward + self._resident_backward() - self.budget_bytes
            if short > 0:
                self._evict(mb, layer, short)
        return True

    def _predicted_backward(self, mb: int, backward_peak: int, in_use: int) -> None:
        peak, over = self._backward_peak.get(mb, (0, 0))
        self._backward_peak[mb] = (max(peak, backward_peak), max(over, backward_peak - in_use))

    def _resident_backward(self) -> int:
        """The largest predicted backward excess of the other resident micro-batches (each
        over the in-use its forward left, which the device's figure holds now)."""
        mb = self.ctx.micro_batch
        return max((v for m, v in self.pending_backward.items() if m != mb), default=0)
