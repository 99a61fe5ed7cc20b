"""The oracle: the cheapest per-layer plans of one micro-batch, with hindsight.

Adaptive decides layer by layer, knowing only the counts routed so far and a forecast of
the rest. The oracle knows every layer's routed count in advance and searches every
combination of the catalogue's plans (plan/catalogue.py `valid_plans`) for the least added
time that fits the budget on the planner's own byte model. It is the limit of the
decision problem: what adaptive could reach with perfect foresight.

The byte model, per layer i of one micro-batch in layer order (the decision window's,
plan/room.py and plan/layer_room.py, with the forecast replaced by the exact future):

    in use at i's decision  = base_i + sum of what layers j < i keep on the device
    layer i fits            : in use at i + own_peak_i(plan_i) <= budget
    the head fits           : end_bytes + sum of what every layer keeps <= budget

`base_i` holds everything the plans do not change (parameters, gradients, the attention
parts, what the layers below keep beyond their expert path); `own_peak_i` the most the
layer reaches above its decision's in-use in its forward and backward (the layer's own
peaks, which no plan of its own changes, the planner's backward check: the plan's kept
and reloaded bytes beside the prefetch margin, and the next layer's entry: its attention
and dispatch run beside all this layer keeps, before the next decision). A plan's
`kept` is what its expert path leaves on the device for the layers above; its
`seconds` the cost model's (plan/cost.py) added time. Offloading an earlier layer's
tensor is one of the catalogue's plans there, so the oracle needs no eviction of its own; adaptive's
evictions move bytes at any granularity, which the per-layer plans do not (a cut a few
bytes deep can cost adaptive less than any whole plan: see docs/oracle.md).

The solver is a dynamic programme over layers whose state is the Pareto frontier of
(kept bytes so far, seconds so far): every constraint reads the prefix only through its
kept bytes, and is monotone in them, so a state with no more kept bytes and no more
seconds than another can always replace it. Exact; `exhaustive` is the check.

    .venv/bin/python -m pytest tests/plan/test_plan_oracle.py
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Hashable, Optional, Sequence

from spikeguard.plan.catalogue import ALL_SAVE, LayerPlan, valid_plans
from spikeguard.plan.layer_room import LayerRoom
from spikeguard.plan.planner import Planner


@dataclass(frozen=True)
class Option:
    """One plan of one layer: what it keeps for the layers above, the most it reaches above
    its decision's in-use, the seconds it adds."""

    label: Hashable
    kept_bytes: int
    own_peak_bytes: int
    seconds: float


@dataclass(frozen=True)
class Layer:
    base_bytes: int                 # in use at its decision, less the kept bytes below
    options: tuple[Option, ...]


@dataclass(frozen=True)
class Problem:
    layers: tuple[Layer, ...]
    budget_bytes: int
    end_bytes: int = 0              # at the head's backward peak, beside every kept byte


@dataclass(frozen=True)
class Solution:
    """The oracle's answer: `choices[i]` indexes `layers[i].options` (empty when
    infeasible); `least_budget_bytes` the smallest budget any combination fits."""

    feasible: bool
    choices: tuple[int, ...]
    seconds: float
    peak_bytes: int
    least_budget_bytes: int

    def labels(self, problem: Problem) -> tuple:
        return tuple(layer.options[c].label for layer, c in zip(problem.layers, self.choices))


def peak_of(problem: Problem, choices: Sequence[int]) -> int:
    """The predicted peak of one combination on the byte model (module doc)."""
    kept, peak = 0, 0
    for layer, c in zip(problem.layers, choices):
        opt = layer.options[c]
        peak = max(peak, layer.base_bytes + kept + opt.own_peak_bytes)
        kept += opt.kept_bytes
    return max(peak, problem.end_bytes + kept)


def seconds_of(problem: Problem, choices: Sequence[int]) -> float:
    return sum(layer.options[c].seconds for layer, c in zip(problem.layers, choices))


def exhaustive(problem: Problem) -> Solution:
    """Every combination tried: the check of `solve` (small problems only)."""
    best: Optional[tuple[float, tuple[int, ...]]] = None
    least = None
    for choices in itertools.product(*(range(len(l.options)) for l in problem.layers)):
        peak = peak_of(problem, choices)
        least = peak if least is None else min(least, peak)
        if peak <= problem.budget_bytes:
            s = seconds_of(problem, choices)
            if best is None or s < best[0]:
                best = (s, choices)
    if best is None:
        return Solution(False, (), float("inf"), least, least)
    return Solution(True, best[1], best[0], peak_of(problem, best[1]), least)


# A frontier state: (kept bytes so far, seconds so far, the choices that got there).
State = tuple[int, float, tuple[int, ...]]


def _pareto(states: list[State]) -> list[State]:
    """The states no other beats on both kept bytes and seconds (ties: the first kept)."""
    out: list[State] = []
    for state in sorted(states, key=lambda s: (s[0], s[1])):
        if not out or state[1] < out[-1][1]:
            out.append(state)
    return out


def solve(problem: Problem) -> Solution:
    """The least-seconds combination within the budget, exactly (module doc)."""
    frontier: list[State] = [(0, 0.0, ())]
    for layer in problem.layers:
        room = problem.budget_bytes - layer.base_bytes
        frontier = _pareto([(kept + o.kept_bytes, s + o.seconds, choices + (i,))
                            for kept, s, choices in frontier
                            for i, o in enumerate(layer.options)
                            if kept + o.own_peak_bytes <= room])
        if not frontier:
            break
    fits = [st for st in frontier if problem.end_bytes + st[0] <= problem.budget_bytes]
    least = least_budget(problem)
    if not fits or len(fits[0][2]) != len(problem.layers):
        return Solution(False, (), float("inf"), least, least)
    best = min(fits, key=lambda st: st[1])
    return Solution(True, best[2], best[1], peak_of(problem, best[2]), least)


def least_budget(problem: Problem) -> int:
    """The smallest peak any combination reaches: the least budget the problem fits.
    The same frontier, over (kept bytes, peak so far), both to be small."""
    frontier: list[tuple[int, int]] = [(0, 0)]
    for layer in problem.layers:
        states = [(kept + o.kept_bytes, max(peak, layer.base_bytes + kept + o.own_peak_bytes))
                  for kept, peak in frontier for o in layer.options]
        frontier = []
        for kept, peak in sorted(states):
            if not frontier or peak < frontier[-1][1]:
                frontier.append((kept, peak))
    return min(max(peak, problem.end_bytes + kept) for kept, peak in frontier)


# ---- from the planner's byte model ---------------------------------------------------
@dataclass(frozen=True)
class Choice:
    """An option's label on the model: the layer's plan, and whether all it still keeps
    on the device (attention part, shared expert, the plan's saved tensors) moves to host
    at the next layer's decision, as adaptive's evictions move earlier layers."""

    plan: LayerPlan
    evict: bool = False

    def describe(self) -> str:
        return self.plan.describe() + (" +evict" if self.evict else "")


@dataclass(frozen=True)
class LayerFigures:
    """What the decision window measures at one layer with everything saved below it (the
    bench reads them off a probe step): the inputs of `problem_from_model`."""

    in_use_bytes: int        # at the decision, every layer below keeping all
    num_routed: int
    grads_to_come: int
    layer_part_bytes: int    # its attention and router part (the window's figure)
    prefetch_margin_bytes: int = 0
    # All the layer holds at its decision (the part and its dispatched rows): with the
    # next layer's, what the layer keeps after its forward (0: not measured, no eviction).
    layer_bytes: int = 0
    # The device's most in use in the layer's forward before its decision (its attention,
    # router and dispatch: under EP the exchange's sent and received rows beside the
    # regrouped ones); None: not measured, not checked.
    entry_peak_bytes: Optional[int] = None


def layer_options(planner: Planner, room: LayerRoom, f: LayerFigures, kept_all_bytes: int,
                  evictable: bool, menu: Optional[Sequence[LayerPlan]] = None,
                  next_entry_bytes: Optional[int] = None) -> tuple[Option, ...]:
    """Every plan of the menu (default: the catalogue's) as the planner costs and sizes it
    at this layer: what the layer keeps for those above (`kept_all_bytes` with everything
    saved, less what the plan moves off), its own peak (the layer's own forward and
    backward peaks, `LayerRoom.needs`, the planner's backward check, and the next layer's
    entry: `next_entry_bytes` above this decision's in-use with everything saved, less
    what the plan moves off), its seconds; and, when `evictable`, each plan followed by
    the eviction of all the layer keeps."""
    forward, backward = room.needs(f.in_use_bytes, f.num_routed, f.grads_to_come,
                                   f.layer_part_bytes)
    own_layer = max(forward, backward) - f.in_use_bytes
    all_saved = planner.fixed(ALL_SAVE, f.num_routed).device_bytes
    out = []
    for plan in menu or valid_plans():
        kept = planner.fixed(plan, f.num_routed).device_bytes
        reloaded = planner.offload_bytes_per_token(plan) * f.num_routed
        own = max(own_layer, kept + reloaded + f.prefetch_margin_bytes)
        if next_entry_bytes is not None:
            own = max(own, next_entry_bytes - (all_saved - kept))
        seconds = planner.added_s(plan, f.num_routed)
        keeps = kept_all_bytes - (all_saved - kept)
        out.append(Option(Choice(plan), keeps, own, seconds))
        if evictable:
            out.append(Option(Choice(plan, True), 0, own,
                              seconds + planner.cost.offload_s_for_bytes(keeps)))
    return tuple(out)


def problem_from_model(planner: Planner, room: LayerRoom, figures: Sequence[LayerFigures],
                       end_in_use_bytes: int, budget_bytes: int,
                       menu: Optional[Sequence[LayerPlan]] = None,
                       whole_layer_evictions: bool = True) -> Problem:
    """One micro-batch's problem from figures measured with everything saved:
    `end_in_use_bytes` is the head's backward peak then (every layer keeping all). What
    each layer keeps with everything saved is taken out of the bases above it, and its
    options put back what they keep. A layer keeps, with everything saved, the growth of
    the device from its decision to the next one's, less what the next one holds there,
    plus what it held itself (`layer_bytes`); without those figures, or for the last
    layer (no later decision to evict it at), its expert path's saved bytes only.
    `whole_layer_evictions` False leaves those options out (plan/oracle_evict.py evicts
    to the byte instead). A layer's entry (`entry_peak_bytes`: its attention, router and
    dispatch, before its decision) runs beside all the layer below keeps, before anything
    can be evicted at its own decision: it is the layer below's to fit, in that layer's
    own peak. Without it (`medium`, EP=2, 0.70x, CPU, emulated device) the oracle's plans
    ran out in their first step, in micro-batch 1 layer 5's dispatch exchange: 4.8 MiB
    asked with 339.8 MiB in use on 342.3 MiB, where the byte model's largest term was
    342.3 (its entry rose 8.9 MiB above its decision's in-use, in no term)."""
    layers, kept_below = [], 0
    for i, f in enumerate(figures):
        nxt = figures[i + 1] if i + 1 < len(figures) else None
        measured = nxt is not None and f.layer_bytes and nxt.layer_bytes
        all_saved = planner.fixed(ALL_SAVE, f.num_routed).device_bytes
        kept_all = (nxt.in_use_bytes - nxt.layer_bytes - f.in_use_bytes + f.layer_bytes
                    if measured else all_saved)
        entry = (nxt.entry_peak_bytes - f.in_use_bytes
                 if nxt is not None and nxt.entry_peak_bytes is not None else None)
        layers.append(Layer(f.in_use_bytes - kept_below,
                            layer_options(planner, room, f, kept_all,
                                          bool(measured) and whole_layer_evictions, menu,
                                          entry)))
        kept_below += kept_all
    return Problem(tuple(layers), budget_bytes, end_in_use_bytes - kept_below)
