"""The decision window: the planner's inputs, gathered where the routed counts are known.

One part of the guard (spikeguard.runtime.guard), and the one place where memory is
decided: `decide` runs in every MoE layer of every micro-batch right after routing;
`layer_cannot_fit` runs at a layer's entry, before its attention. The procedure of both
is spikeguard.plan.decide's (its arithmetic spikeguard.plan.room's), which the simulator
(spikeguard/sim/chunk.py) and the hookless proof call too: the window only collects what
its collaborators know into the procedure's plain numbers.

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
from spikeguard.memory.ledger import Ledger, storage_bytes, storage_key
from spikeguard.plan.catalogue import POLICY_PLANS
from spikeguard.plan.forecast import Forecast
from spikeguard.plan.planner import Decision
from spikeguard.plan.decide import LayerFacts, decide_layer, entry_fallback
from spikeguard.plan.room import (EntryState, Seen, backward_above_end, entry_overflow,
                                  forward_transient_bytes_per_routed)
from spikeguard.runtime.history import StepRecorder
from spikeguard.runtime.hooks import Context, SavedTensorTracker
from spikeguard.runtime.grad_hooks import on_grad
from spikeguard.runtime.layer_room import LayerPeaks
from spikeguard.runtime.offload import OffloadEngine

# A layer's promise that no later layer of its micro-batch needs the whole-layer fallback
# holds where the later layers may route this many times the most copies seen so far (on
# top of the forecast's margin: 2.5x in all, about the 2.6x of a device's share that the
# production run's spikes reach) and still fit at their least plans. (Where the least
# plan keeps nothing per routed copy, as a transformers experts call recomputed whole,
# the factor changes nothing: the promise is then the forecast's fit alone.)
PROMISE_ROUTED = 2.0


class DecisionWindow:
    """Turns the ledger, the forecast and the counts into a plan, per layer and micro-batch."""

    def __init__(self, *, policy: str, budget_bytes: int, ledger: Ledger, planner, shape,
                 ctx: Context, tracker: SavedTensorTracker, engine: OffloadEngine,
                 forecast: Forecast, layer_room: LayerPeaks, num_layers: int, on_cuda: bool,
                 recorder: Callable[[], Optional[StepRecorder]],
                 exchange_rows: tuple[int, ...] = ()):
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
        # Under EP: EntryState's exchange fields (plan/room.py), the dispatch's sent rows
        # per token, which the entry check adds; () without an exchange.
        self.exchange_rows = exchange_rows
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
        # The last finished forward's entry in pending_backward (None before the first):
        # what the hookless proof expects of a forward still running (same shapes).
        self.last_backward_excess: Optional[int] = None
        # mb -> the ledger's keys modelling what a calm forward of it holds, in a pipeline
        # (runtime/calm_forward.py): let go of when its backward is done, or when it runs
        # again.
        self.calm_models: dict[int, tuple] = {}

    # ---- what the guard tells the window ----------------------------------------------
    def begin_micro_batch(self, num_tokens: int, grads_to_come: dict[int, int]) -> None:
        self.seen = self.seen.next_micro_batch()
        if self.forecast.residency is not None:   # older micro-batches' backward makes them
            grads_to_come = self.forecast.residency.grads_at_backward(grads_to_come)
        # A new attempt (or a net re-run) of this micro-batch predicts its backward afresh.
        self.pending_backward.pop(self.ctx.micro_batch, None)
        self._backward_peak.pop(self.ctx.micro_batch, None)
        self.ledger.release_all(self.calm_models.pop(self.ctx.micro_batch, ()))
        self.grads_to_come = grads_to_come
        self.num_tokens = num_tokens

    def enter_layer(self, in_use: int) -> None:
        self.layer_entry_in_use = in_use

    def backward_done(self, micro_batch: int, grad=None) -> None:
        """Backward has reached the first layer's input: its working set is behind it."""
        self.pending_backward.pop(micro_batch, None)
        self.ledger.release_all(self.calm_models.pop(micro_batch, ()))

    def others_bytes(self, micro_batch: int) -> int:
        """What the ledger attributes to the other micro-batches on the device now."""
        return self.ledger.activation_bytes - self.ledger.bytes_by(micro_batch=micro_batch)

    def watch_backward(self, out, layer: int) -> None:
        """When backward reaches this layer's output, the layer peaks learn what the other
        micro-batches hold then (pipeline: the forwards the schedule ran since)."""
        out = out[0] if isinstance(out, (tuple, list)) else out
        if self.policy == "adaptive" and torch.is_tensor(out) and out.requires_grad:
            on_grad(out, functools.partial(self._layer_backward_starts,
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
        loss = getattr(out, "loss", None)
        if not (torch.is_tensor(loss) and loss.requires_grad):
            # The loss is the caller's (torchtitan's, a user's own): the model's output,
            # which no saved-tensor hook holds, stays on the device while the caller's
            # loss reads it, and the head's backward is measured from above it (seen:
            # torchtitan at 0.85x re-ran every step in the head's backward, 1 MiB of
            # logits short).
            head += output_bytes(out, self.ledger)
        self.forecast.observe(head + int(self.layer_room.head_backward_per_token * num_tokens),
                              post, num_tokens)
        if mb in self._backward_peak:
            peak, over = self._backward_peak.pop(mb)
            self.pending_backward[mb] = backward_above_end(
                peak, self.ledger.in_use(), over, self.layer_room.room.observed)
            self.last_backward_excess = self.pending_backward[mb]
        # The head's backward is measured from what is in use when it starts: the loss's
        # gradient is its first (the caller may have dropped the logits by then).
        self.layer_room.record_head(mb, self.ledger.in_use(), num_tokens)
        if torch.is_tensor(loss) and loss.requires_grad:
            loss.register_hook(functools.partial(self._head_backward_starts, mb, num_tokens))

    def _head_backward_starts(self, mb: int, num_tokens: int, grad) -> None:
        self.layer_room.record_head(mb, self.ledger.in_use(), num_tokens)

    # ---- the decision -----------------------------------------------------------------
    def decide(self, layer: int, num_routed: int) -> Decision:
        start = time.perf_counter()
        if self.policy != "adaptive":
            decision = self.planner.fixed(POLICY_PLANS[self.policy], num_routed)
        else:
            decision = self._adaptive(layer, num_routed)
        step = self.recorder()
        if step is not None:
            step.plan_us.append((time.perf_counter() - start) * 1e6)
        return decision

    def _adaptive(self, layer: int, num_routed: int) -> Decision:
        """Collect the numbers of this decision, then the one procedure (plan/decide.py)."""
        mb = self.ctx.micro_batch
        layer_part = self.ledger.bytes_by(mb, layer) - self.ledger.bytes_by(mb, layer, "dispatch")
        # What the layer's entry check will expect of the next layers: the device's growth
        # since this layer's entry (its saved part and the forward tensors still alive
        # now, the dispatched rows among them), not only what its attention part saved.
        growth = self.ledger.in_use() - self.layer_entry_in_use
        seen = self.seen = self.seen.after(num_routed, max(layer_part, growth), self.num_tokens)
        in_use = self.ledger.in_use()
        grads_to_come = self.grads_to_come.get(layer, 0)
        meter = self.ledger.meter
        self.layer_room.record(mb, layer, in_use, num_routed, grads_to_come, layer_part,
                               self.others_bytes(mb), meter.where_peak(meter.where()))
        facts = LayerFacts(
            layer=layer, budget_bytes=self.budget_bytes, num_routed=num_routed,
            layer_part_bytes=layer_part, max_routed=seen.max_routed, num_tokens=self.num_tokens,
            min_bytes_per_token=self.planner.min_bytes_per_token, grads_to_come=grads_to_come,
            transient_bytes_per_routed=forward_transient_bytes_per_routed(self.shape,
                                                                          self.on_cuda),
            prefetch=self.engine.prefetch_enabled, last_layer=layer >= self.num_layers - 1,
            resident_backward_bytes=self._resident_backward(),
            fixed_backward=self.layer_room.fsdp.layer_backward(layer), **self.fsdp_extra(layer))
        try:
            return decide_layer(facts, in_use, self.layer_room.room, self.forecast, self.planner,
                                self._evictor(mb, layer),
                                functools.partial(self._predicted_backward, mb)).decision
        except BudgetInfeasible as err:
            raise BudgetInfeasible(
                f"micro-batch {mb}, layer {layer}: {err}; a budget of at least "
                f"{format_bytes(self.budget_bytes + err.needed_bytes)} would let the "
                f"planner fit it without the safety net",
                needed_bytes=self.budget_bytes + err.needed_bytes,
                budget_bytes=self.budget_bytes) from None

    def _evictor(self, mb: int, layer: int) -> "TrackerEvictor":
        return TrackerEvictor(self.tracker, self.forecast.residency, self.ledger,
                              self.layer_room, self.recorder, mb, layer)

    def fsdp_extra(self, layer: int) -> dict[str, int]:
        """WindowState's FSDP2 terms at a decision in `layer` (plan/fsdp_bytes.py): what its
        units add by the forward's last backward peak, and beside this layer's reloads."""
        return {"forward_extra_bytes": self.layer_room.fsdp_forward_to_come(layer,
                                                                            self.num_tokens),
                "backward_extra_bytes": self.layer_room.fsdp.layer_backward(layer)[0]}

    def promise(self, layer: int) -> bool:
        """At `layer`'s entry, after its entry check: does the forecast fit the rest of the
        micro-batch at its least plans even where each later layer routes PROMISE_ROUTED
        times the most copies seen so far (times the forecast's own margin)? Each decision
        keeps the rest's least plans in room at the forecast's margin (plan/decide.py), and
        what earlier layers saved can be evicted beyond it, so a later layer then needs the
        whole-layer fallback only where it routes well past what was seen: a prediction,
        as the forecast is. What a rank promises at its vote; where every rank does, the
        group skips the later votes (runtime/layers.py `falls_back`,
        parallel/family_journal.py), and a later layer that would have fallen back takes
        the least plan its decision finds, or the safety net re-runs the micro-batch. A
        static policy never falls back: it always promises; nothing is promised before an
        attention part was measured."""
        if self.policy != "adaptive":
            return True
        seen = self.seen
        if seen.layer_bytes_per_token <= 0:
            return False
        wide = Seen(int(seen.max_routed * PROMISE_ROUTED), seen.layer_bytes_per_token,
                    seen.routed_per_token * PROMISE_ROUTED)
        entry = EntryState(layer, self.budget_bytes, self.ledger.in_use(), self.num_tokens,
                           self.planner.min_bytes_per_token, wide, self._resident_backward(),
                           self.fsdp_extra(layer)["forward_extra_bytes"], *self.exchange_rows)
        return entry_overflow(entry, self.forecast)[0] <= 0

    def layer_cannot_fit(self, layer: int) -> bool:
        """Before a layer's forward runs: would it overflow even with its expert path at the
        least the planner can keep? Then recompute the whole layer (attention included)
        rather than discover it mid-layer and pay the safety net's re-run
        (plan/decide.py `entry_fallback`). Needs the attention part's bytes per token,
        measured on earlier layers; never on the first."""
        if self.policy != "adaptive":
            return False
        mb = self.ctx.micro_batch
        entry = EntryState(layer, self.budget_bytes, self.ledger.in_use(), self.num_tokens,
                           self.planner.min_bytes_per_token, self.seen,
                           self._resident_backward(),
                           self.fsdp_extra(layer)["forward_extra_bytes"], *self.exchange_rows)
        # Its backward is a working set later micro-batches must leave room for too.
        if not entry_fallback(entry, self.forecast, self.layer_room.room,
                              self.grads_to_come.get(layer, 0), self._evictor(mb, layer),
                              self.planner, functools.partial(self._predicted_backward, mb),
                              self.layer_room.fsdp.layer_backward(layer)):
            return False
        step = self.recorder()
        if step is not None:
            step.full_layers += 1
        return True

    def make_room_for_dispatch(self, exchange_bytes: int) -> None:
        """Under EP, in a forward's dispatch once the counts are exchanged and before any
        row is: evict what the exchange's rows (`exchange_bytes`, exact) need beyond the
        budget, with the evictor the entry check and the decision use. The entry check
        counts only the rows sent; with the received ones counted there at the most routed
        copies seen so far, it asked 0.65 MiB where the dispatch's rows were 0.14 MiB over
        (`small`, top-4 of 16 experts, EP=2, 0.6x; CPU, emulated device)."""
        if self.policy != "adaptive":
            return
        over = self.ledger.in_use() + exchange_bytes - self.budget_bytes
        if over > 0:
            self._evictor(self.ctx.micro_batch, self.ctx.layer).evict(over)

    def _predicted_backward(self, mb: int, backward_peak: int, in_use: int) -> None:
        peak, over = self._backward_peak.get(mb, (0, 0))
        self._backward_peak[mb] = (max(peak, backward_peak), max(over, backward_peak - in_use))

    def backward_above(self, mb: int, in_use: int) -> int:
        """How far micro-batch `mb`'s backward is predicted so far to reach above `in_use`
        (its forward's in-use now: at its end the device holds at least as much)."""
        return max(0, self._backward_peak.get(mb, (0, 0))[0] - in_use)

    def _resident_backward(self) -> int:
        """The largest predicted backward excess of the other resident micro-batches (each
        over the in-use its forward left, which the device's figure holds now)."""
        mb = self.ctx.micro_batch
        return max((v for m, v in self.pending_backward.items() if m != mb), default=0)


class TrackerEvictor:
    """plan/decide.py's Evictor over the saved-tensor tracker: micro-batch `mb`'s layers
    below `layer` first, then (pipeline) older resident micro-batches. What it moves is
    counted in the open step's record; the bytes freed are the device's drop, as the
    ledger sees it."""

    def __init__(self, tracker: SavedTensorTracker, residency, ledger: Ledger,
                 layer_room: LayerPeaks, recorder: Callable[[], Optional[StepRecorder]],
                 mb: int, layer: int):
        self.tracker, self.residency, self.ledger = tracker, residency, ledger
        self.layer_room, self.recorder = layer_room, recorder
        self.mb, self.layer = mb, layer

    def evictable(self) -> int:
        evictable = self.tracker.evictable(self.mb, self.layer)
        if self.residency is not None:   # pipeline: resident micro-batches may go too
            evictable += self.residency.evictable(self.tracker)
        return evictable

    def evict(self, num_bytes: int) -> int:
        before = self.ledger.in_use()
        freed = self.tracker.evict(self.mb, self.layer, num_bytes,
                                   functools.partial(self.layer_room.evicted, self.mb, self.layer))
        if self.residency is not None and freed < num_bytes:
            freed += self.residency.evict(self.tracker, num_bytes - freed)
        step = self.recorder()
        if step:
            step.evicted_bytes += freed
        return before - self.ledger.in_use()


def output_bytes(out, ledger) -> int:
    """Bytes of the storages a forward returned that autograd will reach (a tensor, or a
    tuple, list or dict of them) and no saved-tensor hook holds (`ledger` has those: a
    pipeline's last stage returns the log-softmax its own op saved): the logits of a model
    whose loss is computed outside it."""
    if torch.is_tensor(out):
        if not out.requires_grad or ledger.holds(storage_key(out)):
            return 0
        return storage_bytes(out)
    if isinstance(out, dict):
        out = list(out.values())
    if isinstance(out, (tuple, list)):
        return sum(output_bytes(t, ledger) for t in out)
    return 0
