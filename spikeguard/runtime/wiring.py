"""What the guard puts on a model at attach, and takes off again at detach.

One part of the guard (spikeguard.runtime.guard): the model's forward and each guarded
layer's forward are replaced by functools.partials into the guard (instance attributes,
so deleting them brings the class's forward back), module hooks move the position
(runtime/position.py), the block adapter installs its seam, and the optimizer's step is
wrapped so that it runs on the device. `ModelWiring.remove` undoes all of it, so a
detached model computes exactly as before attach.
"""

from __future__ import annotations

import functools
import inspect


class ModelWiring:
    """The wrappers and hooks one guard installed on its model and optimizer."""

    def __init__(self, guard):
        self.guard = guard
        self.handles: list = []
        self.wrapped_layers: list = []

    def install(self, guarded_forward, optimizer_step) -> None:
        """`guarded_forward(orig_forward, *args, **kwargs)` in place of the model's forward,
        `optimizer_step(orig_step, *args, **kwargs)` in place of the optimizer's step."""
        g = self.guard
        model = g.model
        orig_forward = model.forward
        model.forward = functools.partial(guarded_forward, orig_forward)
        # Keep the signature visible (transformers' Trainer reads forward's parameters).
        model.forward.__signature__ = inspect.signature(orig_forward)
        position = g.position
        for block in g.moe_blocks:
            g.adapter.install(block, g)
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
        if g.optimizer is not None:
            # The optimizer step runs on the device too (its state, foreach temporaries).
            orig_step = g.optimizer.step
            g.optimizer.step = functools.wraps(orig_step)(
                functools.partial(optimizer_step, orig_step))

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
        if g.optimizer is not None:
            del g.optimizer.step
