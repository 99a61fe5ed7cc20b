"""The oracle with evictions to the byte: the limit of what adaptive itself can do.

Adaptive's window does more than pick a plan per layer: when a layer's peaks would not
fit it moves saved tensors of the layers below to host (plan/decide.py, the evictor), any
of them, as many bytes as it needs. The per-layer plans of plan/oracle.py move whole
tensors of a layer's own expert path, so adaptive can reach budgets, and costs, below
them. This oracle has adaptive's eviction too, with hindsight.

On the byte model of plan/oracle.py, with `E_k` the bytes evicted by layer k's decision
(they stay on host until their own layer's backward, which the byte model already has
back in that layer's own peak):

    layer k fits   base_k + kept below k - E_k + own_k <= budget,  E_k <= kept below k
    the head fits  end + all kept - E_last <= budget,               E_last <= kept below last

Eviction costs the same per byte whichever tensor moves (plan/cost.py's round trip), so
evicting lazily, no earlier than needed, is optimal: E_k is the largest overflow so far,
and the total is the combination's peak over the budget. The capacity bound
(E_k <= kept below k) holds for every k exactly when each layer's own terms fit with
nothing kept below (base_k + own_k <= budget) and the last layer's kept bytes fit beside
the head (end + kept_last <= budget). So

    cost = the plans' seconds + round trip of max(0, peak of the combination - budget)

minimised over the combinations whose options pass those two filters: a dynamic
programme over layers whose state is the frontier of (kept bytes, largest term so far,
seconds), exact (a state no larger in all three replaces another); `exhaustive_evict` is
the check. The whole-layer eviction options of plan/oracle.py are redundant here.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from spikeguard.plan.oracle import Problem, peak_of

EvictSeconds = Callable[[int], float]   # seconds the round trip of n evicted bytes adds


@dataclass(frozen=True)
class EvictSolution:
    feasible: bool
    choices: tuple[int, ...]
    seconds: float            # the plans' and the evictions'
    evict_bytes: int          # in all, by the last decision
    evict_at: tuple[int, ...]  # bytes to evict at each layer's decision (lazy)


def allowed(problem: Problem, layer: int, option: int) -> bool:
    """The capacity filter: the option's own terms fit with everything below evicted."""
    lay = problem.layers[layer]
    opt = lay.options[option]
    if lay.base_bytes + opt.own_peak_bytes > problem.budget_bytes:
        return False
    last = layer == len(problem.layers) - 1
    return not last or problem.end_bytes + opt.kept_bytes <= problem.budget_bytes


def evict_schedule(problem: Problem, choices: Sequence[int]) -> tuple[int, ...]:
    """Bytes to evict at each decision, lazily: each layer's overflow beyond what is gone,
    the head's at the last decision."""
    kept, gone, out = 0, 0, []
    for i, (layer, c) in enumerate(zip(problem.layers, choices)):
        opt = layer.options[c]
        term = layer.base_bytes + kept + opt.own_peak_bytes
        if i == len(problem.layers) - 1:
            term = max(term, problem.end_bytes + kept + opt.kept_bytes)
        need = max(0, term - problem.budget_bytes - gone)
        out.append(need)
        gone += need
        kept += opt.kept_bytes
    return tuple(out)


def cost_of(problem: Problem, choices: Sequence[int], evict_s: EvictSeconds) -> Optional[float]:
    """Seconds of one combination with lazy eviction; None when it cannot fit at all."""
    if not all(allowed(problem, i, c) for i, c in enumerate(choices)):
        return None
    over = max(0, peak_of(problem, choices) - problem.budget_bytes)
    return sum(l.options[c].seconds for l, c in zip(problem.layers, choices)) + evict_s(over)


def _solution(problem: Problem, choices: tuple[int, ...], seconds: float) -> EvictSolution:
    at = evict_schedule(problem, choices)
    return EvictSolution(True, choices, seconds, sum(at), at)


def exhaustive_evict(problem: Problem, evict_s: EvictSeconds) -> EvictSolution:
    """Every combination tried: the check of `solve_evict` (small problems only)."""
    best = None
    for choices in itertools.product(*(range(len(l.options)) for l in problem.layers)):
        s = cost_of(problem, choices, evict_s)
        if s is not None and (best is None or s < best[0]):
            best = (s, choices)
    if best is None:
        return EvictSolution(False, (), float("inf"), 0, ())
    return _solution(problem, best[1], best[0])


# A state: (kept bytes so far, largest term so far, seconds so far, choices)
State = tuple[int, int, float, tuple[int, ...]]


def _frontier(states: list[State]) -> list[State]:
    """The states no other is at most in all of kept, largest term and seconds: swept by
    kept, keeping a staircase of (term, seconds) of the states kept so far."""
    out: list[State] = []
    terms: list[int] = []      # staircase: terms ascending, seconds strictly descending
    secs: list[float] = []
    for st in sorted(states, key=lambda s: (s[0], s[1], s[2])):
        _, term, s, _ = st
        j = bisect.bisect_right(terms, term)
        if j and secs[j - 1] <= s:
            continue           # an earlier state (no more kept) has no larger term, no more s
        out.append(st)
        k = j
        while k < len(terms) and secs[k] >= s:
            k += 1
        terms[j:k], secs[j:k] = [term], [s]
    return out


def solve_evict(problem: Problem, evict_s: EvictSeconds) -> EvictSolution:
    """The least seconds, plans and evictions together (module doc), exactly."""
    frontier: list[State] = [(0, 0, 0.0, ())]
    last = len(problem.layers) - 1
    for i, layer in enumerate(problem.layers):
        states = []
        for kept, term, s, choices in frontier:
            for c, o in enumerate(layer.options):
                if not allowed(problem, i, c):
                    continue
                t = max(term, layer.base_bytes + kept + o.own_peak_bytes)
                if i == last:
                    t = max(t, problem.end_bytes + kept + o.kept_bytes)
                states.append((kept + o.kept_bytes, t, s + o.seconds, choices + (c,)))
        frontier = _frontier(states)
        if not frontier:
            return EvictSolution(False, (), float("inf"), 0, ())
    best = min(frontier, key=lambda st: st[2] + evict_s(max(0, st[1] - problem.budget_bytes)))
    return _solution(problem, best[3],
                     best[2] + evict_s(max(0, best[1] - problem.budget_bytes)))
