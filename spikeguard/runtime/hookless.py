"""Hookless layers: what a layer saves runs with no saved-tensor hook where nothing of the
step can later want it off the device. (The stretches before the first layer and after
the last: runtime/hookless_ends.py, owned here as `ends`.)

One part of the guard (spikeguard.runtime.guard). The pack/unpack pair of
runtime/hooks.py runs in Python for every tensor autograd saves (318 on a calm step of
`small`: 120 in the attention parts and routers, 140 in the expert stages, 16 in combine,
28 in the shared experts). The hook is there for three things: offloading (the
executor's tags), evicting what was saved earlier (the tracker's holders), and the
ledger's attribution. Under an all-save plan the first is moot; this module proves the
second moot, and models the third.

Who could ever want a layer's saved tensors off the device later: the later decisions of
the same micro-batch (window.py: a layer's shortfall, the planner's `evict_bytes`, the
backward fit of a layer found unable to fit at its entry), and a pipeline's residency,
which may take any layer of an older micro-batch (plan/residency.py). Under policy "none"
nothing of the step ever offloads or evicts (its decisions are the fixed all-save plan,
and only adaptive's window evicts, a pipeline's residency included): every layer of it is
proven, the first one's expert path on and every later layer whole, in one process,
under expert parallelism and in a pipeline alike. Under "adaptive" the proof, at the
decision of layer L:
  * L keeps everything, with no eviction asked;
  * the later layers of this micro-batch, walked now with the window's own procedure
    (plan/decide.py `fits_unaided`: the entry check, the planner's inputs with the layer
    peaks, the planner's own fit test), each find a plan of the menu that fits with no
    shortfall, at the most the device can hold there: every layer before keeping
    everything (no plan keeps more) for the most routed copies, each growing the device
    by what L grew it since its entry (or by its attention part, the larger: same shapes,
    same bytes), plus that expert path and the post-expert part (under expert
    parallelism, once seen, by what a layer left from its entry to the next one's and
    the most growth to a decision seen: runtime/routed_history.py `LayerSteps`).
  * in a pipeline, the same of every layer of each forward the stage runs before this
    micro-batch's backward (the residency's `later_forwards`: it is among their older
    residents, which their shortfalls may evict), from a bound on the in-use each will
    see (runtime/hookless_walk.py `later_forwards_fit`: this micro-batch and the
    forwards between whole at the most they can keep, less what the older ones whose
    backward runs first hold now, plus the gradients it makes) at the reserve that
    forward will read.
The most routed copies: in one process exactly L's (dropless top-k: tokens x top-k in
every layer). Under expert parallelism a rank's count moves from layer to layer and is
predicted per layer from its own recent forwards (runtime/routed_history.py), scaled by
any rise this micro-batch's layers show, the later forwards' of a pipeline alike; until
every layer has enough forwards behind it, the forecast's bound, (1 + its load margin) x
the most seen in this micro-batch. A prediction, not a proof: a spike that starts in a
later layer only is not foreseen (that layer evicts less, takes a smaller plan of its
own, or the safety net re-runs).
Then no decision of the micro-batch asks for eviction (other micro-batches evict only
their own layers outside a pipeline, and none before its backward inside one): L's
expert stages run hookless, and every later layer of the micro-batch is covered whole
from its entry on (attention, router, experts, combine, shared expert), unless its own
plan is not all-save: then the hook is back from its expert path on (the executor's tags
need it). The first layer that runs hooked measures what the covered ones model; that
measurement is carried to later micro-batches and steps by the layer input's shape, so
a micro-batch's first layer is covered from its entry too where the proof holds there
(`_proven_at_entry`: under none always; under adaptive with that layer walked as a later
one, at its routed count: known before the router runs in one process, predicted from
its recent forwards under expert parallelism).
Should the prediction still be wrong, the bytes are just not evictable: the later layer
picks a smaller plan, or the safety net re-runs; gradients and peaks are the same either
way (the tensors autograd saves, and when it frees them, do not depend on the hook).

A transformers experts call (integrations/hf_window.py `run_region`) is one region:
proven alike, it runs paused (`run_call`), attributed to op "experts" with the region byte
model's keep-everything bytes (integrations/hf_bytes.py); in one process and under
transformers' EP (there the experts' own forward on the rows received, between the two
exchanges, whose byte model is that call's; what the exchanges keep is measured on the
first layer as router and combine: the rows a rank sends, the same every layer).
torchtitan's call likewise, in one process and under its EP (its combine, after the call,
as the hook measured it).

Attribution of what ran hookless, per (micro-batch, layer, op) in the ledger: the expert
ops are the byte model's bytes (ExpertShape.predict, within 5% of the measured:
tests/runtime/test_runtime_attribution.py; combine under EP with the rows its reverse
all-to-all returned, tests/parallel/test_parallel_ep_bytes.py), released when backward
has passed the layer's expert path; attention, router and shared expert are what the hook
measured on the micro-batch's last layer run hooked, released when backward has passed
the layer (the gradient of its input is ready).
"""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import Optional

from spikeguard.memory.ledger import Ledger
from spikeguard.plan.catalogue import ALL_SAVE, CONSUMERS, OPS, ExpertShape
from spikeguard.plan.decide import LayerFacts, fits_unaided
from spikeguard.plan.room import EntryState, forward_transient_bytes_per_routed
from spikeguard.runtime.grad_hooks import on_grad
from spikeguard.runtime.hooks import SavedTensorTracker
from spikeguard.runtime.hookless_ends import HooklessEnds
from spikeguard.runtime.hookless_walk import Walk, later_forwards_fit, walks_at
from spikeguard.runtime.routed_history import LayerSteps, RoutedHistory

# The operators whose saved tensors the executor's stages make (a later stage reads
# them); combine's after them (the last stage's, read by combine, and combine's own).
STAGE_OPS = tuple(op for op in OPS if CONSUMERS[op])
COMBINE_OPS = tuple(op for op in OPS if not CONSUMERS[op]) + ("combine",)
# What the hook measures on a hooked layer, for the covered layers after it ("combine":
# for a region call whose combine runs after it, torchtitan's; the built-in path models
# its combine from the byte model, a transformers call holds its own).
MEASURED_OPS = ("attn", "router", "shared", "combine")
class HooklessLayers:
    """Pauses the tracker's hooks where the proof holds, and models what they would say."""

    def __init__(self, window, tracker: SavedTensorTracker, ledger: Ledger,
                 shape: ExpertShape, exact_routing: bool, last_layer: int):
        self.window = window
        # The embedding and the head (runtime/hookless_ends.py); `last_layer`: the last
        # guarded layer's index, after which the head runs.
        self.ends = HooklessEnds(tracker, ledger, window.ctx, window.policy, window.num_layers,
                                 last_layer, lambda: window.forecast.residency,
                                 window.recorder, self.fits_from_start)
        self.tracker = tracker
        self.ledger = ledger
        self.shape = shape
        self.enabled = window.policy in ("adaptive", "none")
        # One process, built-in dropless top-k: every layer routes tokens x top-k copies.
        self.exact_routing = exact_routing
        self.routed = RoutedHistory()   # under expert parallelism: later layers' counts
        self.steps = LayerSteps()       # ... and what each layer leaves beyond its experts
        self._modelled: dict[int, list] = {}   # micro-batch -> its modelled ledger keys
        # Micro-batch -> the first layer proven: every layer after it is covered whole.
        self._covered_after: dict[int, int] = {}
        # Micro-batch -> {op: bytes} of MEASURED_OPS on its last layer run hooked.
        self._measured: dict[int, dict[str, int]] = {}
        # Layer input shape -> MEASURED_OPS and the growth to the decision ("growth") on
        # the last layer of that shape run hooked, for the next micro-batch's first layer.
        self._carried: dict[tuple, dict[str, int]] = {}
        self.growth = 0   # in-use from the running layer's entry to its decision
        # The last walk's layers: (layer, the device's figure at its decision, its routed
        # copies, the walk it was asked on) as the walk put them (runtime/calm_forward.py
        # checks a calm forward's layers against them under expert parallelism).
        self.walked: list[tuple[int, int, int, Walk]] = []
        self._whole = False   # the layer running now is covered from its entry
        self._decided = False   # the layer running now decided (it is not recomputed whole)

    # ---- the layer's entry and end (runtime/layers.py) --------------------------------
    def enter_layer(self, layer: int, x) -> None:
        """A guarded layer's forward starts on input `x`: covered, it runs paused."""
        mb = self.window.ctx.micro_batch
        self._whole = self._decided = False
        self.ends.first_layer(layer, x)
        if self.enabled and not self.exact_routing:
            self.steps.entered(mb, layer, self.window.layer_entry_in_use,
                               self.window.num_tokens, self.keep_all_bytes)
        if not self.enabled or not getattr(x, "requires_grad", False):
            return
        if mb not in self._measured and mb not in self._covered_after \
                and not self._proven_at_entry(mb, layer, x):
            return
        if layer <= self._covered_after.get(mb, layer) or mb not in self._measured:
            return
        self.tracker.pause()
        self._whole = True
        measured = self._measured[mb]
        self._model(mb, layer, {op: measured[op] for op in ("attn", "router")}, x)

    def leave_layer(self, layer: int, x, out) -> None:
        """The layer's forward is done (`out`): the hook is back, unless the head runs
        paused after it (runtime/hookless_ends.py). A layer whose attention ran hooked
        leaves its measurement to the covered layers after it."""
        mb = self.window.ctx.micro_batch
        if not self.enabled:
            return
        if not self._whole and self._decided:
            self._measured[mb] = {op: self.ledger.bytes_by(mb, layer, op) for op in MEASURED_OPS}
            if getattr(x, "requires_grad", False):
                self._carried[tuple(x.shape)] = dict(self._measured[mb], growth=self.growth)
        elif self.tracker.is_paused:   # the shared expert ran hookless too
            self._model(mb, layer, {"shared": self._measured[mb]["shared"]}, x)
        self._whole = False
        if not self.ends.last_layer_done(layer, out):
            self.tracker.resume()

    # ---- the expert path (the built-in window, integrations/builtin.py run_window) ----
    def run(self, executor, block, dispatched, decision):
        """The expert path of `block` under `decision`, hookless where proven so."""
        counts, x_ND = dispatched.tokens_per_expert, dispatched.x_ND
        layer = block.layer_idx
        self._decided = True
        if not self.proven(layer, x_ND.shape[0], decision) or not x_ND.requires_grad:
            self.tracker.resume()   # a covered layer that does not keep everything
            return executor.run(block.experts, x_ND, counts, decision.plan)
        self._covered_after[self.window.ctx.micro_batch] = min(
            layer, self._covered_after.get(self.window.ctx.micro_batch, layer))
        self.tracker.pause()
        whole = self._whole and self.tracker.is_paused   # its combine runs paused too
        y_ND = executor.run(block.experts, x_ND, counts, decision.plan, hooked=False,
                            output_hooked=not whole)
        ops = STAGE_OPS + COMBINE_OPS if whole else STAGE_OPS
        if not whole:
            self.tracker.resume()   # combine runs hooked
        predicted = self.shape.predict(x_ND.shape[0])
        if whole:   # under EP combine also keeps the rows its reverse all-to-all returned
            w = self.window
            predicted["combine"] += int(w.forecast.combine_bytes_per_token * w.num_tokens)
        self._model(self.window.ctx.micro_batch, layer, {op: predicted[op] for op in ops}, x_ND)
        step = self.window.recorder()
        if step is not None:
            step.hookless_layers += 1
        return y_ND

    # ---- an experts call run as one region (integrations/hf_window.py run_region) ------
    def run_call(self, layer: int, x, num_routed: int, decision, run):
        """`run()`: one experts call (a transformers block's, its combine inside) under
        `decision`, hookless where proven so; what it saves is then the region byte
        model's keep-everything bytes, attributed to op "experts" until `x`'s gradient."""
        self._decided = True
        if not self.proven(layer, num_routed, decision) or not x.requires_grad:
            self.tracker.resume()   # a covered layer that does not keep everything
            return run()
        mb = self.window.ctx.micro_batch
        self._covered_after[mb] = min(layer, self._covered_after.get(mb, layer))
        self.tracker.pause()
        out = run()
        if not (self._whole and self.tracker.is_paused):
            self.tracker.resume()   # the rest of this layer runs hooked, and is measured
        modelled = {"experts": self.keep_all_bytes(num_routed)}
        if self._whole and self.tracker.is_paused:   # its combine runs paused too
            modelled["combine"] = self._measured[mb]["combine"]
        self._model(mb, layer, modelled, x)
        step = self.window.recorder()
        if step is not None:
            step.hookless_layers += 1
        return out

    def proven(self, layer: int, num_routed: int, decision) -> bool:
        """Nothing of the step can later want this layer's saved tensors (module doc)."""
        w = self.window
        in_use = self.ledger.in_use()
        self.growth = in_use - w.layer_entry_in_use   # carried if the layer ran hooked
        mb = w.ctx.micro_batch
        if self.enabled and not self.exact_routing:   # every forward decision, spikes too
            self.routed.note(mb, layer, num_routed)
            kept_all = decision.plan == ALL_SAVE and not decision.evict_bytes
            self.steps.decided(mb, layer, w.layer_entry_in_use, in_use, w.num_tokens,
                               num_routed, kept_all)
        if not self.enabled or decision.plan != ALL_SAVE or decision.evict_bytes \
                or not w.num_tokens:
            return False
        if w.policy == "none":   # nothing of its step ever offloads or evicts
            return True
        layer_part = self.ledger.bytes_by(mb, layer) - self.ledger.bytes_by(mb, layer, "dispatch")
        routed = max(num_routed, w.seen.max_routed)   # exact in one process (module doc)
        return self._layers_fit(layer + 1, layer, in_use, layer_part,
                                max(layer_part, self.growth), routed, num_routed)

    def _layers_fit(self, first: int, layer: int, in_use: int, layer_part: int, growth: int,
                    routed: int, own_routed: Optional[int] = None) -> bool:
        """Layers `first`.. of this micro-batch (and, in a pipeline, the forwards before its
        backward) need no eviction, walked from `in_use` at layer `layer`'s decision.
        Each later layer routes `routed` (the most seen so far) in one process; under
        expert parallelism what `self.routed` predicts for it, `layer` itself its own
        `own_routed`, where every later layer has a prediction; else each the forecast's
        bound on `routed` (module doc)."""
        w = self.window
        bound = routed if self.exact_routing else int(routed * (1 + w.forecast.load_margin))
        post = int((w.forecast.post_bytes_per_token + w.forecast.combine_bytes_per_token)
                   * w.num_tokens)
        per_layer = growth + self.keep_all_bytes(bound) + post
        mb = w.ctx.micro_batch
        walk = Walk(bound, layer_part, replace(w.seen, max_routed=bound), max(
            (v for m, v in w.pending_backward.items() if m != mb), default=0))
        later_layers = range(first, w.num_layers)
        predicted = None if self.exact_routing or own_routed is None else \
            self.routed.predict_all(mb, later_layers)
        walks = [walk] * len(later_layers) if predicted is None else walks_at(
            w.seen, predicted, routed, layer_part, walk.resident)
        at_decision = in_use
        before = bound if predicted is None else own_routed
        # Under EP, from layer to layer by what a layer was seen to leave and to grow to
        # its decision (LayerSteps); this layer's own growth to its decision left out once
        seen = None if self.exact_routing else self.steps.most(w.num_tokens)
        self.walked = []
        for later, there in zip(later_layers, walks):
            if later > layer and seen is None:   # the layer before it kept everything,
                at_decision += growth + self.keep_all_bytes(before) + post   # then attention
            elif later > layer:
                at_decision += seen[0] + self.keep_all_bytes(before) + (
                    max(growth, seen[1]) - self.growth if later == layer + 1 else 0)
            if not self.needs_no_eviction(later, at_decision, there):
                return False
            self.walked.append((later, at_decision, there.routed, there))
            before = there.routed
        return w.forecast.residency is None or later_forwards_fit(
            self, layer, in_use, per_layer, walk, own_routed)

    def _proven_at_entry(self, mb: int, layer: int, x) -> bool:
        """A micro-batch's first guarded layer, before its attention runs: covered whole
        from its entry where a layer of the same input shape ran hooked before (its
        measurement is carried across micro-batches and steps: same shapes, same bytes)
        and the proof holds already: under none always; under adaptive with this layer
        itself walked too, at its entry plus the growth measured there, at its routed
        count: exact before the router runs in one process (tokens x top-k), predicted
        from its recent forwards under expert parallelism (a prediction, as the later
        layers': a first layer that spikes beyond it leaves its attention part
        unevictable, and its own decision runs its experts hooked)."""
        carried = self._carried.get(tuple(x.shape))
        if carried is None or not self.window.num_tokens:
            return False
        if self.window.policy != "none" and not self._fits_at_entry(
                layer, carried, self.ledger.in_use()):
            return False
        self._measured[mb] = {op: carried[op] for op in MEASURED_OPS}
        self._covered_after[mb] = layer - 1
        return True

    def fits_from_start(self, layer: int, shape: tuple, in_use: int,
                        predicted: bool = False) -> bool:
        """Before a forward's embedding runs (runtime/hookless_ends.py): would its first
        guarded `layer`, on an input of `shape`, be proven at its entry with the device at
        `in_use` there, so that no decision of the micro-batch asks for eviction? Under
        adaptive, where a layer of that shape ran hooked: in one process on exact counts;
        under expert parallelism, where `predicted`, on each layer's predicted ones
        (`walked` then says where the walk put each layer: a calm forward checks them)."""
        carried = self._carried.get(shape)
        return carried is not None and self.window.policy == "adaptive" and \
            (self.exact_routing or predicted) and bool(self.window.num_tokens) and \
            self._fits_at_entry(layer, carried, in_use, most_growth=predicted)

    def leave_calm(self, shape: tuple) -> None:
        """A calm forward leaves calm at a layer (runtime/calm_forward.py): the layers
        after it are covered from their entry where that layer proves them, modelled as
        the last layer on an input of `shape` run hooked measured them."""
        carried = self._carried.get(shape)
        if carried is not None:
            self._measured[self.window.ctx.micro_batch] = {op: carried[op]
                                                           for op in MEASURED_OPS}

    def _fits_at_entry(self, layer: int, carried: dict, in_use: int,
                       most_growth: bool = False) -> bool:
        """The proof from `layer`'s entry at `in_use`, itself walked as a later layer at
        the growth `carried` measured there (the walk's step to the next layer reads it as
        this layer's). Its routed count: in one process exact; under expert parallelism
        what its recent forwards predict (no rise seen yet in the micro-batch), the later
        layers' alike, once each has the history (else no proof). `most_growth` (a calm
        forward's start, which checks each layer's decision against the walk): under
        expert parallelism its growth to the decision at least the most any layer grew
        (it grows with the rows it receives: layer 0 of `small` at EP=2 routes the most)."""
        w = self.window
        layer_part = carried["attn"] + carried["router"]
        growth = max(layer_part, carried["growth"])
        seen = None if self.exact_routing or not most_growth else self.steps.most(w.num_tokens)
        self.growth = growth = max(growth, seen[1]) if seen else growth
        if self.exact_routing:
            routed = own = int(w.seen.routed_per_token * w.num_tokens)
        else:
            routed = own = self.routed.predict(w.ctx.micro_batch, layer)
        return bool(routed) and self._layers_fit(layer, layer, in_use + growth, layer_part,
                                                 growth, routed, own)

    def needs_no_eviction(self, layer: int, in_use: int, walk) -> bool:
        """Would `layer`, at `in_use` after its attention part, decide with no eviction and
        no whole-layer fallback? The window's own procedure (plan/decide.py
        `fits_unaided`), on a prediction."""
        w = self.window
        extra = w.fsdp_extra(layer)
        forecast = walk.forecast or w.forecast
        grads = w.grads_to_come.get(layer, 0) if walk.grads is None else walk.grads
        entry = EntryState(layer, w.budget_bytes, in_use - walk.layer_part, w.num_tokens,
                           w.planner.min_bytes_per_token, walk.seen, walk.resident,
                           extra["forward_extra_bytes"], *w.exchange_rows)
        facts = LayerFacts(
            layer=layer, budget_bytes=w.budget_bytes, num_routed=walk.routed,
            layer_part_bytes=walk.layer_part, max_routed=walk.routed, num_tokens=w.num_tokens,
            min_bytes_per_token=w.planner.min_bytes_per_token, grads_to_come=grads,
            transient_bytes_per_routed=forward_transient_bytes_per_routed(self.shape, w.on_cuda),
            prefetch=w.engine.prefetch_enabled, last_layer=layer >= w.num_layers - 1,
            resident_backward_bytes=walk.resident,
            fixed_backward=w.layer_room.fsdp.layer_backward(layer), **extra)
        return fits_unaided(entry, facts, in_use, w.layer_room.room, forecast, w.planner)

    def keep_all_bytes(self, num_routed: int) -> int:
        return self.window.planner.fixed(ALL_SAVE, num_routed).device_bytes

    def _model(self, mb: int, layer: int, bytes_by_op: dict[str, int], t) -> None:
        """Attribute what ran hookless (module doc) until the gradient of `t` is ready."""
        keys = self.ledger.acquire_modelled(mb, layer, bytes_by_op)
        if keys:
            self._modelled.setdefault(mb, []).extend(keys)
            on_grad(t, functools.partial(self.ledger.release_all, keys))

    def forget_micro_batch(self, micro_batch: int) -> None:
        """A new forward of `micro_batch`: what an older one modelled and whose backward
        never ran (its gradient hook never fired) leaves the ledger."""
        self.ledger.release_all(self._modelled.pop(micro_batch, ()))
        self.ends.forget_micro_batch(micro_batch)
        self._covered_after.pop(micro_batch, None)
        self._measured.pop(micro_batch, None)
        self.routed.forget_micro_batch(micro_batch)
