"""The routed copies of this rank's later layers, predicted from their own recent forwards;
and what a layer leaves on the device from its entry to the next (`LayerSteps`).

One part of the guard's hookless proof (spikeguard/runtime/hookless.py). Under expert
parallelism a rank's routed count moves from layer to layer, and the proof walks the
later layers of a micro-batch at what they may route. The forecast's own bound, 1.25x the
most seen so far for every later layer, proved too little: on `small` at EP=2, 1.1x the
calm peak, rank 0's layer 0 routes the most (2528 copies against 1874-2130 in layers 1-3)
and the walk cleared 1 layer of 4 (CPU, emulated device). Here each later layer is
predicted at the most it routed over its last `ROUTED_HISTORY` forwards, scaled by how far
this micro-batch's layers so far rose above their own past maxima (a spike under way: the
skew that makes one spikes every layer alike), plus `ROUTED_SLACK`; with fewer than
`ROUTED_HISTORY_MIN` forwards of a layer behind it, nothing (the proof keeps the
forecast's bound). A prediction, not a proof: a spike that starts in a later layer only
is missed (tests/runtime/test_runtime_routed_history.py shows the budget kept and the
gradients bitwise there).

A spike itself (once a layer has `ROUTED_HISTORY` forwards behind it, a count above
`SPIKE_RISE` x the most of those that were no spike: its calm range) is remembered for
`SPIKE_MEMORY` forwards only, not `ROUTED_HISTORY`: a spike under way is foreseen by the
rise above, and one remembered as long as the calm range kept the forwards after it
walked at its counts. torchtitan's deepseek_v3 at EP=2, 1.04x the calm peak, a spike
every 4th step (spikeguard.bench.titan_ratios), ran every calm step for 8 steps after a
spike hooked, 57 of rank 0's 336 forwards calm (CPU, emulated device). Not before the
history is full: until then the calm range is not known (a rank's count moves 2x between
the micro-batches of `small` at PP=2 x EP=2, 284-732 copies), and a high count is taken
as part of it. A spike that lasts stays in: each of its forwards is within
`SPIKE_MEMORY` of the last, and once it has outlasted the history it is the calm range.
"""

from __future__ import annotations

from collections import deque
from typing import Optional

# The routed-count prediction under expert parallelism (module doc): forwards of a layer
# remembered, how many before they are used, and the margin on top.
ROUTED_HISTORY = 16
ROUTED_HISTORY_MIN = 4
ROUTED_SLACK = 0.05
# A spike (a count above this x its layer's calm range, once the history is full) is
# remembered for this many forwards of its layer (module doc).
SPIKE_RISE = 1.25
SPIKE_MEMORY = 4


class RoutedHistory:
    """Predicts the routed copies of this rank's later layers from their own recent
    forwards (module doc). `note` each layer's count as its forward decides; `predict` a
    later layer's, or None where there is too little history to go by."""

    def __init__(self):
        self._past: dict[int, deque] = {}
        # Micro-batch -> the most its layers so far routed over their own past maximum
        # (>= 1: a spike under way), None once a layer of it had too little history.
        self._rise: dict[int, Optional[float]] = {}
        # Layer -> `_most` of its past as it stands: asked by every later layer's
        # prediction (a pipeline's start proofs: 20-30 a calm step), changed by `note` only.
        self._most: dict[int, int] = {}

    def note(self, micro_batch: int, layer: int, num_routed: int) -> None:
        past = self._past.setdefault(layer, deque(maxlen=ROUTED_HISTORY))
        enough = len(past) >= ROUTED_HISTORY_MIN
        most = self._most_of(layer, past) if enough else 0
        rise = num_routed / most if most else None
        so_far = self._rise.get(micro_batch, 1.0)
        self._rise[micro_batch] = None if so_far is None or rise is None else max(so_far, rise)
        full = len(past) == ROUTED_HISTORY   # a calm range to tell a spike from
        past.append((num_routed, full and num_routed > SPIKE_RISE * _calm_most(past)))
        self._most.pop(layer, None)

    def predict(self, micro_batch: int, layer: int) -> Optional[int]:
        """A micro-batch none of whose layers decided yet has seen no rise (1)."""
        past = self._past.get(layer)
        rise = self._rise.get(micro_batch, 1.0)
        if rise is None or past is None or len(past) < ROUTED_HISTORY_MIN:
            return None
        return int(self._most_of(layer, past) * rise * (1 + ROUTED_SLACK)) + 1

    def _most_of(self, layer: int, past: deque) -> int:
        most = self._most.get(layer)
        if most is None:
            most = self._most[layer] = _most(past)
        return most

    def predict_all(self, micro_batch: int, layers) -> Optional[list[int]]:
        """`predict` for each of `layers`, or None where one has too little history."""
        predicted = [self.predict(micro_batch, layer) for layer in layers]
        return None if None in predicted else predicted

    def forget_micro_batch(self, micro_batch: int) -> None:
        self._rise.pop(micro_batch, None)


def _most(past: deque) -> int:
    """The most of a layer's remembered (count, spike) forwards: a spike's among its last
    `SPIKE_MEMORY` only (module doc)."""
    return max(n for age, (n, spike) in enumerate(reversed(past))
               if not spike or age < SPIKE_MEMORY)


def _calm_most(past: deque) -> int:
    """The most of a layer's remembered forwards that were no spike (all of them where
    every one was: a spike that outlasted the history is the calm range now)."""
    return max((n for n, spike in past if not spike), default=0) or max(n for n, _ in past)


class LayerSteps:
    """What a layer's forward leaves on the device beyond its expert path, under expert
    parallelism: the device's count from a layer's entry to the next layer's, less the
    expert path's keep-everything bytes, on a layer that kept everything and evicted
    nothing; and its growth from entry to decision. The most of each over the last
    `ROUTED_HISTORY` seen, per micro-batch token count (same shapes, same bytes; the first
    forward's one-time allocations, a cache built on first use, age out).

    The walk of the hookless proof steps from one later layer's decision to the next by
    them. Its bound without them, the deciding layer's growth to its decision plus the
    post-expert part for every later layer, counts as kept what a layer frees before the
    next one starts: on transformers' EP the exchanges' buffers, alive at the decision
    (inside the exchanges) and gone at the layer's end; on qwen3_moe at hf_bench's sizes,
    8 x 128 tokens, EP=2, the walk then put layer 3's decision 3.9 MiB above where it
    came and cleared 1 layer of 4 (CPU, emulated device). The growth is the most seen, not
    the deciding layer's: there it grows with the rows the layer receives (6.8-7.8 MiB).
    """

    def __init__(self):
        self._step: dict[int, deque] = {}
        self._growth: dict[int, deque] = {}
        self._open: Optional[tuple[int, int, int, int]] = None   # mb, layer, entry, routed

    def decided(self, micro_batch: int, layer: int, entry_in_use: int, in_use: int,
                num_tokens: int, num_routed: int, kept_all: bool) -> None:
        """Layer `layer` decided at `in_use`: `kept_all` its plan keeps everything and
        evicts nothing."""
        _remember(self._growth, num_tokens, in_use - entry_in_use)
        self._open = (micro_batch, layer, entry_in_use, num_routed) if kept_all else None

    def entered(self, micro_batch: int, layer: int, entry_in_use: int, num_tokens: int,
                keep_all_bytes) -> None:
        """Layer `layer` starts at `entry_in_use`: the step from the layer before, if that
        one kept everything (`keep_all_bytes(routed)`: its expert path's bytes)."""
        last, self._open = self._open, None
        if last is None or last[:2] != (micro_batch, layer - 1):
            return
        _remember(self._step, num_tokens, entry_in_use - last[2] - keep_all_bytes(last[3]))

    def most(self, num_tokens: int) -> Optional[tuple[int, int]]:
        """(step, growth): the most seen at `num_tokens`, or None before a step was."""
        if num_tokens not in self._step:
            return None
        return max(self._step[num_tokens]), max(self._growth[num_tokens])


def _remember(seen: dict[int, deque], num_tokens: int, num_bytes: int) -> None:
    seen.setdefault(num_tokens, deque(maxlen=ROUTED_HISTORY)).append(num_bytes)
