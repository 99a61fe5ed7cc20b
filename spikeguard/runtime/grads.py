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
        # A parameter's local bytes are fixed (a DTensor's shard too); the answer depends
        # only on which gradients exist, so it is kept per pattern of those: every step
        # after zero_grad(set_to_none) asks the same question (a walk of every parameter
        # was ~200 of the guard's Python calls on a calm step of `small`).
        self._bytes = [local_tensor(p).numel() * p.element_size() for p in trained]
        self._answers: dict[tuple[bool, ...], dict[int, int]] = {}

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
        has reached that layer (every guarded layer has an entry). A new dict each call:
        the caller may keep it."""
        missing = tuple([p.grad is None for p in self.trained])
        answer = self._answers.get(missing)
        if answer is None:
            if len(self._answers) >= 16:   # a few patterns recur; any other is rare
                self._answers.clear()
            answer = self._answers[missing] = self._by_layer(missing)
        return dict(answer)

    def _by_layer(self, missing: tuple[bool, ...]) -> dict[int, int]:
        by_layer: dict[int, int] = {}
        for num_bytes, layer, absent in zip(self._bytes, self.layers, missing):
            if absent:
                by_layer[layer] = by_layer.get(layer, 0) + num_bytes
        out, total = {}, 0
        for layer in sorted(by_layer, reverse=True):
            total += by_layer[layer]
            out[layer] = total
        for block in self.moe_blocks:   # layers whose gradients all exist: the layers' above
            idx = self.adapter.layer_index(block)
            out.setdefault(idx, next((out[k] for k in sorted(out) if k > idx), 0))
        return out
