"""The oracle bench's noise-free line: adaptive's last step and the oracle's plans, added
seconds on the same cost model (spikeguard/bench/oracle_bench.py prints it under each
table, oracle_ep.py per rank). Apart from the bench because the measured rows are noise
at a few rounds on this machine while this line is not: it is what docs/oracle.md reads.
"""

from __future__ import annotations

from spikeguard.plan.oracle_evict import solve_evict


class Tally:
    """A `decide` seam deciding as the window does, noting each layer's plan and routed
    count of the step, to cost adaptive's plans on the oracle's cost model afterwards; the
    layers the window's entry check recomputed whole (`whole`); and the layer peaks the
    step decided with (`room`: a step's end recalibrates them)."""

    def __init__(self, guard):
        self.guard, self.last, self.room = guard, [], None
        self.whole: list[tuple[int, int]] = []   # (micro-batch, layer) recomputed whole
        window = guard.window
        cannot_fit = window.layer_cannot_fit

        def noted(layer: int) -> bool:   # the window's entry check, its fallbacks noted
            if layer == 0 and window.ctx.micro_batch == 0:   # a step, or its re-run
                # (here, not at the first decision: a first layer recomputed whole makes
                # none, and its step's plans were summed with the step before's)
                self.last, self.whole, self.room = [], [], guard.layer_room.room
            whole = cannot_fit(layer)
            if whole:
                self.whole.append((window.ctx.micro_batch, layer))
            return whole
        window.layer_cannot_fit = noted

    def decide(self, layer: int, num_routed: int):
        decision = self.guard.window.decide(layer, num_routed)
        self.last.append((decision.plan, num_routed))
        return decision


def predicted(problems: dict, seen: list, guard, tally: Tally, oracle_choices) -> dict:
    """Added seconds a step, on the adaptive guard's cost model as it ended the run and the
    layer peaks its last step decided with (the same model for both): the oracle solved
    again on it, the oracle's plans as run, and adaptive's last step (its plans and the
    round trip of what it evicted, at layer entries too; a layer it recomputed whole at
    its entry is not in it, `full_layers` counts those, and `adaptive_whole_s` is the
    least they cost: their expert paths' recompute at the routed counts the probe saw,
    the attention's not counted). `problems`: the oracle's, on that byte model
    (oracle_bench.oracle_problems with `tally.room`)."""
    evict_s = guard.cost.offload_s_for_bytes
    best = [solve_evict(p, evict_s) for p in problems.values()]
    out = {"oracle_s": sum(b.seconds for b in best) if all(b.feasible for b in best) else None}
    if oracle_choices is not None:
        choices, evict_at = oracle_choices
        out["oracle_run_s"] = sum(
            next(o.seconds for o in p.layers[layer].options if o.label == choices[(mb, layer)])
            for mb, p in problems.items() for layer in range(len(p.layers))) + sum(
            evict_s(n) for n in evict_at.values())
    record = guard.history[-1]
    out["adaptive_s"] = (sum(guard.planner.added_s(plan, n) for plan, n in tally.last)
                         + guard.cost.offload_s_for_bytes(record["evicted_bytes"]))
    out["adaptive_full_layers"] = record["full_layers"]
    routed = {(mb, layer): n for mb, layer, _, n, *_ in seen}
    out["adaptive_whole_s"] = sum(guard.planner.whole_recompute_s(routed[w])
                                  for w in tally.whole)
    return out


def predicted_line(p: dict) -> str:
    """The cost model's added time a step, noise-free: the oracle's bound against adaptive."""
    ad, orc, full = p["adaptive_s"] * 1e3, (p["oracle_s"] or 0) * 1e3, p["adaptive_full_layers"]
    if p["oracle_s"] is None:
        return f"on the cost model adaptive adds {ad:.1f} ms a step; the oracle finds no plan"
    line = (f"on the cost model (no noise) a step adds {orc:.1f} ms under the oracle, "
            f"{ad:.1f} ms under adaptive" + (f" ({ad / orc:.2f}x the oracle's)" if orc else ""))
    if not full:
        return line
    if "adaptive_whole_s" not in p:   # a result written before they were costed
        return line + f", besides the {full} layer(s) adaptive recomputed whole (not costed)"
    whole = p["adaptive_whole_s"] * 1e3
    return line + (f", besides the {full} layer(s) adaptive recomputed whole: at least "
                   f"{whole:.1f} ms more (their expert paths' recompute, attention not "
                   f"counted)" + (f", so at least {(ad + whole) / orc:.2f}x the oracle's"
                                  if orc else ""))
