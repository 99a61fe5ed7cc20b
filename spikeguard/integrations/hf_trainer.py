"""spikeguard in transformers' `Trainer`, as the Trainer is: one line, nothing to subclass.

    trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
    guard_trainer(trainer, budget="12MiB", policy="adaptive")   # the line to add
    trainer.train()                                              # trainer.spikeguard.history

Two pieces, each through an extension point the Trainer has:

* a `TrainerCallback` (`SpikeGuardCallback`, added with `trainer.add_callback`) attaches
  the guard at `on_train_begin`, where the model is prepared and the optimizer built (the
  Trainer builds both inside `train()`), and detaches it at `on_train_end`;
* the Trainer's `training_step(model, inputs, num_items_in_batch)`, which it calls once
  per micro-batch (through `self.`, so an instance attribute is its seam, and a user's
  Trainer subclass keeps its own), runs inside `guard.run_step`: the step-level net covers
  the micro-batch's forward and its backward. A callback alone cannot give that (no
  callback event wraps the step, none sees an exception).

One guard step per `training_step`: under gradient accumulation each micro-batch is one
record of `guard.history`, and a re-run by the net re-runs that micro-batch from the
gradients accumulated before it. Those are not copied at each micro-step (on CUDA a
device-to-host copy of every gradient beside every micro-batch after a window's first):
each micro-step of the window is noted (its inputs and the random state it began with),
and a failed one's re-run replays the ones before it from no gradients, in order, with
their random states, then runs again from its own (`run_step(fn, replay=...)`,
spikeguard.runtime.step): the sums are bitwise those of an uninterrupted window. Under
FSDP2 (transformers' `DistributedConfig`) each micro-step is noted with FSDP2's
reduction flags as the Trainer set them (deferred on all but the window's last) and
replayed under them: there a copy could not put the window back at all (the earlier
micro-steps' gradients are FSDP2's unsharded ones, which a failed attempt drops:
runtime/fsdp.py). Under DDP (no FSDP2) the gradients are still copied.

The optimizer step (the Trainer's, after the last micro-batch) runs on the device
through the optimizer's own step hooks (spikeguard.runtime.wiring), so the Trainer's LR
scheduler, built before, keeps working.

The Trainer's `log` (the same kind of seam) adds the guard's figures to each training log
(one holding "loss", every `logging_steps`), so `state.log_history` and every `report_to`
sink (TensorBoard, W&B, ...) receive them beside the loss: the tags `train --tensorboard`
writes (spikeguard.runtime.scalars: memory/peak_bytes, guard/decisions_recompute, ...),
each the largest over the guard steps since the previous log, so that a peak or a re-run
between two logs is not hidden. (The Trainer's own sinks prefix them: `train/memory/...`.)
Importing this module needs transformers (`pip install 'spikeguard[hf]'`).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Mapping
from typing import Optional

import torch
import torch.distributed as dist
from transformers import TrainerCallback

from spikeguard.errors import UsageError
from spikeguard.runtime.fsdp import gradient_sync, set_gradient_sync

GUARD_ATTR = "spikeguard"   # on the trainer: the guard while training


def _torch_optimizer(optimizer):
    """The torch optimizer under accelerate's AcceleratedOptimizer (whose `step` calls
    it): its step hooks are the ones that run."""
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer


class SpikeGuardCallback(TrainerCallback):
    """Attaches the guard when training begins, detaches it when training ends."""

    def __init__(self, trainer, budget=None, policy: str = "adaptive",
                 shared_policy: str = "keep", memory_snapshot=None):
        self.trainer = trainer
        self.settings = {"budget": budget, "policy": policy, "shared_policy": shared_policy,
                         "memory_snapshot": memory_snapshot}
        self.guard = None
        self.num_logged = 0   # guard.history's records already in a log
        # The accumulation window's micro-steps so far, (args, kwargs, random state,
        # FSDP2's reduction flags); None where the window cannot be replayed (it began
        # with gradients, or several ranks without FSDP2)
        self.window: Optional[list[tuple]] = None

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        from spikeguard.integrations import ADAPTERS
        from spikeguard.runtime.guard import attach
        if getattr(args, "gradient_checkpointing", False):
            raise UsageError("TrainingArguments(gradient_checkpointing=True) recomputes "
                             "under the guard: set gradient_checkpointing=False; the guard "
                             "decides recompute itself")
        self.guard = attach(model, optimizer=_torch_optimizer(optimizer), adapters=ADAPTERS,
                            **self.settings)
        self.num_logged = 0
        self.window = None
        setattr(self.trainer, GUARD_ATTR, self.guard)

    def on_step_begin(self, args, state, control, **kwargs):
        """A gradient-accumulation window begins (the Trainer calls this before its first
        micro-step): it can be replayed from no gradients if it begins with none, on one
        process or under FSDP2 (module doc)."""
        model = self.guard.model if self.guard is not None else None
        fresh = model is not None and all(p.grad is None for p in model.parameters())
        alone = not (dist.is_initialized() and dist.get_world_size() > 1)
        self.window = [] if fresh and (alone or gradient_sync(model)) else None

    def on_train_end(self, args, state, control, **kwargs):
        if self.guard is not None and self.guard.attached:
            self.guard.detach()


def _guarded_training_step(callback: SpikeGuardCallback, training_step, *args, **kwargs):
    guard = callback.guard
    if guard is None or not guard.attached:
        return training_step(*args, **kwargs)
    window, replay = callback.window, None
    if window is not None:
        # its own copy of a dict of inputs, taken first: compute_loss may pop the labels
        noted = ([copy.copy(a) if isinstance(a, Mapping) else a for a in args],
                 {k: copy.copy(v) if isinstance(v, Mapping) else v for k, v in kwargs.items()},
                 _random_state(), gradient_sync(guard.model))
        if window:
            replay = functools.partial(_replay, guard.model, training_step, list(window),
                                       noted[2:])
    result = guard.run_step(lambda: training_step(*args, **kwargs), replay=replay)
    if window is not None:
        window.append(noted)
    return result


def _replay(model, training_step, earlier: list, then: tuple) -> None:
    """The window's micro-steps before a failed one, from no gradients (the net dropped
    them), each from the random state and under FSDP2's reduction flags it began with;
    then the failed one's own."""
    for args, kwargs, state, sync in earlier:
        _set_random_state(state)
        set_gradient_sync(model, sync)
        training_step(*args, **kwargs)
    _set_random_state(then[0])
    set_gradient_sync(model, then[1])


def _random_state() -> tuple:
    """The generators a micro-step's dropout draws from: the CPU's and, once CUDA is in
    use, the current device's."""
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def _set_random_state(state: tuple) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda)


def _log_with_guard(callback: SpikeGuardCallback, log, logs, *args, **kwargs):
    from spikeguard.runtime.scalars import largest_scalars

    guard = callback.guard
    if guard is not None and "loss" in logs and len(guard.history) > callback.num_logged:
        logs.update(largest_scalars(guard.history[callback.num_logged:]))
        callback.num_logged = len(guard.history)
    return log(logs, *args, **kwargs)


def guard_trainer(trainer, budget=None, policy: str = "adaptive",
                  shared_policy: str = "keep", memory_snapshot=None) -> SpikeGuardCallback:
    """Guard `trainer`'s training: the callback, and its `training_step` run inside the
    guard's step (see the module docstring). Returns the callback; the guard is
    `trainer.spikeguard` once `train()` has begun. `memory_snapshot`: a folder for a
    snapshot of each out-of-memory (as attach's, spikeguard.memory.snapshot)."""
    if getattr(trainer, "_spikeguard_callback", None) is not None:
        raise UsageError("this Trainer is already guarded (guard_trainer was called on it)")
    callback = SpikeGuardCallback(trainer, budget, policy, shared_policy, memory_snapshot)
    trainer.add_callback(callback)
    trainer.training_step = functools.partial(_guarded_training_step, callback,
                                              trainer.training_step)
    trainer.log = functools.partial(_log_with_guard, callback, trainer.log)
    trainer._spikeguard_callback = callback
    setattr(trainer, GUARD_ATTR, None)
    return callback


__all__ = ["SpikeGuardCallback", "guard_trainer"]
