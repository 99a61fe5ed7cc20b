"""Hookless ends: the stretch of a guarded forward before its first guarded layer (the
embedding) and the one after its last (the head: final norm, output projection, and the
loss where the model computes it) run with no saved-tensor hook where that is harmless,
their saved bytes modelled from the last forward of the same inputs' shapes that ran them
hooked.

One part of the guard (spikeguard.runtime.guard), beside runtime/hookless.py, which covers
the layers. On a calm step of `small` in one process every layer already runs hookless,
and the ends were what was left on the pack hook: 14 tensors packed and unpacked in Python
a step (2 of the embedding, 12 of the head). Measured against the guard before this module
(CPU, emulated device, the two packages side by side in one process, two runs of 80
interleaved rounds): -0.4 to +0.6 points of plain/this, not resolved from the noise.

Harmless where nothing of the step can want the ends' saved tensors off the device. Under
policy none nothing evicts; under adaptive the evictor never takes a saved tensor under
EVICTABLE_MIN_BYTES, whoever asks (the token ids of `small`: 9 KiB; a pipeline stage's
end that computes nothing: 0). Beyond those:
  * the head's: the window evicts only layers before the deciding one of the deciding
    micro-batch (runtime/hooks.py `evict`), and the head comes after every layer; another
    micro-batch's decisions evict only its own layers, except in a pipeline, whose
    residency may evict any layer of an older micro-batch: there the head runs hookless
    where the stage runs no forward before this micro-batch's backward (the residency's
    `later_forwards`: the last stage of a 1F1B schedule).
  * the embedding's: it comes before every layer, so the evictor may take it when a
    decision of the micro-batch (or, in a pipeline, of a forward before its backward)
    asks for room. It runs hookless where the layers' proof (runtime/hookless.py
    `fits_from_start`) already holds for the micro-batch's first guarded layer at its
    entry, before the embedding runs: where every layer's routed count is known then
    (one process: tokens x top-k), the device's figure at that entry is the one at the
    forward's start plus what the last forward of the same inputs' shapes rose by up to
    it, and no decision that could take it will ask for eviction. (A torchtitan model's
    dense first layers run before its first guarded layer, counted here as the
    embedding: 43 tensors a calm step of deepseek_v3 at the calm pages' sizes, hooked
    before under adaptive.)
A forward whose inputs' shapes (and keyword arguments) were not seen before, or one
recomputing every layer whole (the safety net's re-run), runs its ends hooked and is
measured. What is modelled is attributed to op "embed" (layer -1) and "head" (the layer
after the last), released when backward has passed the end (the gradient of the first
layer's input, of the last layer's output), as the hook's holders would be; a stale model
goes with the micro-batch's next forward (HooklessLayers.forget_micro_batch).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable, Optional

import torch

from spikeguard.memory.ledger import Ledger
from spikeguard.plan.residency import Residency
from spikeguard.runtime.grad_hooks import on_grad
from spikeguard.runtime.hooks import EVICTABLE_MIN_BYTES, SavedTensorTracker

EMBED_LAYER = -1


class HooklessEnds:
    """Starts a forward paused and ends it paused where the ends' bytes are known."""

    def __init__(self, tracker: SavedTensorTracker, ledger: Ledger, ctx, policy: str,
                 head_layer: int, last_layer: int, residency: Callable[[], Optional[Residency]],
                 recorder: Callable, fits_from_start: Callable[[int, tuple, int], bool]):
        self.tracker = tracker
        self.recorder = recorder         # the open step's record (None outside a step)
        self.ledger = ledger
        self.ctx = ctx                   # the position's context: the running micro-batch
        self.enabled = policy in ("adaptive", "none")
        self.policy = policy
        self.head_layer = head_layer     # the head's layer index in the ledger
        self.last_layer = last_layer     # the last guarded layer's index
        self.residency = residency       # a pipeline's residency (None outside one)
        # (first layer, its input's shape, the device's figure at its entry) -> proven
        self.fits_from_start = fits_from_start
        # Inputs' signature -> (embedding's bytes, head's bytes) of a forward run hooked.
        self._carried: dict[tuple, tuple[int, int]] = {}
        self._modelled: dict[int, list] = {}   # micro-batch -> its modelled ledger keys
        self._inputs: Optional[tuple] = None   # the running forward's signature
        # Inputs' signature -> (first guarded layer, its input's shape, how far the device's
        # figure rose from the forward's start to that layer's entry), as last seen.
        self._first: dict[tuple, tuple[int, tuple, int]] = {}
        self._start_in_use = 0    # the device's figure at the running forward's start
        self._before_first = False   # no guarded layer of the running forward entered yet
        self._embed_paused = False   # the running forward started paused
        self._head_paused = False    # its head runs paused

    @contextlib.contextmanager
    def hooked_forward(self, args, kwargs, whole_recompute: bool):
        """A guarded forward with the tracker's pair on: its ends paused where known, and
        measured where not (a forward that raises measures nothing)."""
        with self.tracker.hooks():
            self.begin(args, kwargs, whole_recompute)
            yield
            self.end()

    def begin(self, args, kwargs, whole_recompute: bool) -> None:
        """A guarded forward's hooks are on: paused for its embedding where known."""
        self._embed_paused = self._head_paused = False
        self._inputs = None
        if not self.enabled or whole_recompute or not torch.is_grad_enabled():
            return
        self._inputs = signature(args, kwargs)
        self._start_in_use = self.ledger.in_use()
        self._before_first = True
        known = self._carried.get(self._inputs)
        if known is not None and self._embed_harmless(known[0]):
            self.tracker.pause()
            self._embed_paused = True

    def calm_from_start(self, args, kwargs, in_use: int) -> bool:
        """Before a forward starts, the device at `in_use`: would it run hookless whole and
        keep everything, no decision asking for eviction (runtime/calm_forward.py)? Where a
        forward of the same inputs' shapes ran with its ends and first layer measured:
        under none always; under adaptive where the layers' proof holds from the first
        layer's entry (`fits_from_start`: in one process on exact counts; under expert
        parallelism on predicted ones, which the calm forward checks layer by layer)."""
        inputs = signature(args, kwargs)
        first = self._first.get(inputs)
        if not self.enabled or first is None or inputs not in self._carried:
            return False
        return self.policy == "none" or self.fits_from_start(
            first[0], first[1], in_use + first[2], predicted=True)

    def first_shape(self, args, kwargs) -> Optional[tuple]:
        """The first guarded layer's input shape on the last forward of these inputs'
        shapes that measured it (None: none did)."""
        first = self._first.get(signature(args, kwargs))
        return None if first is None else first[1]

    def _embed_harmless(self, embed_bytes: int) -> bool:
        """Nothing of the step can want the embedding's saved tensors (module doc)."""
        if self._never_evicted(embed_bytes):
            return True
        first = self._first.get(self._inputs)
        return first is not None and self.fits_from_start(
            first[0], first[1], self._start_in_use + first[2])

    def _head_harmless(self, head_bytes: int) -> bool:
        """Nothing of the step can want the head's saved tensors (module doc)."""
        residency = self.residency()
        return self._never_evicted(head_bytes) or residency is None \
            or residency.later_forwards() == ()

    def _never_evicted(self, num_bytes: int) -> bool:
        return self.policy == "none" or num_bytes < EVICTABLE_MIN_BYTES

    def first_layer(self, layer: int, x) -> None:
        """A guarded layer starts on `x`: if the embedding ran paused, the hook is back
        (the layer pauses it again where it is covered), and the embedding's model is
        released with `x`'s gradient. The forward's first one notes how far the device
        rose to its entry, for the next forward of the same inputs' shapes."""
        if self._before_first and self._inputs is not None and torch.is_tensor(x):
            self._before_first = False
            self._first[self._inputs] = (layer, tuple(x.shape),
                                         self.ledger.in_use() - self._start_in_use)
        if self._embed_paused:
            self._embed_paused = False
            self.tracker.resume()
            self._model(EMBED_LAYER, "embed", self._carried[self._inputs][0], x)

    def last_layer_done(self, layer: int, out) -> bool:
        """Guarded `layer` returned `out`: True where it is the last and the head runs
        paused (its model released with `out`'s gradient)."""
        if layer != self.last_layer or self._inputs is None:
            return False
        out = out[0] if isinstance(out, (tuple, list)) else out
        known = self._carried.get(self._inputs)
        if known is None or not (torch.is_tensor(out) and out.requires_grad) \
                or not self._head_harmless(known[1]):
            return False
        self.tracker.pause()
        self._head_paused = True
        self._model(self.head_layer, "head", known[1], out)
        return True

    def end(self) -> None:
        """The forward returned: one whose ends ran hooked leaves their measurement for
        the next forward of its inputs' shapes."""
        mb = self.ctx.micro_batch
        if self._inputs is not None and not self._head_paused:
            self._carried[self._inputs] = (self.ledger.bytes_by(mb, EMBED_LAYER, "embed"),
                                           self.ledger.bytes_by(mb, self.head_layer, "head"))
        self._inputs = None
        self._embed_paused = self._head_paused = self._before_first = False

    def forget_micro_batch(self, micro_batch: int) -> None:
        """A new forward of `micro_batch`: an older one's model whose backward never ran
        leaves the ledger."""
        self.ledger.release_all(self._modelled.pop(micro_batch, ()))

    def _model(self, layer: int, op: str, num_bytes: int, t) -> None:
        step = self.recorder()
        if step is not None:
            step.hookless_ends += 1
        mb = self.ctx.micro_batch
        keys = self.ledger.acquire_modelled(mb, layer, {op: num_bytes})
        if keys and torch.is_tensor(t) and t.requires_grad:
            self._modelled.setdefault(mb, []).extend(keys)
            on_grad(t, functools.partial(self.ledger.release_all, keys))
        else:
            self.ledger.release_all(keys)


def signature(args, kwargs) -> tuple:
    """What the ends' saved bytes depend on, as far as the call shows: each tensor
    argument's shape and dtype, every other argument's value where it is a plain one."""
    def one(v):
        if torch.is_tensor(v):
            return (tuple(v.shape), v.dtype, v.requires_grad)
        return v if isinstance(v, (bool, int, float, str, type(None))) else type(v).__name__
    return (tuple(one(a) for a in args),
            tuple(sorted((k, one(v)) for k, v in kwargs.items())))
