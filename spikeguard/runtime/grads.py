"""The gradient bytes a micro-batch's backward will still allocate, per layer.

A layer's backward peak holds the gradients made by then: its own parameters', the later
layers', and those of the parameters outside the layers (embedding, head, final norm,
taken as made before any layer's backward). A lower layer's are made after its peak, so
they are not part of it: counting them put the last layer's predicted backward peak
~20 MiB over the device's on `small`, and made calm steps evict. Only gradients not yet
allocated count (the second micro-batch of a step finds them all there). A sharded
(DTensor) parameter's gradient is its local shard's bytes.
"""

from __future__ import annotations

from torch import nn

from spikeguard.memory.ledger import local_tensor


class GradsToCome:
    """Per trained parameter, the guarded layer whose backward makes its gradient."""

    def __init__(self, trained: list[nn.Parameter], adapter, moe_blocks: list[nn.Module]):
        self.trained = trained
        self.adapter = adapter
        self.moe_blocks = moe_blocks
        self.layers = self._parameter_layers()

    def _parameter_layers(self) -> list[int]:
        """The highest layer holding each parameter (tied: the first backward to reach
        it), or one past the last layer for the rest."""
        top = max((self.adapter.layer_index(b) for b in self.moe_blocks), default=0) + 1
        layer_of: dict[int, int] = {}
        for block in self.moe_blocks:
            idx = self.adapter.layer_index(block)
            for p in self.adapter.parent_layer(block).parameters():
                layer_of[id(p)] = max(layer_of.get(id(p), idx), idx)
        return [layer_of.get(id(p), top) for p in self.trained]

    def by_layer(self) -> dict[int, int]:
        """Layer -> the gradient bytes not yet allocated that exist by the time backward
        has reached that layer (every guarded layer has an entry)."""
        by_layer: dict[int, int] = {}
        for p, layer in zip(self.trained, self.layers):
            if p.grad is None:
                num_bytes = local_tensor(p).numel() * p.element_size()
                by_layer[layer] = by_layer.get(layer, 0) + num_bytes
        out, total = {}, 0
        for layer in sorted(by_layer, reverse=True):
            total += by_layer[layer]
            out[layer] = total
        for block in self.moe_blocks:   # layers whose gradients all exist: the layers' above
            idx = self.adapter.layer_index(block)
            out.setdefault(idx, next((out[k] for k in sorted(out) if k > idx), 0))
        return out
