"""What the device holds for the output head (final norm, LM head, cross-entropy) of the
built-in model on the last stage, as arithmetic on the shapes (read off the emulated
device as sim/device_bytes.py's layers were; checked in tests/sim/test_sim_device_bytes.py).

T = tokens of the micro-batch, D = model width, V = vocabulary, b = bytes per activation
element. After the last layer, whose output is alive, the end of the forward holds
T*(2*D*b + V*b + 4) more (final norm's saved tensors, log-probabilities), its forward peak
T*V*b more (the logits, until the loss is made), its backward peak 2*T*V*b more.
"""

from __future__ import annotations

from dataclasses import dataclass

from spikeguard.sim.device_bytes import INDEX


@dataclass(frozen=True)
class HeadBytes:
    """The output head (final norm, LM head, cross-entropy) on the last stage."""

    d_model: int
    vocab_size: int
    elem_bytes: int
    grad_bytes: int = 4

    def kept(self, tokens: int) -> int:
        """What the head holds at the end of the forward, its input (the last layer's
        output) included; the targets are host memory."""
        D, V, b = self.d_model, self.vocab_size, self.elem_bytes
        return tokens * (3 * D * b + V * b + 4)

    def ledger(self, tokens: int) -> int:
        """What the runtime's ledger attributes to the head (its saved tensors, targets
        included): the forecast's figure."""
        return self.kept(tokens) + INDEX * tokens

    def forward_over_end(self, tokens: int) -> int:
        return tokens * self.vocab_size * self.elem_bytes

    def backward_over_end(self, tokens: int, first: bool = False) -> int:
        """The loss's and the logits' gradients; then the LM head's input gradient beside
        the logits' (and, in a first backward, its weights' gradient)."""
        D, V, b = self.d_model, self.vocab_size, self.elem_bytes
        weight = V * D * self.grad_bytes if first else 0
        return max(2 * tokens * V * b, tokens * (V * b + D * b) + weight)
