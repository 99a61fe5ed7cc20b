"""The hookless proof's walk over the layers still to come (spikeguard/runtime/hookless.py).

`Walk` is what the walk holds fixed over the layers it asks the window's procedure about;
`walks_at` gives each later layer its own under expert parallelism, at the routed copies
its recent forwards predict (runtime/routed_history.py); `later_forwards_fit` is the
pipeline's part of the proof: the forwards a stage runs before a micro-batch's backward
(plan/residency.py), each of their layers walked as that micro-batch's later layers are.
"""

from __future__ import annotations

import itertools
from dataclasses import replace
from typing import NamedTuple, Optional

from spikeguard.plan.forecast import Forecast
from spikeguard.plan.room import Seen


class Walk(NamedTuple):
    """What the proof's walk holds fixed over the layers it asks `fits_unaided` about."""

    routed: int              # the most routed copies a layer may get
    layer_part: int          # an attention part's bytes (same shapes, same bytes)
    seen: Seen               # the window's memory of earlier decisions, at `routed`
    resident: int            # the other micro-batches' backward above their forward's end
    forecast: Optional[Forecast] = None   # the window's, unless the walk is another forward's
    grads: Optional[int] = None           # gradients to come at every layer; None: the window's


def walks_at(seen: Seen, predicted: list[int], routed: int, layer_part: int,
             resident: int) -> list[Walk]:
    """A walk per layer at its predicted routed copies, the most so far (from `routed`)
    the window's memory of them (`seen`)."""
    most = itertools.accumulate(predicted, max, initial=routed)
    next(most)
    return [Walk(n, layer_part, replace(seen, max_routed=m), resident)
            for n, m in zip(predicted, most)]


def later_forwards_fit(proof, layer: int, in_use: int, per_layer: int, walk: Walk,
                       own_routed: Optional[int] = None) -> bool:
    """Under a pipeline, the forwards the stage runs before this micro-batch's backward
    (plan/residency.py: it is among their older residents) decide with no eviction
    either: each of their layers walked as this one's later layers are, at the
    residency's reserve as that forward will read it, from a bound on the in-use it will
    see: this micro-batch's forward ended (every later layer keeping everything, then the
    head), each forward between whole (its layers, head and stage input: an attention
    part's bytes), less what the older micro-batches whose backward runs first hold now,
    plus the gradients that backward makes. The older ones' backward excess beside them:
    the largest predicted, this micro-batch's taken as the last finished forward's (same
    shapes; before the first, all of its predicted backward peak above the in-use now).
    `proof`: the HooklessLayers deciding at layer `layer`, `in_use` the device's count
    there; `per_layer` the bound's bytes a layer adds, at `walk.routed` copies;
    `own_routed` what layer `layer` itself routes, where known."""
    w, residency = proof.window, proof.window.forecast.residency
    later = residency.later_forwards()
    if later is None:
        return False
    grads = max(w.grads_to_come.values(), default=0)
    own = w.last_backward_excess
    if own is None:   # no forward finished yet: its predicted peak over the in-use now
        own = w.backward_above(w.ctx.micro_batch, in_use)
    resident = max(walk.resident, own)
    walks, sizes, to_decision, start = _per_layer(proof, layer, in_use, per_layer, walk,
                                                  resident, own_routed)
    head = int(w.forecast.head_bytes_per_token * w.num_tokens)
    whole = sum(sizes) + head + walk.layer_part
    # What this micro-batch holds once its forward has ended, as the in-use below counts
    # it: each later forward's reserve reads it among its older residents, whose backward
    # frees it before that forward's own (its bytes now, only part of its forward's, made
    # the walk of stage 0's warm-up fail where the same forward, deciding, fits).
    mb = w.ctx.micro_batch
    held = {mb: proof.ledger.bytes_by(micro_batch=mb) + start + head - in_use}
    start += head + walk.layer_part
    offsets = [0, *itertools.accumulate(sizes)]
    for i, forward in enumerate(later):
        freed = residency.freed_before(forward)
        base = start + i * whole + (grads if freed else 0) - sum(
            proof.ledger.bytes_by(micro_batch=m) for m in freed)
        forecast = replace(w.forecast, residency=residency.at_forward(forward, held))
        for later_layer, at in enumerate(walks):
            there = Walk(at.routed, at.layer_part, at.seen, resident, forecast,
                         0 if freed else grads)
            if not proof.needs_no_eviction(later_layer, base + offsets[later_layer]
                                           + to_decision, there):
                return False
    return True


def _per_layer(proof, layer: int, in_use: int, per_layer: int, walk: Walk, resident: int,
               own_routed: Optional[int] = None):
    """(a walk per layer of the stage, the bytes each adds, the growth from a layer's
    entry to its decision, the in-use this micro-batch's forward ends at before its
    head). Under expert parallelism, where every layer has its history, each layer at its
    own recent counts, as this micro-batch's later layers (a spike under way in it scales
    them too), and from layer to layer by what layers were seen to leave (LayerSteps);
    else every layer at the bound's `per_layer`. This micro-batch's own end counts the
    deciding layer at `own_routed`, its real count, where given: a rank's count moves
    2x between micro-batches of `small` at PP=2 x EP=2 (layer 1: 292-639 copies), and
    its history's most put stage 0's later forwards 3 MiB high."""
    w, n = proof.window, proof.window.num_layers
    predicted = None if proof.exact_routing else proof.routed.predict_all(
        w.ctx.micro_batch, range(n))
    if predicted is None:
        return [walk] * n, [per_layer] * n, walk.layer_part, in_use + (n - layer) * per_layer
    walks = walks_at(w.seen, predicted, 0, walk.layer_part, resident)
    seen = proof.steps.most(w.num_tokens)
    if seen is None:   # the bound's growth and post-expert part, at the predicted counts
        step, to_decision, entry = per_layer - proof.keep_all_bytes(walk.routed), \
            walk.layer_part, in_use
    else:   # this layer's growth to its decision left out once
        step, to_decision, entry = seen[0], max(walk.layer_part, seen[1]), \
            in_use - proof.growth
    sizes = [step + proof.keep_all_bytes(routed) for routed in predicted]
    own = sizes[layer] if own_routed is None else step + proof.keep_all_bytes(own_routed)
    return walks, sizes, to_decision, entry + own + sum(sizes[layer + 1:])
