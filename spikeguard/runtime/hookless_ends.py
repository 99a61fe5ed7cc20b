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

Harmless where nothing of the step can want the ends' saved tensors off the device:
  * the head's: the window evicts only layers before the deciding one of the deciding
    micro-batch (runtime/hooks.py `evict`), and the head comes after every layer; another
    micro-batch's decisions evict only its own layers, except in a pipeline, whose
    residency may evict any layer of an older micro-batch: in a pipeline the ends stay
    hooked.
  * the embedding's: it comes before every layer, so the evictor may take it, but only
    saved tensors of EVICTABLE_MIN_BYTES or more: it runs hookless where its measured bytes
    are below that (the token ids of `small`: 9 KiB), or under policy none (nothing evicts).
A forward whose inputs' shapes (and keyword arguments) were not seen before, or one
recomputing every layer whole (the safety net's re-run), runs its ends hooked and is
measured. What is modelled is attributed to op "embed" (layer -1) and "head" (the layer
after the last), released when backward has passed the end (the gradient of the first
layer's input, of the last layer's output), as the hook's holders would be; a stale model
goes with the micro-batch's next forward (HooklessLayers.forget_micro_batch).
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import torch

from spikeguard.memory.ledger import Ledger
from spikeguard.runtime.grad_hooks import on_grad
from spikeguard.runtime.hooks import EVICTABLE_MIN_BYTES, SavedTensorTracker

EMBED_LAYER = -1


class HooklessEnds:
    """Starts a forward paused and ends it paused where the ends' bytes are known."""

    def __init__(self, tracker: SavedTensorTracker, ledger: Ledger, ctx, policy: str,
                 head_layer: int, last_layer: int, in_pipeline: Callable[[], bool],
                 recorder: Callable):
        self.tracker = tracker
        self.recorder = recorder         # the open step's record (None outside a step)
        self.ledger = ledger
        self.ctx = ctx                   # the position's context: the running micro-batch
        self.enabled = policy in ("adaptive", "none")
        self.policy = policy
        self.head_layer = head_layer     # the head's layer index in the ledger
        self.last_layer = last_layer     # the last guarded layer's index
        self.in_pipeline = in_pipeline   # a pipeline's residency is on
        # Inputs' signature -> (embedding's bytes, head's bytes) of a forward run hooked.
        self._carried: dict[tuple, tuple[int, int]] = {}
        self._modelled: dict[int, list] = {}   # micro-batch -> its modelled ledger keys
        self._inputs: Optional[tuple] = None   # the running forward's signature
        self._embed_paused = False   # the running forward started paused
        self._head_paused = False    # its head runs paused

    def begin(self, args, kwargs, whole_recompute: bool) -> None:
        """A guarded forward's hooks are on: paused for its embedding where known."""
        self._embed_paused = self._head_paused = False
        self._inputs = None
        if not self.enabled or whole_recompute or not torch.is_grad_enabled() \
                or self.in_pipeline():
            return
        self._inputs = _signature(args, kwargs)
        known = self._carried.get(self._inputs)
        if known is not None and (self.policy == "none" or known[0] < EVICTABLE_MIN_BYTES):
            self.tracker.pause()
            self._embed_paused = True

    def first_layer(self, x) -> None:
        """A guarded layer starts on `x`: if the embedding ran paused, the hook is back
        (the layer pauses it again where it is covered), and the embedding's model is
        released with `x`'s gradient."""
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
        if known is None or not (torch.is_tensor(out) and out.requires_grad):
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
        self._embed_paused = self._head_paused = False

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


def _signature(args, kwargs) -> tuple:
    """What the ends' saved bytes depend on, as far as the call shows: each tensor
    argument's shape and dtype, every other argument's value where it is a plain one."""
    def one(v):
        if torch.is_tensor(v):
            return (tuple(v.shape), v.dtype, v.requires_grad)
        return v if isinstance(v, (bool, int, float, str, type(None))) else type(v).__name__
    return (tuple(one(a) for a in args),
            tuple(sorted((k, one(v)) for k, v in kwargs.items())))
