"""The transformer layers around the MoE blocks: their entry, and whole-layer recompute.

One part of the guard (spikeguard.runtime.guard), which puts `forward` in place of each
layer's forward. At a layer's entry in a guarded forward it moves the position and tells
the window (the device's figure there is what the layer's growth is measured from); the
layer runs whole under a non-reentrant checkpoint when every layer is recomputed (policy
"full", or the safety net's re-run) or when the window finds it cannot fit even at the
least plan. The flag `in_full_region` is set inside the checkpointed function, so
backward's recompute takes the same path as the forward did. Where the group votes on
each fallback (`falls_back`), a calm layer (runtime/calm_forward.py) votes too, and runs
whole, still calm, where a peer's vote carries.
"""

from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from spikeguard.errors import UsageError
from spikeguard.memory.ledger import Ledger
from spikeguard.runtime.hookless import HooklessLayers
from spikeguard.runtime.grad_hooks import on_grad
from spikeguard.runtime.position import Position, forget_aux_loss
from spikeguard.runtime.window import DecisionWindow


class GuardedLayers:
    """Entry bookkeeping and whole-layer recompute of the layers holding the MoE blocks."""

    def __init__(self, adapter, blocks: list, position: Position, window: DecisionWindow,
                 ledger: Ledger, hookless: HooklessLayers, full_recompute: bool, agreement=None):
        self.adapter = adapter
        # Set where a layer recomputed whole re-issues a collective: the group agrees on
        # each fallback (BlockAdapter.layer_fallback_agreed).
        self.agreement = agreement
        self.agree_fallback = False   # set at attach: some rank of the group is adaptive
        self.blocks = blocks
        self.position = position
        self.window = window
        self.ledger = ledger
        self.hookless = hookless
        self.full_recompute = full_recompute   # every layer recomputed whole
        self.in_full_region = False            # inside a whole-layer checkpoint

    def forward(self, layer, orig_forward, layer_idx, *args, **kwargs):
        """In place of `layer.forward` (bound with functools.partial by the guard)."""
        if layer_idx == 0 and args and torch.is_tensor(args[0]) and args[0].requires_grad \
                and self.position.in_forward:
            # When backward reaches the first layer's input, the micro-batch's backward
            # through every guarded layer is done (recomputed whole or not, calm or not).
            on_grad(args[0], functools.partial(self.window.backward_done,
                                               self.position.ctx.micro_batch))
        if self.position.calm:   # proven before the forward began (runtime/calm_forward.py)
            self.position.enter_layer(layer_idx)   # an out-of-memory line names the layer
            self.window.enter_layer(self.ledger.in_use())   # should it leave calm in there
            if self.votes and self.agreement.vote(False, _calm_promise):
                return self._whole(layer, orig_forward, layer_idx, args, kwargs)
            return orig_forward(*args, **kwargs)
        if not self.position.in_forward:
            return self._body(layer, orig_forward, layer_idx, args, kwargs)
        self.position.enter_layer(layer_idx)
        self.window.enter_layer(self.ledger.in_use())
        x = args[0] if args else None
        if not self.full_recompute:
            self.hookless.enter_layer(layer_idx, x)
        out = self._body(layer, orig_forward, layer_idx, args, kwargs)
        self.hookless.leave_layer(layer_idx, x, out)
        self.position.mark_backward(out, layer_idx, "combine")
        self.window.watch_backward(out, layer_idx)
        return out

    def _body(self, layer, orig_forward, layer_idx, args, kwargs):
        if torch.is_grad_enabled() and (self.full_recompute or (
                self.position.in_forward and self.falls_back(layer_idx))):
            return self._whole(layer, orig_forward, layer_idx, args, kwargs)
        return orig_forward(*args, **kwargs)

    def _whole(self, layer, orig_forward, layer_idx, args, kwargs):
        """The layer recomputed whole: a non-reentrant checkpoint that saves its inputs
        (the windows inside see `in_full_region`, in the forward and in backward's
        recompute alike, calm or not)."""
        kwargs = self.adapter.recompute_kwargs(layer, kwargs)
        return checkpoint(functools.partial(self._full_region, orig_forward, layer_idx), *args,
                          use_reentrant=False, **kwargs,
                          context_fn=functools.partial(create_selective_checkpoint_contexts,
                                                       self.adapter.layer_policy))

    def agree_at_attach(self, policy: str) -> None:
        """Where a layer recomputed whole re-issues a collective (BlockAdapter), "full" on
        some ranks of the group and not on others would hang them in backward: refused on
        every rank, at attach (which every rank calls). The per-layer vote then runs on
        every rank where some rank is adaptive (a static rank votes no), on none else."""
        if self.agreement is None:
            return
        full = policy == "full"
        if self.agreement.any_rank(full) and self.agreement.any_rank(not full):
            raise UsageError("policy 'full' must be every rank's or none's under this expert "
                             "parallelism (a layer recomputed whole re-runs its count "
                             "exchange, which every rank must then run too)")
        self.agree_fallback = self.agreement.any_rank(policy == "adaptive")

    @property
    def votes(self) -> bool:
        """Whether each layer's forward casts the group's whole-layer fallback vote (a
        collective every rank makes at the same layer; not under full recompute)."""
        return self.agreement is not None and self.agree_fallback and not self.full_recompute

    def falls_back(self, layer_idx: int) -> bool:
        """Adaptive's whole-layer fallback for this layer: the window's, agreed by the group
        where one rank alone recomputing would re-issue a collective the others do not
        (every rank reaches this point of every layer's forward, whatever it decided)."""
        mine = self.window.layer_cannot_fit(layer_idx)   # always False unless adaptive
        if self.agreement is None or not self.agree_fallback:
            return mine
        return self.agreement.vote(mine, functools.partial(self.window.promise, layer_idx))

    def _full_region(self, orig_forward, layer_idx, *args, **kwargs):
        outer, self.in_full_region = self.in_full_region, True
        try:
            return orig_forward(*args, **kwargs)
        finally:
            self.in_full_region = outer
            if not self.position.in_forward and torch.is_grad_enabled():
                # Backward's recompute of the layer (stopped early by torch's non-reentrant
                # checkpoint, so no forward hook of the block runs): the block's aux loss
                # would keep the recomputed graph alive past backward.
                forget_aux_loss(self.blocks[layer_idx])


def _calm_promise() -> bool:
    """A calm forward's promise at its layers' votes: its start proof found every layer
    keeping everything, so none of its layers needs the whole-layer fallback (a prediction
    under expert parallelism, as a hooked layer's promise is: runtime/window.py
    `promise`)."""
    return True
