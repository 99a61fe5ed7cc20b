"""Calm forwards: a micro-batch proven, before it starts, to keep everything with no
hook runs as the plain model's own forward.

One part of the guard (spikeguard.runtime.guard). In one process every layer routes
exactly tokens x top-k copies (dropless top-k), so what a forward of inputs already seen
will hold is known before its embedding runs. Where the proof of runtime/hookless.py holds
from the forward's start (`HooklessEnds.calm_from_start`: under none always, since nothing
of its step offloads or evicts; under adaptive the layers' walk from the first layer's
entry at the device's figure now, every layer keeping everything with no eviction asked),
every layer would decide to keep everything and run hookless, and both ends too: the
per-layer bookkeeping of that path (the position's labels and backward marks, the
ledger's modelled bytes, the decision and its proof, layer by layer) only re-derives what
is already known. A calm forward skips it: the layers run their own forwards, the expert
windows record their plan (keep everything) and their counts for the step's record, and
nothing else.

Why: on a calm step of `small` on CPU that bookkeeping, not the saved-tensor hooks (gone
already on hookless layers) nor the emulated device, was the guard's cost (scratch ablation,
one process, 120 interleaved rounds, CPU clock: plain/this 0.985 under none, 0.978 under
adaptive, 0.993 with the layers' and windows' guard code bypassed, 0.996 for the plain model
on the active emulated device).

What a calm forward does not do, and why that is safe:
  * no decision reacts to what the device shows at a layer: the proof was made at the
    forward's start with exact counts (under expert parallelism predicted ones, checked
    at each layer: below) and the growth measured on the last forward of the same
    shapes; a forward that still runs out is re-run by the safety net, with every layer
    recomputed whole (never calm);
  * nothing is modelled in the ledger per layer: outside a pipeline another micro-batch's
    decisions evict only their own layers (runtime/hooks.py `evict`), so nothing needs
    these. In a pipeline the later forwards' proofs and reserves read what each resident
    micro-batch holds (plan/residency.py `device_bytes`, runtime/hookless_walk.py: what a
    backward frees before a later forward): a calm forward models what it left on the
    device, its growth from start to end, as one entry (op "forward", layer -1), let go
    of when its backward reaches the first layer's input (`window.calm_models`). Nothing
    of it is evictable (no hook held it), as a hookless layer's is not: the start proof
    walked the forwards the stage runs before its backward (`later_forwards_fit`), as
    the hooked path's proof at a first layer does. What its backward will add above its
    forward's end is left for a forward that runs before that backward, as the last
    hooked forward predicted it (`window.pending_backward`);
  * the forecast, the layer peaks and the cost model learn nothing from it: they keep
    what the last forward of the same shapes run with hooks taught them (a calm forward
    holds the same);
  * the device's position labels follow the layers' entries in the forward but not the
    backward (they stay at the head's), so a calm step's record names its peak's phase
    and, in backward, the head rather than a layer.
Under expert parallelism a rank's counts move from layer to layer and are known only once
exchanged. Under none nothing depends on them. Under adaptive the start proof walks each
layer at the copies it predicts (runtime/routed_history.py: the most of that layer's last
16 forwards, a spike's of its last 4, plus 5%), as the hooked path's proof at a
micro-batch's first layer does, and the calm forward checks each layer against that walk
once its counts are in (`keeps`): a layer that routes more copies than the walk put it at,
or finds the device above the figure the walk put its decision at by more than the walk's
layers from there have room for, leaves calm there (a spike, or a layer grown past its
history): that layer decides as on the hooked path, and the forward runs hooked from it on
(the tracker's pair entered until the forward returns). Every earlier layer kept
everything, as the walk that cleared them assumed of them, and nothing of theirs was
evictable: the hooked path's covered layers are no different. A calm forward makes the
same collectives as a hooked one (the dispatcher's counts exchanges and exchanges, a
family's flag points at its units, the net's end-of-attempt flag point: none of them is
the layers' guard code), so each rank runs calm or not on its own; a pipeline's stages
alike (each stage's guard proves its own forwards). Where the layers cast the group's
whole-layer fallback vote (transformers' EP with some rank adaptive: a collective at a
layer's entry until every rank has promised that no later layer of the attempt needs it),
a calm layer casts its vote too, no, with that promise (its start proof found every layer
keeping everything), and where a peer's yes carries the group it runs whole as they do,
still calm: its windows see the full region, as a hooked layer's do (runtime/layers.py).
Not while a caller's own callable stands in for a method of the guard, its planner or its
window (`seams_replaced`). FSDP2 units (torchtitan applies them even on one rank,
transformers under its DistributedConfig) change nothing of this: their all-gathers,
reshards and flag points are module hooks of FSDP2's and of the family's journal, not the
layers' guard code, and the bytes they add above each layer's decision are in the walk's
own procedure (`needs_no_eviction` reads the window's FSDP2 terms per layer, as the hooked
path's proof does; tests/integrations/test_integrations_titan_fsdp.py: calm forwards on
one rank and two, EP included, bitwise and under the budget).

A calm layer still moves the device's position label to itself and notes its entry's
figure (two calls), so that an out-of-memory line names the layer as the hooked path's
would, and a layer that leaves calm decides from its own entry; its backward is not
labelled per layer (the labels stay at the head's backward).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Callable, Optional

import torch

from spikeguard.runtime.device_state import PHASE_FORWARD
from spikeguard.runtime.hookless import HooklessLayers
from spikeguard.runtime.hooks import innermost_saved_tensor_hooks
from spikeguard.runtime.hookless_ends import EMBED_LAYER, signature
from spikeguard.runtime.position import Position


class CalmForwards:
    """Says which forwards run calm, runs them so, and keeps the evidence it stands on."""

    def __init__(self, hookless: HooklessLayers, position: Position,
                 seams_own: Callable[[], bool]):
        self.hookless = hookless
        self.position = position
        # Tests that study the hooked path on the later steps turn `enabled` off.
        self.enabled = hookless.enabled
        # False while a caller has put its own callable in place of a method of the
        # guard, its planner or its window (`seams_replaced`: the oracle bench's plan
        # table, gpu_check's blind prevention, a test's forced plan or watcher): every
        # layer then reaches it.
        self.seams_own = seams_own
        # Inputs' signature -> [(device's figure at the start, gradient bytes its backward was
        # to add, slack)] of hooked forwards of those shapes that kept every layer whole and
        # hookless, with no eviction: under adaptive a calm forward starts no higher and adds
        # no more than one of them, but for its slack (the proof alone is a prediction: at
        # 0.85x it passed where the window's own decisions moved something, and the head's
        # backward ran out). A micro-batch after another's backward starts higher with less to
        # add, so a few are kept, none below another. A hooked forward that cut something
        # (`_cuts`) voids what was seen of its shapes; one that kept everything but not every
        # layer hookless (a proof that fell short: its walk at a spike's counts still
        # remembered) voids nothing, and adds nothing (taken as evidence, stage 0 of PP=2 x
        # EP=2 ran 7 of its 8 layers hookless on its second step, not 8:
        # tests/parallel/test_parallel_pp.py; the mechanism was not traced). Each is `_Seen`:
        # once its step has ended, a forward may start as far above it as that step stayed
        # under the budget (`step_done`), since starting higher by some bytes puts every figure
        # of the same forward and backward that much higher; the device's figure at a forward's
        # start moves by a few bytes from step to step (a pipeline's buffers, freed by the
        # process group's thread as it goes), and compared exactly one forward of four ran
        # hooked at random (CI, PP=2 x EP=2).
        self._kept: dict[tuple, list[_Seen]] = {}
        self._unconfirmed: list[_Seen] = []   # noted in the step under way
        # Under expert parallelism (adaptive), layer -> (the device's figure at its
        # decision, its routed copies, the walk it was asked on) where the running calm
        # forward's start proof walked it: a layer beyond either leaves calm (`keeps`).
        # None: nothing to check (one process: exact counts; policy none: nothing of it
        # depends on them).
        self._bounds: Optional[dict[int, tuple]] = None
        self._stack: Optional[contextlib.ExitStack] = None   # the running calm forward's
        self._top = None      # autograd's innermost saved-tensor hooks at its start
        self._left = False    # it left calm at a layer
        self._shape: Optional[tuple] = None   # its first guarded layer's input shape
        self.ran_calm = False   # the last forward ran calm to its end (the guard reads it)

    @contextlib.contextmanager
    def forward(self, args, kwargs, whole_recompute: bool):
        """A guarded forward (after `window.begin_micro_batch`): calm where proven, else
        hooked, and noted where it kept everything. `ran_calm` says after it whether it
        ran calm to its end (a calm forward teaches the forecast nothing new)."""
        h = self.hookless
        self.ran_calm = False
        inputs = signature(args, kwargs)
        in_use = h.ledger.in_use()
        grads = max(h.window.grads_to_come.values(), default=0)
        if self._proven(inputs, args, kwargs, in_use, grads, whole_recompute):
            with self._running(in_use):
                yield
            self.ran_calm = not self._left
            if self._left:   # beyond the walk: these shapes run hooked again, once
                self._kept.pop(inputs, None)
            return
        step = h.window.recorder()
        before = None if step is None else (_cuts(step), step.hookless_layers)
        with h.ends.hooked_forward(args, kwargs, whole_recompute):
            yield
        if before is not None and not whole_recompute and self.enabled:
            if _cuts(step) != before[0]:   # it cut something: what was seen stands no more
                self._note(inputs, None)
            elif step.hookless_layers - before[1] == h.window.num_layers:
                self._note(inputs, (in_use, grads))

    def _note(self, inputs: tuple, state) -> None:
        """A hooked forward of `inputs` from `state` kept everything (None: it did not,
        and what was seen of those shapes stands no more)."""
        if state is None:
            self._kept.pop(inputs, None)
            return
        new = _Seen(*state)
        seen = [s for s in self._kept.get(inputs, ()) if not new.dominates(s)]
        if not any(s.dominates(new) for s in seen):
            seen.append(new)
            self._unconfirmed.append(new)
        self._kept[inputs] = seen[-4:]

    def step_done(self, peak: int, budget: int) -> None:
        """The step ended with the device's peak at `peak` under `budget`: each forward
        noted in it ran, with its backward, that far under the limit (`_Seen.slack`)."""
        for seen in self._unconfirmed:
            seen.slack = max(0, budget - peak)
        self._unconfirmed.clear()

    def _proven(self, inputs, args, kwargs, in_use: int, grads: int,
                whole_recompute: bool) -> bool:
        h = self.hookless
        if not (self.enabled and h.enabled and self.seams_own()) or whole_recompute \
                or not torch.is_grad_enabled():
            return False
        if h.window.policy == "adaptive" and not any(
                s.covers(in_use, grads) for s in self._kept.get(inputs, ())):
            return False
        if not h.ends.calm_from_start(args, kwargs, in_use):
            return False
        self._bounds = None if h.exact_routing or h.window.policy == "none" else {
            layer: (at, routed, walk) for layer, at, routed, walk in h.walked}
        self._shape = h.ends.first_shape(args, kwargs)
        return True

    def keeps(self, layer: int, num_routed: int) -> bool:
        """In a calm forward, at `layer`'s expert path, its routed copies `num_routed`
        known: does it stay calm? Always in one process and under none; under expert
        parallelism where its copies do not pass where the start proof's walk put them,
        and the device's figure now does not either, or passes it by no more than the
        walk's layers from here have room for (`_room_for`). Then every later step of
        that walk, made from there, still holds. Where not, the forward leaves calm here
        (`_leave`): this layer decides as on the hooked path, and the layers after it run
        hooked (covered from their entry where that decision proves them, as on the hooked
        path). A proof made again here instead, as `hookless.proven` makes it, is not
        enough: it kept everything where the hooked path's decision moved something
        (tiny, EP=2, 1.05x)."""
        bounds = self._bounds
        if bounds is None:
            return True
        h = self.hookless
        at, routed, _ = bounds.get(layer, (-1, -1, None))
        if num_routed <= routed and self._room_for(layer, h.ledger.in_use() - at):
            h.routed.note(h.window.ctx.micro_batch, layer, num_routed)
            return True
        return not self._leave()

    def _room_for(self, layer: int, over: int) -> bool:
        """The device stands `over` bytes above where the start proof's walk put `layer`'s
        decision: do that layer and every later one it walked still decide with no
        eviction, each asked again on its own walk that much higher? Compared to the byte
        instead, a calm forward left calm on a few bytes of the process group's buffers
        (gloo's thread frees them when it gets to them; CI, transformers' EP: 1 calm
        forward of 2). Not under a pipeline: the walk also read the forwards the stage
        runs before this one's backward (`later_forwards_fit`), from its start."""
        if over <= 0:
            return True
        h = self.hookless
        if h.window.forecast.residency is not None:
            return False
        return all(h.needs_no_eviction(later, at + over, walk)
                   for later, (at, _, walk) in self._bounds.items() if later >= layer)

    def _leave(self) -> bool:
        """Hooked from here to the forward's end: the tracker's pair entered (taken off
        when the forward returns), the calm flag down. Not where a saved-tensor hook of
        someone else's was entered inside the forward and is still on (its exit would
        then pop this pair): it stays calm, and a forward that runs out is re-run by the
        safety net."""
        if innermost_saved_tensor_hooks() != self._top:
            return False
        self.position.calm = False
        self._left = True
        self._stack.enter_context(self.hookless.tracker.hooks())
        if self._shape is not None:
            self.hookless.leave_calm(self._shape)
        return True

    def forget(self) -> None:
        """An attempt failed: what the hooked forwards showed is no evidence any more."""
        self._kept.clear()
        self._unconfirmed.clear()

    @contextlib.contextmanager
    def _running(self, in_use: int):
        """The forward inside runs calm, from the device at `in_use`: the layers' and the
        windows' guard code steps aside (runtime/layers.py, the adapters' windows)."""
        self.position.calm = True
        self._left = False
        self._top = innermost_saved_tensor_hooks()
        self.position.set_where(PHASE_FORWARD, EMBED_LAYER)
        w = self.hookless.window
        step = w.recorder()
        try:
            with contextlib.ExitStack() as self._stack:
                yield
        finally:
            self.position.calm = False
            self._stack = None
        if self._left:   # its hooked part decided and is observed as a hooked forward's
            if step is not None:
                step.calm_left += 1
            return
        if w.last_backward_excess is not None:
            # What its backward will add above the device as it leaves it, as the last
            # hooked forward predicted (same shapes): a later forward that runs before
            # that backward leaves room for it (window.backward_done drops it).
            w.pending_backward[self.position.ctx.micro_batch] = w.last_backward_excess
        if w.forecast.residency is not None:   # a pipeline: the module doc
            mb, ledger = self.position.ctx.micro_batch, self.hookless.ledger
            w.calm_models[mb] = ledger.acquire_modelled(
                mb, EMBED_LAYER, {"forward": max(0, ledger.in_use() - in_use)})
        if step is not None:   # both ends ran with no hook, as a hooked calm forward's do
            step.hookless_ends += 2
            step.calm_forwards += 1

    def run_layer(self, record_plan: Callable, layer: int, counts, plan, call, *inputs):
        """A layer's expert path in a calm forward (the built-in window, the shared region
        of transformers and torchtitan): its plan (keep everything) and counts recorded
        for the step's record (`record_plan`: the guard's), counted as a hookless layer of
        the step, and the experts called on `inputs`."""
        record_plan(layer, counts, plan)
        step = self.hookless.window.recorder()
        if step is not None:
            step.hookless_layers += 1
        return call(*inputs)


def _cuts(step) -> tuple:
    """What a step's record counts of a forward cutting anything: the plans of the attempt
    under way that recompute or offload an op, the bytes evicted, the layers recomputed
    whole at entry. A hooked forward that leaves them all as they were kept everything,
    hookless or not."""
    return (step.attempt["recompute"], step.attempt["offload"], step.evicted_bytes,
            step.full_layers)


@dataclasses.dataclass
class _Seen:
    """A hooked forward that kept everything: the device's figure at its start, the
    gradient bytes its backward was to add, and `slack`, how far under the budget its step's
    peak stayed (0 until that step has ended: its backward had not run)."""
    in_use: int
    grads: int
    slack: int = 0

    def covers(self, in_use: int, grads: int) -> bool:
        """A forward from `in_use` with `grads` to add stays where this one did, give or
        take its slack: what it starts above and adds above this one fits the slack."""
        return max(0, in_use - self.in_use) + max(0, grads - self.grads) <= self.slack

    def dominates(self, other: "_Seen") -> bool:
        """Every forward `other` covers, this one covers."""
        return (self.in_use >= other.in_use and self.grads >= other.grads
                and self.slack >= other.slack)


def seams_replaced(*objects) -> bool:
    """Whether a caller has put a callable of its own in place of a method of one of
    `objects` (an instance attribute shadowing its class's method: `guard.decide = ...`,
    `guard.planner.fixed = ...`); the guard's own parts set none."""
    for o in objects:
        own = vars(o)
        if any(callable(own[k]) for k in own.keys() & _methods(type(o))):
            return True
    return False


@functools.lru_cache(maxsize=None)
def _methods(cls: type) -> frozenset:
    """The names of `cls`'s callable attributes (asked at every forward: a set of them
    met with an instance's names costs a set intersection, not a lookup per name)."""
    return frozenset(k for k in dir(cls) if callable(getattr(cls, k, None)))
