"""The pipeline's walk (spikeguard/runtime/hookless_walk.py `_per_layer`): where a stage's
later forwards start, from the end this micro-batch's own forward reaches.

Its collaborators are real (RoutedHistory, LayerSteps, Seen); the window and the proof
around them are a stand-in holding only the figures the walk reads (the whole proof runs
for real in tests/parallel/test_parallel_pp.py and tests/runtime/test_runtime_hookless_ends.py).
"""

from __future__ import annotations

from types import SimpleNamespace

from spikeguard.plan.room import Seen
from spikeguard.runtime.hookless_walk import Walk, _per_layer
from spikeguard.runtime.routed_history import ROUTED_HISTORY_MIN, LayerSteps, RoutedHistory

TOKENS = 64
BYTES_PER_COPY = 10


def _keep_all(num_routed: int) -> int:
    return BYTES_PER_COPY * num_routed


def _proof(layer1_counts: list[int], own_layer1: int):
    """A stage of 3 layers under EP whose layer 1 routed `layer1_counts` in its past
    micro-batches and decides now on `own_layer1` copies (micro-batch 9)."""
    routed, steps = RoutedHistory(), LayerSteps()
    for mb, count in enumerate(layer1_counts[:ROUTED_HISTORY_MIN]):
        routed.note(mb, 0, 400)
        routed.note(mb, 1, count)
        routed.note(mb, 2, 500)
    steps.decided(0, 0, entry_in_use=1000, in_use=1300, num_tokens=TOKENS, num_routed=400,
                  kept_all=True)
    steps.entered(0, 1, 1000 + 700 + _keep_all(400), TOKENS, _keep_all)   # a step of 700
    routed.note(9, 0, 400)
    routed.note(9, 1, own_layer1)   # the deciding layer notes its count first (proven)
    window = SimpleNamespace(num_layers=3, ctx=SimpleNamespace(micro_batch=9), seen=Seen(),
                             num_tokens=TOKENS)
    return SimpleNamespace(window=window, exact_routing=False, routed=routed, steps=steps,
                           growth=300, keep_all_bytes=_keep_all)


def _end(proof, own_routed):
    walk = Walk(routed=600, layer_part=200, seen=Seen(), resident=0)
    return _per_layer(proof, 1, 5000, 0, walk, 0, own_routed)[3]


def test_the_deciding_layer_ends_at_its_own_count_not_its_historys_most():
    """Layer 1 of this micro-batch routes 292 copies where its history's most is 639 (a
    rank's count moves 2x between micro-batches at PP=2 x EP=2): its own end counts 292,
    exactly as if its history had never routed more."""
    swinging = _proof([639, 292, 300, 292], own_layer1=292)
    steady = _proof([292, 292, 292, 292], own_layer1=292)
    end = _end(swinging, own_routed=292)
    assert end == _end(steady, own_routed=292)
    # the later layer (2) at its prediction: its most, 500, plus the slack
    later = 700 + _keep_all(swinging.routed.predict(9, 2))
    assert end == 5000 - 300 + 700 + _keep_all(292) + later
    # with the count unknown, the history's most (with its slack) stands in for it
    assert _end(swinging, own_routed=None) - end == \
        _keep_all(swinging.routed.predict(9, 1)) - _keep_all(292) > _keep_all(639 - 292)
