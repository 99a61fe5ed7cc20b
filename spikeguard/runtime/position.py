"""Where the guarded model is now: forward or backward, micro-batch, layer, operator.

One part of the guard (spikeguard.runtime.guard). The saved-tensor hooks attribute what
they keep to `ctx` (micro-batch, layer, op); the device keeps a peak per position code
(`set_where`), which the layer peaks calibrate from and an out-of-memory message names
(`device_oom`). Forward moves the position with module hooks on the blocks and the head;
backward has no module hooks that fire for recomputed layers, so `mark_backward` puts a
gradient hook on a tensor whose gradient tells when backward reaches a (layer, op).
"""

from __future__ import annotations

import functools

import torch

from spikeguard.errors import DeviceOutOfMemory
from spikeguard.runtime.device_state import (PHASE_BACKWARD, PHASE_FORWARD, PHASE_IDLE,
                                             oom_text, place_text, where_code,
                                             HEAD_LAYER)
from spikeguard.runtime.hooks import Context
from spikeguard.runtime.grad_hooks import on_grad


class Position:
    """The position of one guard's model, kept in `ctx` and in the device's position code."""

    def __init__(self, ctx: Context, meter, num_layers: int, budget_bytes: int):
        self.ctx = ctx
        self.meter = meter
        self.num_layers = num_layers   # the head's layer index in the ledger (its position
        #                                code is HEAD_LAYER: see device_state)
        self.budget_bytes = budget_bytes
        self.phase = PHASE_IDLE
        self.in_forward = False        # False during backward's recompute and evaluation
        self.plain = False             # guard.unguarded(): forwards are the model's own
        self.calm = False              # a calm forward runs (runtime/calm_forward.py)

    def set_where(self, phase: int, layer: int) -> int:
        """Move the device's position code; returns the previous one."""
        self.phase = phase
        return self.meter.set_where(where_code(phase, layer, self.ctx.micro_batch))

    def at_head_backward(self) -> None:
        """A forward is done: what runs next on this micro-batch is the head's backward."""
        self.ctx.layer, self.ctx.op = self.num_layers, "head"
        self.set_where(PHASE_BACKWARD, HEAD_LAYER)

    def enter_layer(self, layer: int) -> None:
        self.ctx.layer, self.ctx.op = layer, "attn"
        self.set_where(PHASE_FORWARD, layer)

    def mark_backward(self, t, layer: int, op: str) -> None:
        """When backward reaches `t`, the device's position becomes (backward, layer, op)."""
        t = t[0] if isinstance(t, (tuple, list)) else t
        if torch.is_tensor(t) and t.requires_grad:
            on_grad(t, functools.partial(self.enter_backward, self.ctx.micro_batch,
                                         layer, op))

    def enter_backward(self, mb: int, layer: int, op: str, grad) -> None:
        self.ctx.micro_batch, self.ctx.layer, self.ctx.op = mb, layer, op
        self.set_where(PHASE_BACKWARD, layer)

    def device_oom(self, err: BaseException) -> DeviceOutOfMemory:
        """The one-line error of an out-of-memory, naming where it happened."""
        if isinstance(err, DeviceOutOfMemory):
            return err
        place = place_text(self.phase, self.ctx.micro_batch, self.ctx.layer, self.ctx.op)
        asked, after = self.meter.last_refusal()
        return DeviceOutOfMemory(oom_text(place, self.meter, err), needed_bytes=after,
                                 budget_bytes=self.budget_bytes)

    # ---- forward's module hooks ---------------------------------------------------------
    def enter_shared(self, module, args) -> None:
        if self.in_forward:
            self.ctx.tags.clear()  # combine is done: no tensor of the expert path is saved later
            self.ctx.op = "shared"

    def enter_moe(self, block, args) -> None:
        if self.in_forward:
            self.ctx.op = "router"

    def leave_moe(self, block, args, output) -> None:
        if self.in_forward:
            self.ctx.tags.clear()
            self.ctx.op = "attn"
        elif torch.is_grad_enabled() and not self.plain:   # a recompute in backward re-ran the block: nothing
            forget_aux_loss(block)      # reads its aux loss there (evaluation does)

    def enter_head(self, module, args, output) -> None:
        if self.in_forward:
            self.ctx.layer, self.ctx.op = self.num_layers, "head"
            self.set_where(PHASE_FORWARD, HEAD_LAYER)


def forget_aux_loss(block) -> None:
    """A block's aux loss holds its graph (and what it saved) alive: dropped when unread."""
    if getattr(block, "last_aux_loss", None) is not None:
        block.last_aux_loss = None
