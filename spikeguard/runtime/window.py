"""The decision window of the guard: the planner's inputs, gathered where the counts are known.

A mixin of `Guard` (spikeguard.runtime.guard), kept in its own file because it is the one
place where memory is decided: `decide` runs in every MoE layer of every micro-batch right
after routing; `_layer_cannot_fit` runs at a layer's entry, before its attention.
"""

from __future__ import annotations

import time

from spikeguard.errors import BudgetInfeasible
from spikeguard.memory.budget import format_bytes
from spikeguard.plan.catalogue import ALL_OFFLOAD, ALL_SAVE, EXPERTS_RECOMPUTE
from spikeguard.plan.planner import Decision

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
            self._max_routed = max(self._max_routed, num_routed)
            layer_part = self.ledger.bytes_by(mb, layer) - self.ledger.bytes_by(mb, layer, "dispatch")
            if self._mb_tokens:
                self._layer_bytes_per_token = max(self._layer_bytes_per_token,
                                                  layer_part / self._mb_tokens)
                self._routed_per_token = max(self._routed_per_token, num_routed / self._mb_tokens)
            to_come = self.forecast.still_to_come(
                layer, layer_part, self._max_routed, self.planner.min_bytes_per_token,
                self._mb_tokens or num_routed)
            headroom = self.budget_bytes - self.ledger.in_use() - to_come
            if self.device.type == "cuda":
                # The allocator also holds the stage temporaries (per-expert GEMM outputs
                # before their concatenation): leave room for the largest of them.
                headroom -= num_routed * self.shape.bytes_per_token()["gate_up"]
            # In backward this layer's offloaded tensors come back while what is in use now
            # is still alive; a prefetch by the layer above also finds that layer's
            # attention part alive (about this layer's).
            prefetch_margin = layer_part if (self.engine.prefetch_enabled
                                             and layer < len(self.moe_blocks) - 1) else 0
            backward_room = (self.budget_bytes - self.ledger.in_use() - prefetch_margin
                             - self.forecast.backward_reserved_bytes)  # pipeline: others resident
            evictable = self.tracker.evictable(mb, layer)
            residency = self.forecast.residency  # pipeline: resident micro-batches may go too
            if residency is not None:
                evictable += residency.evictable(self.tracker)
            try:
                decision = self.planner.decide(num_routed, headroom, evictable, backward_room)
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
                freed = self.tracker.evict(mb, layer, decision.evict_bytes)
                if residency is not None and freed < decision.evict_bytes:
                    freed += residency.evict(self.tracker, decision.evict_bytes - freed)
                if self._step:
                    self._step.evicted_bytes += freed
        if self._step is not None:
            self._step.plan_us.append((time.perf_counter() - start) * 1e6)
        return decision

    def _layer_cannot_fit(self, layer: int) -> bool:
        """Before a layer runs: would it overflow even with its expert path at the least
        the planner can keep? Then recompute the whole layer (attention included) rather
        than discover it mid-layer and pay the safety net's re-run. Needs the attention
        part's bytes per token, measured on earlier layers; never on the first ones."""
        if self.policy != "adaptive" or not self._in_forward or self._layer_bytes_per_token <= 0:
            return False
        tokens = self._mb_tokens
        layer_part = int(self._layer_bytes_per_token * tokens)
        routed = max(self._max_routed, self._routed_per_token * tokens)
        least = layer_part + self.planner.min_bytes_per_token * routed
        to_come = self.forecast.still_to_come(layer, layer_part, routed,
                                              self.planner.min_bytes_per_token, tokens)
        if self.ledger.in_use() + least + to_come <= self.budget_bytes:
            return False
        if self._step is not None:
            self._step.full_layers += 1
        return True
