"""What the guard puts on a model at attach, and takes off again at detach.

One part of the guard (spikeguard.runtime.guard): the model's forward and each guarded
layer's forward are replaced by functools.partials into the guard (instance attributes,
so deleting them brings the class's forward back), module hooks move the position
(runtime/position.py), the block adapter installs its seam, and each optimizer's step runs
on the device through the optimizer's own step hooks (`OptimizerScope`).
`ModelWiring.remove` undoes all of it, so a detached model computes exactly as before
attach.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Callable, Sequence

import torch

from spikeguard.errors import UsageError
from spikeguard.runtime.device_state import PHASE_OPTIMIZER


SCOPE_ATTR = "_spikeguard_scope"   # on an optimizer: the OptimizerScope its step runs in


class OptimizerScope:
    """Each optimizer step on the device: its state and its foreach temporaries are device
    memory, as they are on CUDA.

    Through `register_step_pre_hook` / `register_step_post_hook`, not a replaced `step`:
    whatever is built on the optimizer after attach (torch's LR schedulers re-wrap
    `optimizer.step` and need it a bound method; torchtitan's containers; the user's own
    hooks) keeps working. Hooks run in the order registered (torch 2.13 has no `prepend`
    for these): the user's pre hooks from before attach and post hooks from after it run
    outside the scope. One guard per optimizer: two would close their scopes in the order
    they opened them, not the reverse.

    The device refuses inside the step as a GPU does, at the allocation: torch's own
    torch.OutOfMemoryError comes out of `step()` (the update half applied, as on CUDA; it
    is never retried), and the training loop turns it into one line
    (spikeguard.train.engines). A post hook does not run when the step raises (torch
    2.13's `profile_hook_step`) and no public hook sees the exception: the scope stays open
    until the next step of that optimizer, the guard's next step, or detach, which close
    it. Inside an open guarded step (`optimizer.step()` within `run_step`) the step's own
    scope counts and enforces; only the position moves.
    """

    def __init__(self, meter, position, step_open: Callable[[], bool]):
        self.meter = meter
        self.position = position
        self.step_open = step_open
        self.handles: list = []
        self.optimizers: list = []
        self.open: list[tuple[int, contextlib.ExitStack]] = []   # (id(optimizer), scope)

    @staticmethod
    def check_free(optimizers: Sequence[torch.optim.Optimizer]) -> None:
        """UsageError if one of `optimizers` already steps under an attached guard."""
        for optimizer in optimizers:
            if getattr(optimizer, SCOPE_ATTR, None) is not None:
                raise UsageError("this optimizer already steps under another attached guard: "
                                 "give each guarded model its own optimizer, or detach first")

    def install(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        self.check_free(optimizers)
        self.optimizers = list(optimizers)
        for optimizer in self.optimizers:
            setattr(optimizer, SCOPE_ATTR, self)
            self.handles.append(optimizer.register_step_pre_hook(self.pre))
            self.handles.append(optimizer.register_step_post_hook(self.post))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        self.close_down_to()
        for optimizer in self.optimizers:
            setattr(optimizer, SCOPE_ATTR, None)

    def close_down_to(self, key=None) -> None:
        """Close the open scopes from the innermost down to and with `key`'s (None: all)."""
        while self.open:
            k, scope = self.open.pop()
            scope.close()
            if key is not None and k == key:
                return

    def pre(self, optimizer, args, kwargs) -> None:
        key = id(optimizer)
        if any(k == key for k, _ in self.open):   # its last step raised, so its post
            self.close_down_to(key)                  # hook never ran
        scope = contextlib.ExitStack()
        if not self.step_open():   # inside an open guarded step its scope already holds
            scope.enter_context(self.meter.active())
            scope.enter_context(self.meter.enforcing())
        phase = self.position.phase
        previous = self.position.set_where(PHASE_OPTIMIZER, -1)

        def restore() -> None:
            self.position.phase = phase
            self.meter.set_where(previous)
        scope.callback(restore)
        self.open.append((key, scope))

    def post(self, optimizer, args, kwargs) -> None:
        if any(k == id(optimizer) for k, _ in self.open):
            self.close_down_to(id(optimizer))


class ModelWiring:
    """The wrappers and hooks one guard installed on its model and optimizers."""

    def __init__(self, guard):
        self.guard = guard
        self.handles: list = []
        self.wrapped_layers: list = []
        self.optimizer_scope = OptimizerScope(guard.meter, guard.position,
                                              lambda: guard.recorder is not None)

    def install(self, guarded_forward) -> None:
        """`guarded_forward(orig_forward, *args, **kwargs)` in place of the model's forward;
        the optimizers' step hooks."""
        g = self.guard
        model = g.model
        orig_forward = model.forward
        model.forward = functools.partial(guarded_forward, orig_forward)
        # Keep the signature visible (transformers' Trainer reads forward's parameters).
        model.forward.__signature__ = inspect.signature(orig_forward)
        position = g.position
        for block in g.moe_blocks:
            g.adapter.install(block, g.window_door)
            layer = g.adapter.parent_layer(block)
            self.wrapped_layers.append(layer)
            layer.forward = functools.partial(g.layers.forward, layer, layer.forward,
                                              g.adapter.layer_index(block))
            self.handles.append(block.register_forward_pre_hook(position.enter_moe))
            for shared in g.adapter.shared_modules(block):
                self.handles.append(shared.register_forward_pre_hook(position.enter_shared))
            self.handles.append(block.register_forward_hook(position.leave_moe))
        last = self.wrapped_layers[-1]
        self.handles.append(last.register_forward_hook(position.enter_head))
        self.optimizer_scope.install(g.optimizers)

    def remove(self, recomputed_modules: list) -> None:
        """Every hook and wrapper off again (those of the shared policy too)."""
        g = self.guard
        for handle in self.handles:
            handle.remove()
        for block in g.moe_blocks:
            g.adapter.uninstall(block)
        for module in self.wrapped_layers + recomputed_modules:
            del module.forward
        del g.model.forward
        self.optimizer_scope.remove()
