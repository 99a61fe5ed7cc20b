"""The routed copies of this rank's later layers, predicted from their own recent forwards.

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
"""

from __future__ import annotations

from collections import deque
from typing import Optional

# The routed-count prediction under expert parallelism (module doc): forwards of a layer
# remembered, how many before they are used, and the margin on top.
ROUTED_HISTORY = 16
ROUTED_HISTORY_MIN = 4
ROUTED_SLACK = 0.05


class RoutedHistory:
    """Predicts the routed copies of this rank's later layers from their own recent
    forwards (module doc). `note` each layer's count as its forward decides; `predict` a
    later layer's, or None where there is too little history to go by."""

    def __init__(self):
        self._past: dict[int, deque] = {}
        # Micro-batch -> the most its layers so far routed over their own past maximum
        # (>= 1: a spike under way), None once a layer of it had too little history.
        self._rise: dict[int, Optional[float]] = {}

    def note(self, micro_batch: int, layer: int, num_routed: int) -> None:
        past = self._past.setdefault(layer, deque(maxlen=ROUTED_HISTORY))
        rise = num_routed / max(past) if len(past) >= ROUTED_HISTORY_MIN and max(past) else None
        so_far = self._rise.get(micro_batch, 1.0)
        self._rise[micro_batch] = None if so_far is None or rise is None else max(so_far, rise)
        past.append(num_routed)

    def predict(self, micro_batch: int, layer: int) -> Optional[int]:
        past = self._past.get(layer)
        rise = self._rise.get(micro_batch)
        if rise is None or past is None or len(past) < ROUTED_HISTORY_MIN:
            return None
        return int(max(past) * rise * (1 + ROUTED_SLACK)) + 1

    def forget_micro_batch(self, micro_batch: int) -> None:
        self._rise.pop(micro_batch, None)
