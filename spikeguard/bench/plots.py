"""The bench's pictures, drawn from training-log records: memory, throughput, imbalance.

Every plot takes `runs`, a mapping {name: [step record, ...]} (one training log per policy
or per file: what `spikeguard train --log` writes, one JSON object per step), and returns
a matplotlib Figure (Agg canvas, no pyplot: no global figure state in a long process).
`draw_plots` saves them as PNGs; `spikeguard report RUN.jsonl --plots DIR` calls it.

    .venv/bin/spikeguard report runs/ep.jsonl --plots runs/plots

One module per picture: plot_memory (the hot rank's memory timeline), plot_throughput
(bars against the ceiling), plot_imbalance (the per-layer, per-rank heatmap); plot_records
reads the records for all three. This module names them together and saves them.

Logs differ in what they hold: no guard (no peak_bytes, budget_bytes, decisions), one
process (no rank_* keys), no skew injector (no skew_spike). A panel whose log lacks what
it needs says so in its own text; a plot that no log can feed raises NothingToPlot, one
line. The bench adds "skipped": true on a step dropped after a crash (never drawn, counted)
and "crashed": true on the step a static policy died on (an X; it has no step_time_s).
A step that appears more than once (replayed after a restart) is drawn from its last
completed record.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Optional

from spikeguard.extras import require

# matplotlib and numpy are the `plots` extra: a missing one is one line naming it.
Figure = require("matplotlib.figure", "plots", "the plots").Figure

from spikeguard.bench.plot_imbalance import MAX_STEP_SPAN, imbalance_heatmap, imbalance_matrix
from spikeguard.bench.plot_memory import memory_timeline
from spikeguard.bench.plot_records import (CEILING, NothingToPlot, Records, Runs, check_runs,
                                           spike_steps)
from spikeguard.bench.plot_throughput import throughput, throughput_stats

__all__ = ["CEILING", "MAX_STEP_SPAN", "NothingToPlot", "PLOT_FILES", "Records", "Runs",
           "draw_plots", "imbalance_heatmap", "imbalance_matrix", "make_figures",
           "memory_timeline", "save_figures", "save_png", "spike_steps", "throughput",
           "throughput_stats"]

PLOT_FILES = {"memory": "memory_timeline.png", "throughput": "throughput.png",
              "imbalance": "imbalance.png"}


def save_png(fig: Figure, path: str | Path, *, overwrite: bool = False) -> Path:
    """Write the figure as a PNG through spikeguard.files (a temporary name, then rename),
    so a failed save never leaves half an image where a good one was; an existing file is
    replaced only with `overwrite`."""
    from spikeguard.files import atomic_write

    return atomic_write(path, overwrite=overwrite, what="plot",
                        writer=lambda tmp: fig.savefig(tmp, format="png", dpi=110))


def make_figures(runs: Runs, *, effective: Optional[Mapping[str, float]] = None,
                 relative: Optional[Mapping[str, float]] = None,
                 effective_relative: Optional[Mapping[str, float]] = None,
                 with_throughput: Optional[bool] = None) -> tuple[dict[str, Figure], list[str]]:
    """Every figure the logs can feed, {key of PLOT_FILES: Figure}, and one line per plot
    left out and why. Throughput is drawn when there are several runs unless
    `with_throughput` says otherwise."""
    check_runs(runs)
    if with_throughput is None:
        with_throughput = len(runs) > 1
    makers = {"memory": lambda: memory_timeline(runs),
              "imbalance": lambda: imbalance_heatmap(runs)}
    if with_throughput:
        makers["throughput"] = lambda: throughput(runs, effective, relative,
                                                      effective_relative)
    figures, notes = {}, []
    for key, make in makers.items():
        try:
            figures[key] = make()
        except NothingToPlot as exc:
            notes.append(str(exc))
    return figures, notes


def save_figures(figures: Mapping[str, Figure], out_dir: str | Path, *,
                 overwrite: bool = False) -> list[Path]:
    """Save make_figures' figures into `out_dir` (which must exist) under PLOT_FILES."""
    return [save_png(fig, Path(out_dir) / PLOT_FILES[key], overwrite=overwrite)
            for key, fig in figures.items()]


def draw_plots(runs: Runs, out_dir: str | Path, *,
               effective: Optional[Mapping[str, float]] = None,
               relative: Optional[Mapping[str, float]] = None,
               effective_relative: Optional[Mapping[str, float]] = None,
               with_throughput: Optional[bool] = None,
               overwrite: bool = False) -> tuple[list[Path], list[str]]:
    """make_figures, then save_figures: the files written and the plots left out (why)."""
    figures, notes = make_figures(runs, effective=effective, relative=relative,
                                  effective_relative=effective_relative,
                                  with_throughput=with_throughput)
    return save_figures(figures, out_dir, overwrite=overwrite), notes
