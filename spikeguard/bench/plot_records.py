"""Reading the bench's training-log records for its plots (spikeguard.bench.plots): tolerant
of absent keys and of values of the wrong type, so a log that lacks a field leaves a panel
saying so rather than a traceback. Shared by plot_memory, plot_throughput, plot_imbalance.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any, Mapping, Optional, Sequence

from spikeguard.extras import require

# matplotlib and numpy are the `plots` extra: a missing one is one line naming it.
FigureCanvasAgg = require("matplotlib.backends.backend_agg", "plots", "the plots").FigureCanvasAgg
Figure = require("matplotlib.figure", "plots", "the plots").Figure

from spikeguard.errors import UsageError

Records = Sequence[Mapping[str, Any]]
Runs = Mapping[str, Records]

CEILING = "ceiling"  # the bench's name for the run without a memory limit
SPIKE_COLOR, RECOMPUTE_COLOR, OFFLOAD_COLOR = "#f4a261", "#d62828", "#1d70b8"


class NothingToPlot(UsageError):
    """No log holds what this plot needs; the message says what is missing, in one line."""


def num(record: Mapping[str, Any], key: str) -> Optional[float]:
    """A finite number under `key`, else None (absent, null, text, bool, NaN)."""
    value = record.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def completed(records: Records) -> list[Mapping[str, Any]]:
    """One record per step, sorted by step: the last one that ran to the end (a replayed
    step's final run), never a skipped or crashed one."""
    by_step: dict[int, Mapping[str, Any]] = {}
    for r in records:
        if not r.get("skipped") and not r.get("crashed") and isinstance(r.get("step"), int):
            by_step[r["step"]] = r
    return [by_step[s] for s in sorted(by_step)]


def hot_peak(record: Mapping[str, Any]) -> Optional[float]:
    """Bytes on the step's hot rank: the cluster's worst peak (the rank that would run out
    first) under expert parallelism, this process's peak otherwise. None without a guard:
    an unguarded expert-parallel rank still logs max_peak_bytes, as 0 (nothing measured)."""
    own = num(record, "peak_bytes")
    if own is None:
        return None
    value = num(record, "max_peak_bytes")
    return value if value is not None else own


def hot_decisions(record: Mapping[str, Any]) -> Mapping[str, Any]:
    """The decisions of the rank whose peak is plotted (rank_decisions[peak_rank])."""
    per_rank, rank = record.get("rank_decisions"), record.get("peak_rank")
    if isinstance(per_rank, list) and isinstance(rank, int) and 0 <= rank < len(per_rank) \
            and isinstance(per_rank[rank], dict):
        return per_rank[rank]
    decisions = record.get("decisions")
    return decisions if isinstance(decisions, dict) else {}


def count(decisions: Mapping[str, Any], action: str) -> int:
    value = decisions.get(action, 0)
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def run_budget(records: Records) -> Optional[float]:
    """The run's budget: the most common positive budget_bytes (None: no limit)."""
    budgets = Counter(b for b in (num(r, "budget_bytes") for r in records) if b and b > 0)
    return budgets.most_common(1)[0][0] if budgets else None


def spike_steps(records: Records, runs: Optional[Runs] = None) -> list[int]:
    """Steps this run marks skew_spike; a step its own log does not describe (the bench's
    crash marker has no skew fields) takes what the other runs say, since the bench gives
    every policy the same trace."""
    own: dict[int, bool] = {}
    for r in records:
        if isinstance(r.get("step"), int) and isinstance(r.get("skew_spike"), bool):
            own[r["step"]] = own.get(r["step"], False) or r["skew_spike"]
    mine = {r.get("step") for r in records}
    for other in (runs or {}).values():
        for r in other:
            step = r.get("step")
            if step in mine and step not in own and r.get("skew_spike") is True:
                own[step] = True
    return sorted(step for step, spike in own.items() if spike)


def check_runs(runs: Runs) -> None:
    if not runs:
        raise UsageError("nothing to plot: no runs given")
    for name, records in runs.items():
        if not isinstance(records, Sequence) or isinstance(records, (str, bytes)) \
                or not all(isinstance(r, Mapping) for r in records):
            raise UsageError(f"run {name!r}: expected a list of step records (dicts)")


def canvas(fig: Figure) -> Figure:
    FigureCanvasAgg(fig)  # attaches itself to the figure: savefig renders with Agg
    return fig
