"""Forecast: the bytes still to come in this micro-batch after the current layer.

This layer still keeps what runs after its experts (a shared expert: per token, measured
on earlier micro-batches or estimated from its shape before the first). The rest of this
micro-batch's layers each keep their attention part (measured on the layer now running:
same shapes, same bytes), that post-expert part, plus the least their expert path can keep
(the smallest plan), for a load forecast from the largest seen so far in this
micro-batch with a safety margin; then the output head (measured on earlier micro-batches
per token, or a conservative estimate before the first one).

Under pipeline parallelism (`residency`, spikeguard/plan/residency.py) it
also reserves, for every forward the schedule will run on this stage before the next
backward frees memory, one whole micro-batch at the least it can keep (same estimates).
Micro-batches already resident need no forecast: their saved bytes are in the ledger.
It also gives the backward side of that reservation (`backward_reserve`): what the other
micro-batches will hold on this stage while this one's backward runs. Both methods return
figures and change nothing; spikeguard.plan.room turns them into the planner's inputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol

from torch import nn


class PipelineResidency(Protocol):
    """What the forecast and the decision window ask of a pipeline stage's residency
    (spikeguard.plan.residency.Residency is the one implementation; tests fake it)."""

    def reserve(self, layer: int, whole_micro_batch_bytes: int) -> tuple[int, int]:
        """(forward bytes, backward bytes) to reserve for the other micro-batches."""
        ...

    def evictable(self, tracker) -> int:
        """Bytes of the older resident micro-batches that could go to the host."""
        ...

    def grads_at_backward(self, grads_by_layer: dict[int, int]) -> dict[int, int]:
        """Layer -> gradient bytes that will exist by this micro-batch's backward there."""
        ...

    def evict(self, tracker, num_bytes: int) -> int:
        """Move up to `num_bytes` of them to the host; the bytes freed."""
        ...

    # The hookless proof's (spikeguard/runtime/hookless.py): the forwards to come.
    def later_forwards(self) -> Optional[tuple[int, ...]]:
        """The forwards run here before this one's backward (None: position unknown)."""
        ...

    def freed_before(self, forward: int) -> tuple[int, ...]:
        """The micro-batches resident now whose backward runs before that forward."""
        ...

    def at_forward(self, forward: int) -> "PipelineResidency":
        """This residency as that forward will read it."""
        ...


@dataclass
class Forecast:
    num_layers: int
    load_margin: float = 0.25
    head_bytes_per_token: float = 0.0
    post_bytes_per_token: float = 0.0
    # Kept after the experts whatever the plan, per token of the micro-batch: under expert
    # parallelism the combine keeps the rows that came back from the reverse all-to-all
    # (T*K of them, not this rank's received count), which the catalogue does not model.
    combine_bytes_per_token: float = 0.0
    resident_bytes: int = 0  # reserved for other micro-batches, fixed
    # Pipeline schedule: `reserve(layer, whole_micro_batch_bytes) -> (forward, backward)`,
    # the bytes of the micro-batches it will add before the next backward, and those they
    # will hold on this stage while this one's backward runs (None outside a pipeline).
    residency: Optional[PipelineResidency] = None

    def _micro_batch(self, layer_part_bytes: int, max_routed_seen: float,
                     min_expert_bytes_per_token: int, num_tokens: int) -> tuple[float, float, int]:
        """(post-expert bytes of a layer, bytes of each later layer, one whole micro-batch)."""
        future_routed = max_routed_seen * (1 + self.load_margin)
        post = (self.post_bytes_per_token + self.combine_bytes_per_token) * num_tokens
        per_layer = layer_part_bytes + post + min_expert_bytes_per_token * future_routed
        head = self.head_bytes_per_token * num_tokens
        return post, per_layer, int(self.num_layers * per_layer + head)

    def still_to_come(self, layer: int, layer_part_bytes: int, max_routed_seen: float,
                      min_expert_bytes_per_token: int, num_tokens: int) -> int:
        """Bytes still to come before this micro-batch's forward ends, on top of what is in
        use: the rest of this layer and the later ones, the head, and the pipeline's
        forward reserve (and `resident_bytes`)."""
        return self.to_come_and_reserve(layer, layer_part_bytes, max_routed_seen,
                                        min_expert_bytes_per_token, num_tokens)[0]

    def to_come_and_reserve(self, layer: int, layer_part_bytes: int, max_routed_seen: float,
                            min_expert_bytes_per_token: int, num_tokens: int) -> tuple[int, int]:
        """(`still_to_come`, `backward_reserve`) of one decision, the pair
        plan/room.py `decision_inputs` asks for: the same operations in the same order,
        with one `residency.reserve` call for both (the simulator's `1t` makes 140k
        decisions a run)."""
        future_routed = max_routed_seen * (1 + self.load_margin)
        post = (self.post_bytes_per_token + self.combine_bytes_per_token) * num_tokens
        per_layer = layer_part_bytes + post + min_expert_bytes_per_token * future_routed
        head = self.head_bytes_per_token * num_tokens
        remaining = self.num_layers - layer - 1
        if self.residency is None:
            return int(post + remaining * per_layer + head + self.resident_bytes), 0
        forward, backward = self.residency.reserve(
            layer, int(self.num_layers * per_layer + head))
        return int(post + remaining * per_layer + head + (self.resident_bytes + forward)), backward

    def later_evictable(self, layer: int, layer_part_bytes: int,
                        least_expert_bytes: int = 0) -> int:
        """Bytes that will be on the device to evict before this micro-batch's forward ends
        and are not yet: this layer's and the later layers' attention parts and what their
        expert paths keep at the least (`least_expert_bytes`: saved tensors the tracker
        holds, combine's rows at least), each movable once the layer after it runs; the
        last layer's are not counted."""
        return max(0, self.num_layers - layer - 1) * (layer_part_bytes + least_expert_bytes)

    def backward_reserve(self, layer: int, layer_part_bytes: int, max_routed_seen: float,
                         min_expert_bytes_per_token: int, num_tokens: int) -> int:
        """Bytes the other micro-batches of the pipeline will hold on this stage while this
        one's backward runs (its reloads must fit beside them); 0 outside a pipeline."""
        if self.residency is None:
            return 0
        whole = self._micro_batch(layer_part_bytes, max_routed_seen,
                                  min_expert_bytes_per_token, num_tokens)[2]
        return self.residency.reserve(layer, whole)[1]

    @staticmethod
    def for_model(model: nn.Module, num_layers: int, shared: Optional[nn.Module],
                  head_backward_bytes_per_token: float,
                  combine_bytes_per_token: float = 0.0) -> "Forecast":
        """A guard's forecast before any micro-batch measured one: what the head keeps
        and its backward's gradients (`head_backward_bytes_per_token`), the shared part's
        estimate, and the combine's rows under expert parallelism."""
        return Forecast(num_layers=num_layers,
                        head_bytes_per_token=head_bytes_estimate(model)
                        + head_backward_bytes_per_token,
                        post_bytes_per_token=shared_bytes_estimate(shared),
                        combine_bytes_per_token=combine_bytes_per_token)

    def observe(self, head_bytes: int, post_bytes: int, num_tokens: int) -> None:
        """Per-token bytes measured on a finished micro-batch replace the estimates."""
        if num_tokens > 0 and head_bytes > 0:
            self.head_bytes_per_token = head_bytes / num_tokens
        if num_tokens > 0 and post_bytes > 0:
            self.post_bytes_per_token = post_bytes / num_tokens


def head_bytes_estimate(model: nn.Module) -> float:
    """Bytes per token the output head keeps, before the first micro-batch measures it:
    a guess from the last Linear, on the safe side: the final norm's input and output (the
    head's input), the log-softmax the loss keeps, the target index. Measured on the tiny
    preset: 1420 B/token against 1564 estimated."""
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    if not linears:
        return 0.0
    head = linears[-1]
    return float(head.weight.element_size() * (4 * head.in_features + head.out_features) + 16)


def shared_bytes_estimate(shared: Optional[nn.Module]) -> float:
    """Bytes per token a shared expert keeps (SwiGLU: gate/up output, silu, product),
    before the first micro-batch measures it."""
    if shared is None:
        return 0.0
    linears = [m for m in shared.modules() if isinstance(m, nn.Linear)]
    return float(linears[0].weight.element_size() * 2 * sum(m.out_features for m in linears[:-1]))
