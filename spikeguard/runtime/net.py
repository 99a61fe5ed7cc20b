"""The safety net of one micro-batch's forward, and the expert-parallel group's agreement.

One part of the guard (spikeguard.runtime.guard): every guarded forward of the model runs
through `MicroBatchNet.forward`. Under "adaptive", a forward that runs out of memory is
freed and run again with every layer recomputed; if even that does not fit, the error
says the budget that would (measured with the emulated budget lifted).

Under expert parallelism (an `OverflowAgreement` given, spikeguard.runtime.agreement) an
adaptive rank that overflows finishes its forward anyway (its all-to-alls must match the
others'), then the group agrees on one flag per micro-batch, so the adaptive ranks take
the re-run together. The net reaches the guard only through its public surface.
"""

from __future__ import annotations

import gc
import logging
from typing import Optional

import torch

from spikeguard.errors import BudgetInfeasible, DeviceOutOfMemory
from spikeguard.memory.budget import format_bytes
from spikeguard.runtime.agreement import OverflowAgreement
from spikeguard.runtime.device_state import GradSnapshot

log = logging.getLogger("spikeguard")


class MicroBatchNet:
    """Runs a guard's micro-batch forwards under the safety net; holds, in a deferred
    step, the overflow of a micro-batch kept past the device (`take_held`)."""

    def __init__(self, guard, agreement: Optional[OverflowAgreement]):
        self.guard = guard
        self.agreement = agreement
        self.step_defers = False              # the open step defers overflow to its end
        self.held_overflow: tuple[int, int] = (0, 0)   # (bytes, position code)

    def open_step(self, defers: bool) -> None:
        self.step_defers, self.held_overflow = defers, (0, 0)

    def take_held(self) -> tuple[int, int]:
        held, self.held_overflow = self.held_overflow, (0, 0)
        return held

    def forward(self, orig_forward, args, kwargs):
        """One micro-batch's forward; re-run whole with full recompute if it runs out."""
        g = self.guard
        step = g.recorder
        mb = step.micro_batches if step else 0
        try:
            return self.attempt(orig_forward, mb, args, kwargs)
        except (DeviceOutOfMemory, torch.OutOfMemoryError) as err:
            if g.policy != "adaptive" or g.full_recompute:
                raise g.device_oom(err) from None
            message = str(g.device_oom(err))
        # Safety net: free this micro-batch and run it again with everything recomputed.
        g.abandon_micro_batch(mb)
        if g.recorder:
            g.recorder.safety_net_reruns += 1
        log.warning("micro-batch %d ran out of memory (%s); re-running it with full recompute",
                    mb, message)
        g.full_recompute = True
        try:
            return self.attempt(orig_forward, mb, args, kwargs, last_try=True)
        except (DeviceOutOfMemory, torch.OutOfMemoryError) as err:
            failure = str(g.device_oom(err))
        finally:
            g.full_recompute = False
        g.abandon_micro_batch(mb)
        needed = self.full_recompute_need(orig_forward, mb, args, kwargs)
        raise BudgetInfeasible(
            f"even full recompute does not fit: {failure}; try a budget of at least "
            f"{format_bytes(needed, round_up=True)}", needed_bytes=needed,
            budget_bytes=g.budget_bytes)

    def attempt(self, orig_forward, mb, args, kwargs, last_try: bool = False):
        """One forward of a micro-batch. Under expert parallelism every rank's guard takes
        part in the agreement whatever its policy: if any rank overflowed, every rank
        raises, so the adaptive ones take the net's re-run together. (A static policy that
        overflows raises at once: that is the crash a real job would have.)

        `last_try` (the net's full-recompute re-run) in a deferred step: the micro-batch
        is kept however far it went and its overflow held for the step's end, where every
        rank of the job agrees (runtime/step.py). Raising here would leave the forward on
        this expert-parallel group only: a pipeline peer outside it would go on with the
        step and meet this group's re-run in its sends and receives."""
        g = self.guard
        if self.agreement is None:
            return g.forward_micro_batch(orig_forward, mb, args, kwargs)
        adaptive = g.policy == "adaptive"
        if g.recorder is not None:   # what the step reached before this attempt stands
            g.recorder.note_peak(g.meter.peak(), g.meter.peak_where())
        with g.window.deferring(adaptive), g.meter.deferred(adaptive):
            out = g.forward_micro_batch(orig_forward, mb, args, kwargs)
        over = g.meter.take_overflow() if adaptive else 0
        mine = g.window.take_held() or (DeviceOutOfMemory(
            f"forward of micro-batch {mb} reached {format_bytes(over)} on a device of "
            f"{format_bytes(g.budget_bytes)}", needed_bytes=over,
            budget_bytes=g.budget_bytes) if over else None)
        overflowed = self.agreement.any_overflowed(mine is not None)
        if overflowed and last_try and self.step_defers:
            if mine is not None:
                reached = max(over, mine.needed_bytes or 0, g.budget_bytes + 1)
                self.held_overflow = max(self.held_overflow,
                                         (reached, g.meter.overflow_where()))
            return out
        if overflowed:
            del out
            if g.recorder is not None:
                # The attempt finished its forward, so it was counted: un-count it, or the
                # re-run and every later micro-batch would get the next number (and the
                # pipeline's residency would read the wrong schedule position).
                g.recorder.uncount_attempt()
            gc.collect()
            g.meter.reset_peak()   # the refused attempt's figure is not a peak survived
            raise mine or DeviceOutOfMemory(
                "another rank of the expert-parallel group ran out of memory")
        return out

    def full_recompute_need(self, orig_forward, mb, args, kwargs) -> int:
        """The peak this micro-batch reaches under full recompute, measured with the emulated
        budget lifted (CPU): its forward, and its backward when the output carries its loss
        (gradients restored afterwards); else the head's backward is estimated. On CUDA,
        where that cannot be tried, a quarter more than now."""
        g = self.guard
        if g.device.type == "cuda":
            return int(g.budget_bytes * 1.25)
        snapshot = GradSnapshot(g.model)
        g.full_recompute = True
        try:
            with g.meter.unlimited():
                g.meter.reset_peak()
                # Twice: the second backward accumulates into gradients that exist, the
                # peak of every micro-batch after a step's first.
                for _ in range(2):
                    out = g.forward_micro_batch(orig_forward, mb, args, kwargs)
                    loss = getattr(out, "loss", None)
                    if not (torch.is_tensor(loss) and loss.requires_grad):
                        head = g.layer_room.head_backward_per_token * num_tokens(args, kwargs)
                        return max(g.meter.peak(), g.ledger.in_use() + int(head))
                    del out
                    loss.backward()
                    del loss
                return g.meter.peak()
        finally:
            g.full_recompute = False
            g.abandon_micro_batch(mb)
            snapshot.restore()


def num_tokens(args, kwargs) -> int:
    """Tokens of the micro-batch: token ids (B, T), or a hidden state (B, T, D) as a
    pipeline stage after the first receives it."""
    for value in list(args) + list(kwargs.values()):
        if torch.is_tensor(value):
            if value.is_floating_point() and value.dim() >= 3:
                return value.numel() // value.shape[-1]
            return value.numel()
    return 0
