"""The decision window of the guard: the planner's inputs, gathered where the counts are known.

A mixin of `Guard` (spikeguard.runtime.guard), kept in its own file because it is the one
place where memory is decided: `decide` runs in every MoE layer of every micro-batch right
after routing; `_layer_cannot_fit` runs at a layer's entry, before its attention. The
arithmetic of both is spikeguard.plan.room's, which the simulator (spikeguard/sim/walk.py)
calls too: here the guard only reads what it knows into room's plain-number states.
"""

from __future__ import annotations

import time

from spikeguard.errors import BudgetInfeasible
from spikeguard.memory.budget import format_bytes
from spikeguard.plan.catalogue import ALL_OFFLOAD, ALL_SAVE, EXPERTS_RECOMPUTE
from spikeguard.plan.planner import Decision
from spikeguard.plan.room import (EntryState, Seen, WindowState, decision_inputs, entry_estimate,
                                  forward_transient_bytes_per_routed, layer_cannot_fit)

STATIC_PLANS = {"none": ALL_SAVE, "full": ALL_SAVE, "experts": EXPERTS_RECOMPUTE,
                "offload": ALL_OFFLOAD}


class DecisionWindow:
    """Methods of Guard that turn the ledger, the forecast and the counts into a plan."""

    def decide(self, layer: int, num_routed: int) -> Decision:
        start = time.perf_counter()
        if self.policy != "adaptive":
            decision = self.planner.fixed(STATIC_PLANS[self.policy], num_routed)
        else:
            mb = self.ctx.micro_batch
            layer_part = self.ledger.bytes_by(mb, layer) - self.ledger.bytes_by(mb, layer, "dispatch")
            # What the layer's entry check will expect of the next layers: the device's growth
            # since this layer's entry (its saved part and the forward tensors still alive
            # now, the dispatched rows among them), not only what its attention part saved.
            growth = self.ledger.in_use() - self._layer_entry_in_use
            seen = self._seen().after(num_routed, max(layer_part, growth), self._mb_tokens)
            self._max_routed = seen.max_routed
            self._layer_bytes_per_token = seen.layer_bytes_per_token
            self._routed_per_token = seen.routed_per_token
            evictable = self.tracker.evictable(mb, layer)
            residency = self.forecast.residency  # pipeline: resident micro-batches may go too
            if residency is not None:
                evictable += residency.evictable(self.tracker)
            in_use = self.ledger.in_use()
            self.layer_room.record(mb, layer, in_use, num_routed, self._grads_to_come,
                                   layer_part)
            room = decision_inputs(self._window_state(layer, num_routed, layer_part, seen,
                                                      evictable, in_use), self.forecast)
            if room.layer_shortfall_bytes > 0:
                # The layer's own peaks do not fit beside the layers below, whatever its
                # plan: move bytes of those to host first, then decide on what is left.
                self._evict(mb, layer, room.layer_shortfall_bytes, residency)
                before, in_use = in_use, self.ledger.in_use()
                evictable = max(0, evictable - (before - in_use))
                room = decision_inputs(self._window_state(layer, num_routed, layer_part, seen,
                                                          evictable, in_use), self.forecast)
            try:
                decision = self.planner.decide(*room.planner_args())
            except BudgetInfeasible as err:
                if self.ledger.defer_overflow:  # finish the forward; the group decides after
                    self.ledger.overflow = self.ledger.overflow or err
                    return self.planner.least(num_routed)
                raise BudgetInfeasible(
                    f"micro-batch {mb}, layer {layer}: {err}; a budget of at least "
                    f"{format_bytes(self.budget_bytes + err.needed_bytes)} would let the "
                    f"planner fit it without the safety net",
                    needed_bytes=self.budget_bytes + err.needed_bytes,
                    budget_bytes=self.budget_bytes) from None
            if decision.evict_bytes:
                self._evict(mb, layer, decision.evict_bytes, residency)
        if self._step is not None:
            self._step.plan_us.append((time.perf_counter() - start) * 1e6)
        return decision

    def _window_state(self, layer: int, num_routed: int, layer_part: int, seen: Seen,
                      evictable: int, in_use: int) -> WindowState:
        forward_peak, backward_peak = self.layer_room.needs(in_use, num_routed,
                                                            self._grads_to_come, layer_part)
        mb = self.ctx.micro_batch
        pending = self._pending_backward
        pending[mb] = max(pending.get(mb, 0), backward_peak - in_use)
        return WindowState(
            layer=layer, budget_bytes=self.budget_bytes, in_use_bytes=in_use,
            num_routed=num_routed, layer_part_bytes=layer_part, max_routed=seen.max_routed,
            num_tokens=self._mb_tokens, min_bytes_per_token=self.planner.min_bytes_per_token,
            transient_bytes_per_routed=forward_transient_bytes_per_routed(
                self.shape, self.device.type == "cuda"),
            prefetch=self.engine.prefetch_enabled, last_layer=layer >= len(self.moe_blocks) - 1,
            evictable_bytes=evictable, layer_forward_peak_bytes=forward_peak,
            layer_backward_peak_bytes=backward_peak,
            resident_backward_bytes=self._resident_backward())

    def _evict(self, mb: int, layer: int, num_bytes: int, residency) -> None:
        freed = self.tracker.evict(mb, layer, num_bytes)
        if residency is not None and freed < num_bytes:
            freed += residency.evict(self.tracker, num_bytes - freed)
        if self._step:
            self._step.evicted_bytes += freed

    def _layer_cannot_fit(self, layer: int) -> bool:
        """Before a layer runs: would it overflow even with its expert path at the least
        the planner can keep? Then recompute the whole layer (attention included) rather
        than discover it mid-layer and pay the safety net's re-run. Needs the attention
        part's bytes per token, measured on earlier layers; never on the first ones."""
        if self.policy != "adaptive" or not self._in_forward:
            return False
        entry = EntryState(layer, self.budget_bytes, self.ledger.in_use(), self._mb_tokens,
                           self.planner.min_bytes_per_token, self._seen(),
                           self._resident_backward())
        if not layer_cannot_fit(entry, self.forecast):
            return False
        if self._step is not None:
            self._step.full_layers += 1
        # Recomputed whole, the layer still comes back whole in its backward, with its
        # gradients, beside what the layers below keep: make that fit now, by eviction.
        estimate = entry_estimate(entry)
        if estimate is not None:
            part, routed = estimate
            _, backward = self.layer_room.needs(entry.in_use_bytes + part, int(routed),
                                                self._grads_to_come, part)
            mb = self.ctx.micro_batch
            # Its backward is a working set later micro-batches must leave room for too.
            self._pending_backward[mb] = max(self._pending_backward.get(mb, 0),
                                             backward - entry.in_use_bytes)
            short = backward + self._resident_backward() - self.budget_bytes
            if short > 0:
                self._evict(mb, layer, short, self.forecast.residency)
        return True

    def _resident_backward(self) -> int:
        """The largest predicted backward working set of the other resident micro-batches."""
        mb = self.ctx.micro_batch
        return max((v for m, v in self._pending_backward.items() if m != mb), default=0)

    def _seen(self) -> Seen:
        """The guard's memory of earlier decisions (its `_max_routed` is reset per
        micro-batch by the guard; the per-token maxima live as long as the guard)."""
        return Seen(self._max_routed, self._layer_bytes_per_token, self._routed_per_token)
