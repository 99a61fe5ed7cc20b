"""Where an out-of-memory happened, in words: layers by their global number (a pipeline
stage's too), the embedding and the output head by name, never one for another. Issue 15:
stage 1 of a 4-layer model holds layers 2 and 3, and its head (at len(moe_blocks) = 2)
shared layer 2's position code, so "layer 2" overflows were named "the output head".

    .venv/bin/python -m pytest tests/runtime/test_runtime_places.py -q
"""

from __future__ import annotations

from spikeguard.runtime.device_state import (HEAD_LAYER, PHASE_BACKWARD, PHASE_FORWARD,
                                             decode_where, place_text, where_code)


def test_the_heads_position_is_apart_from_every_layer():
    layer_codes = {where_code(phase, layer, mb) for phase in (PHASE_FORWARD, PHASE_BACKWARD)
                   for layer in range(-1, 200) for mb in range(4)}
    head_codes = {where_code(phase, HEAD_LAYER, mb) for phase in (PHASE_FORWARD, PHASE_BACKWARD)
                  for mb in range(4)}
    assert not layer_codes & head_codes
    assert decode_where(where_code(PHASE_BACKWARD, HEAD_LAYER, 1)) == (PHASE_BACKWARD, HEAD_LAYER)
    assert decode_where(where_code(PHASE_BACKWARD, 2, 1)) == (PHASE_BACKWARD, 2)


def test_a_pipeline_stages_layers_are_named_by_their_global_number():
    # what the step-end message decodes (no op): stage 1's layer 2, 3 and its head
    assert place_text(PHASE_BACKWARD, 0, 2, "") == "backward of micro-batch 0, layer 2"
    assert place_text(PHASE_BACKWARD, 1, 3, "") == "backward of micro-batch 1, layer 3"
    assert place_text(PHASE_BACKWARD, 0, HEAD_LAYER, "") == "backward of micro-batch 0, the output head"
    # what an allocation's refusal names (the op known): the head by its op
    assert place_text(PHASE_FORWARD, 0, 2, "head") == "forward of micro-batch 0, the output head"
    assert place_text(PHASE_FORWARD, 0, 2, "experts") == "forward of micro-batch 0, layer 2, op experts"
    assert place_text(PHASE_FORWARD, 0, -1, "") == "forward of micro-batch 0, the embedding"
