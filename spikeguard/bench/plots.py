"""The bench's pictures, drawn from training-log records: memory, throughput, imbalance.

Every plot takes `runs`, a mapping {name: [step record, ...]} (one training log per policy
or per file: what `spikeguard train --log` writes, one JSON object per step), and returns
a matplotlib Figure (Agg canvas, no pyplot: no global figure state in a long process).
`draw_plots` saves them as PNGs; `spikeguard report RUN.jsonl --plots DIR` calls it.

    .venv/bin/spikeguard report runs/ep.jsonl --plots runs/plots

Logs differ in what they hold: no guard (no peak_bytes, budget_bytes, decisions), one
process (no rank_* keys), no skew injector (no skew_spike). A panel whose log lacks what
it needs says so in its own text; a plot that no log can feed raises NothingToPlot, one
line. The bench adds "skipped": true on a step dropped after a crash (never drawn, counted)
and "crashed": true on the step a static policy died on (an X; it has no step_time_s).
A step that appears more than once (replayed after a restart) is drawn from its last
completed record.
"""

from __future__ import annotations

import math
import os
from collections import Counter
from pathlib import Path
from statistics import median
from typing import Any, Mapping, Optional, Sequence

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import Normalize, TwoSlopeNorm
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

from spikeguard.errors import UsageError
from spikeguard.memory.budget import byte_unit

Records = Sequence[Mapping[str, Any]]
Runs = Mapping[str, Records]

PLOT_FILES = {"memory": "memory_timeline.png", "throughput": "throughput.png",
              "imbalance": "imbalance.png"}
CEILING = "ceiling"  # the bench's name for the run without a memory limit
MAX_STEP_SPAN = 100_000  # heatmap columns: a log with steps 1 and 10**9 must not fill memory
_SPIKE_COLOR, _RECOMPUTE_COLOR, _OFFLOAD_COLOR = "#f4a261", "#d62828", "#1d70b8"


class NothingToPlot(UsageError):
    """No log holds what this plot needs; the message says what is missing, in one line."""


# ---- reading records: tolerant of absent keys and of values of the wrong type -----------

def _num(record: Mapping[str, Any], key: str) -> Optional[float]:
    """A finite number under `key`, else None (absent, null, text, bool, NaN)."""
    value = record.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _completed(records: Records) -> list[Mapping[str, Any]]:
    """One record per step, sorted by step: the last one that ran to the end (a replayed
    step's final run), never a skipped or crashed one."""
    by_step: dict[int, Mapping[str, Any]] = {}
    for r in records:
        if not r.get("skipped") and not r.get("crashed") and isinstance(r.get("step"), int):
            by_step[r["step"]] = r
    return [by_step[s] for s in sorted(by_step)]


def _hot_peak(record: Mapping[str, Any]) -> Optional[float]:
    """Bytes on the step's hot rank: the cluster's worst peak (the rank that would run out
    first) under expert parallelism, this process's peak otherwise. None without a guard:
    an unguarded expert-parallel rank still logs max_peak_bytes, as 0 (nothing measured)."""
    own = _num(record, "peak_bytes")
    if own is None:
        return None
    value = _num(record, "max_peak_bytes")
    return value if value is not None else own


def _hot_decisions(record: Mapping[str, Any]) -> Mapping[str, Any]:
    """The decisions of the rank whose peak is plotted (rank_decisions[peak_rank])."""
    per_rank, rank = record.get("rank_decisions"), record.get("peak_rank")
    if isinstance(per_rank, list) and isinstance(rank, int) and 0 <= rank < len(per_rank) \
            and isinstance(per_rank[rank], dict):
        return per_rank[rank]
    decisions = record.get("decisions")
    return decisions if isinstance(decisions, dict) else {}


def _count(decisions: Mapping[str, Any], action: str) -> int:
    value = decisions.get(action, 0)
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _budget(records: Records) -> Optional[float]:
    """The run's budget: the most common positive budget_bytes (None: no limit)."""
    budgets = Counter(b for b in (_num(r, "budget_bytes") for r in records) if b and b > 0)
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


def _check_runs(runs: Runs) -> None:
    if not runs:
        raise UsageError("nothing to plot: no runs given")
    for name, records in runs.items():
        if not isinstance(records, Sequence) or isinstance(records, (str, bytes)) \
                or not all(isinstance(r, Mapping) for r in records):
            raise UsageError(f"run {name!r}: expected a list of step records (dicts)")


def _canvas(fig: Figure) -> Figure:
    FigureCanvasAgg(fig)  # attaches itself to the figure: savefig renders with Agg
    return fig


# ---- 1. memory timeline of the hot rank, one panel per run ------------------------------

def memory_timeline(runs: Runs) -> Figure:
    """Per run, one panel: the hot rank's peak bytes per step against the budget line,
    spike steps shaded, recompute / offload decisions marked (size: how many), safety-net
    re-runs starred, crashes an X. Panels share both axes so runs compare at a glance."""
    _check_runs(runs)
    if not any(_hot_peak(r) is not None for recs in runs.values() for r in recs):
        raise NothingToPlot("memory timeline: no log has peak_bytes "
                            "(train with --budget or --policy to record memory)")
    peaks = [p for recs in runs.values() for r in recs if (p := _hot_peak(r)) is not None]
    budgets = [b for recs in runs.values() if (b := _budget(recs)) is not None]
    unit = byte_unit(max(peaks + budgets))
    scale = 1024 ** ("B", "KiB", "MiB", "GiB", "TiB", "PiB").index(unit)
    shared_budget = Counter(budgets).most_common(1)[0][0] if budgets else None
    fig = _canvas(Figure(figsize=(10, 1.2 + 2.3 * len(runs)), layout="constrained"))
    axes = fig.subplots(len(runs), 1, sharex=True, sharey=True, squeeze=False)[:, 0]
    for ax, (name, records) in zip(axes, runs.items()):
        _memory_panel(ax, name, records, scale, shared_budget, spike_steps(records, runs))
        ax.set_ylabel(f"peak ({unit})")
    axes[-1].set_xlabel("step")
    # Logs do not say where they ran: the caption must hold for CPU and CUDA runs alike.
    fig.suptitle("Memory of the hot rank per step (the device's bytes; on CPU an emulated "
                 "device)")
    fig.legend(handles=_memory_legend(), loc="outside lower center", ncols=4, fontsize=8)
    return fig


def _memory_panel(ax, name: str, records: Records, scale: float,
                  shared_budget: Optional[float], spikes: list[int]) -> None:
    done = [r for r in _completed(records) if _hot_peak(r) is not None]
    crashed = [r for r in records if r.get("crashed") and isinstance(r.get("step"), int)]
    num_skipped = sum(1 for r in records if r.get("skipped"))
    for step in spikes:
        ax.axvspan(step - 0.5, step + 0.5, color=_SPIKE_COLOR, alpha=0.25, lw=0)
    budget = _budget(records)
    if budget is not None:
        ax.axhline(budget / scale, color="black", lw=1.2, ls="--", gid="budget")
    elif shared_budget is not None:  # e.g. the ceiling: show where the others' limit is
        ax.axhline(shared_budget / scale, color="grey", lw=1, ls=":", gid="others-budget")
    notes = []
    if done:
        steps = np.array([r["step"] for r in done])
        ys = np.array([_hot_peak(r) for r in done]) / scale
        gap = np.flatnonzero(np.diff(steps) > 1) + 1  # no line across lost steps
        ax.plot(np.insert(steps.astype(float), gap, np.nan), np.insert(ys, gap, np.nan),
                color="#264653", lw=1.4, marker="." if len(done) < 60 else None, gid="peak")
        _mark_decisions(ax, done, steps, ys)
        if budget is not None:
            over = int(np.sum(ys * scale > budget))
            notes.append(f"{over} over budget")
    else:
        ax.text(0.5, 0.5, "no peak_bytes recorded (no memory guard in this run)",
                transform=ax.transAxes, ha="center", va="center", color="grey")
    for r in crashed:
        y = _hot_peak(r) or budget or shared_budget
        if y is not None:
            ax.plot([r["step"]], [y / scale], marker="X", ms=11, color="black", ls="none",
                    gid="crash")
    if crashed:
        notes.append(f"{len(crashed)} crash{'es' if len(crashed) > 1 else ''}")
    if num_skipped:
        notes.append(f"{num_skipped} step{'s' if num_skipped > 1 else ''} lost")
    ax.set_title(name + (f"  ({', '.join(notes)})" if notes else ""), loc="left", fontsize=10)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _mark_decisions(ax, done: Records, steps: np.ndarray, ys: np.ndarray) -> None:
    """Markers on the line where the hot rank recomputed or offloaded, sized by count."""
    for action, marker, color in (("recompute", "^", _RECOMPUTE_COLOR),
                                  ("offload", "s", _OFFLOAD_COLOR)):
        counts = np.array([_count(_hot_decisions(r), action) for r in done])
        hit = counts > 0
        if hit.any():
            ax.scatter(steps[hit], ys[hit], s=18 + 10 * np.sqrt(counts[hit]), marker=marker,
                       color=color, alpha=0.8, zorder=3, lw=0)
    reruns = np.array([(_num(r, "safety_net_reruns") or 0) > 0 for r in done])
    if reruns.any():
        ax.scatter(steps[reruns], ys[reruns], s=120, marker="*", color="#7b2cbf", zorder=4)


def _memory_legend() -> list:
    return [Line2D([], [], color="#264653", lw=1.4, label="peak, hot rank"),
            Line2D([], [], color="black", ls="--", label="budget"),
            Patch(color=_SPIKE_COLOR, alpha=0.25, label="spike step"),
            Line2D([], [], marker="^", color=_RECOMPUTE_COLOR, ls="none", label="recompute"),
            Line2D([], [], marker="s", color=_OFFLOAD_COLOR, ls="none", label="offload"),
            Line2D([], [], marker="*", color="#7b2cbf", ls="none", ms=10,
                   label="safety-net re-run"),
            Line2D([], [], marker="X", color="black", ls="none", ms=9, label="crash (OOM)"),
            Line2D([], [], color="grey", ls=":", label="others' budget")]


# ---- 2. throughput per run ---------------------------------------------------------------

def throughput_stats(records: Records) -> Optional[tuple[float, float, float]]:
    """(25th percentile, median, 75th percentile) tokens/s over completed steps, or None."""
    rates = [v for r in _completed(records) if (v := _num(r, "tokens_per_s")) is not None]
    if not rates:
        return None
    q25, q75 = np.percentile(rates, [25, 75])
    return float(q25), float(median(rates)), float(q75)


def throughput(runs: Runs, effective: Optional[Mapping[str, float]] = None,
               relative: Optional[Mapping[str, float]] = None) -> Figure:
    """One bar per run. With a run named `ceiling`, bars are ratios to it: the run's median
    tokens/s over completed steps divided by the ceiling's (whisker: the run's 25-75%
    range, over the same), or the bench's `relative` ({name: ratio}, its median of
    per-segment ratios) when given, so the picture and the table say the same number.
    Without a ceiling, bars are median tokens/s. `effective` ({name: tokens/s}, from the
    bench) adds a hatched bar: throughput counting lost time and restarts, which a log
    alone cannot know (as a ratio, over the ceiling's effective figure)."""
    _check_runs(runs)
    stats = {name: throughput_stats(records) for name, records in runs.items()}
    if all(s is None for s in stats.values()) and not relative:
        raise NothingToPlot("throughput: no log has a completed step with tokens_per_s")
    names = list(runs)
    ceiling = stats.get(CEILING)
    base = ceiling[1] if ceiling and ceiling[1] > 0 else None
    as_ratio = base is not None or bool(relative)
    fig = _canvas(Figure(figsize=(max(5.0, 1.3 * len(names) + 2), 4.2), layout="constrained"))
    ax = fig.subplots()
    x = np.arange(len(names))
    width = 0.38 if effective else 0.6
    heights, err = _main_bars(names, stats, base if as_ratio else None, relative)
    what = ("bench: median of per-segment ratios" if relative else
            "median of steps (whisker: 25-75%)")
    bars = ax.bar(x - width / 2 if effective else x, heights, width,
                  yerr=err if np.nan_to_num(err).any() else None, capsize=3,
                  color="#2a9d8f", label=what)
    for bar, h, top in zip(bars, heights, heights + err[1]):
        _label(ax, bar, 0.0 if np.isnan(h) else top, "no data" if np.isnan(h) else
               f"{h:.2f}x" if as_ratio else f"{h:,.0f}")
    if effective:
        given = [_given_number(effective, n) for n in names]
        eff = np.array([np.nan if v is None else v for v in given])   # NaN: no bar
        eff_base = _given_number(effective, CEILING) or base
        if as_ratio and eff_base:
            eff = eff / eff_base
        for bar, h in zip(ax.bar(x + width / 2, eff, width, color="#e9c46a", hatch="//",
                                 label="effective (lost time, restarts)"), eff):
            if not np.isnan(h):
                _label(ax, bar, h, f"{h:.2f}x" if as_ratio else f"{h:,.0f}")
    if as_ratio:
        ax.axhline(1.0, color="grey", ls=":", lw=1)
    ax.set_xticks(x, names)
    ax.set_ylabel("throughput / ceiling's" if as_ratio else "tokens / s")
    ax.set_title("Throughput per run (on CPU: emulated device memory)")
    ax.margins(y=0.12)
    fig.legend(fontsize=8, loc="outside lower center", ncols=2)
    return fig


def _main_bars(names, stats, base, relative) -> tuple[np.ndarray, np.ndarray]:
    """Bar heights and (below, above) whiskers: the bench's ratios if given (no whisker),
    else medians over `base` (1.0 when None: tokens/s). A run with no data is NaN."""
    heights, err = [], []
    for name in names:
        given, s = _given_number(relative, name), stats[name]
        if given is not None:
            heights.append(given)
            err.append((0.0, 0.0))
        elif s is not None and not relative:
            scale = base or 1.0
            heights.append(s[1] / scale)
            err.append(((s[1] - s[0]) / scale, (s[2] - s[1]) / scale))
        else:
            heights.append(np.nan)
            err.append((0.0, 0.0))
    return np.array(heights), np.array(err).T


def _given_number(values: Optional[Mapping[str, Any]], name: str) -> Optional[float]:
    return _num(values, name) if values else None


def _label(ax, bar, y: float, text: str) -> None:
    ax.annotate(text, (bar.get_x() + bar.get_width() / 2, y), xytext=(0, 4),
                textcoords="offset points", ha="center", fontsize=8)


# ---- 3. per-layer, per-rank imbalance over steps -----------------------------------------

def imbalance_matrix(records: Records) -> tuple[Optional[np.ndarray], list[str], list[int], str]:
    """(matrix [rows, steps], row labels, steps, what it measures). Rows are layer x rank
    (tokens a rank received over the mean, from rank_imbalance) when the log is expert-
    parallel, else layers (max/mean tokens per expert). Columns are every step from the
    first to the last; one without a completed record (crashed, skipped) is NaN."""
    done = _completed(records)
    if done and done[-1]["step"] - done[0]["step"] > MAX_STEP_SPAN:
        raise NothingToPlot(f"imbalance: steps {done[0]['step']} to {done[-1]['step']} span "
                            f"more than {MAX_STEP_SPAN} columns")
    steps = list(range(done[0]["step"], done[-1]["step"] + 1)) if done else []
    for key, kind in (("rank_imbalance", "rank"), ("imbalance_per_layer", "expert"),
                      ("layer_imbalance", "expert")):
        rows = {r["step"]: _rows(r.get(key), kind) for r in done}
        shapes = Counter(len(v) for v in rows.values() if v)
        if shapes:
            num_rows = shapes.most_common(1)[0][0]
            matrix = np.array([rows[s] if len(rows.get(s, ())) == num_rows
                               else [np.nan] * num_rows for s in steps])
            labels = _row_labels(next(r.get(key) for r in done
                                      if len(rows[r["step"]]) == num_rows), kind)
            what = ("tokens received / mean over ranks" if kind == "rank"
                    else "max / mean tokens per expert")
            return matrix.T, labels, steps, what
    return None, [], steps, ""


def _rows(value: Any, kind: str) -> list[float]:
    """Flatten one step's imbalance into row values; [] when malformed."""
    def ok(v):
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    if kind == "rank":
        if not isinstance(value, list) or not value or not all(
                isinstance(layer, list) and layer and all(map(ok, layer)) for layer in value):
            return []
        if len({len(layer) for layer in value}) != 1:
            return []
        return [float(v) for layer in value for v in layer]
    if not isinstance(value, list) or not value or not all(map(ok, value)):
        return []
    return [float(v) for v in value]


def _row_labels(value: list, kind: str) -> list[str]:
    if kind == "rank":
        return [f"L{layer} r{rank}" for layer in range(len(value))
                for rank in range(len(value[0]))]
    return [f"L{layer}" for layer in range(len(value))]


def imbalance_heatmap(runs: Runs) -> Figure:
    """Per run, a heatmap: rows layer x rank, columns steps, colour the load over the mean
    (1.0: fair share). Spike steps are marked above the columns."""
    _check_runs(runs)
    matrices = {name: imbalance_matrix(records) for name, records in runs.items()}
    if all(m[0] is None for m in matrices.values()):
        raise NothingToPlot("imbalance: no log has rank_imbalance or imbalance_per_layer")
    heights = [max(2.0, 0.9 + 0.22 * (len(m[1]) or 4)) for m in matrices.values()]
    num_steps = max(len(m[2]) for m in matrices.values())
    fig = _canvas(Figure(figsize=(min(16.0, max(7.0, 3 + 0.06 * num_steps)),
                                  0.8 + sum(heights)), layout="constrained"))
    axes = fig.subplots(len(runs), 1, sharex=True, squeeze=False,
                        height_ratios=heights)[:, 0]
    # One colour scale for every panel, so the same load looks the same in every run.
    finite = [m[0][np.isfinite(m[0])] for m in matrices.values() if m[0] is not None]
    finite = np.concatenate(finite) if finite else np.array([])
    limits = (float(finite.min()), float(finite.max())) if finite.size else (1.0, 1.0)
    for ax, (name, records) in zip(axes, runs.items()):
        _heatmap_panel(fig, ax, name, spike_steps(records, runs), *matrices[name], limits)
    all_steps = [s for m in matrices.values() for s in m[2]]
    if all_steps:  # imshow sets each panel's limits; the shared axis needs every run's
        axes[-1].set_xlim(min(all_steps) - 0.5, max(all_steps) + 0.5)
    axes[-1].set_xlabel("step")
    fig.suptitle("Load imbalance per layer and rank over steps")
    return fig


def _heatmap_panel(fig, ax, name, spikes, matrix, labels, steps, what, limits) -> None:
    ax.set_title(f"{name}: {what}" if what else name, loc="left", fontsize=10)
    ax.set_facecolor("#d9d9d9")  # steps with no completed record (crashed, skipped)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if matrix is None:
        ax.text(0.5, 0.5, "no imbalance in this log", transform=ax.transAxes,
                ha="center", va="center", color="grey")
        ax.set_yticks([])
        return
    low, high = limits
    if low < 1.0 < high:  # under and over the fair share: diverge at 1.0
        norm, cmap = TwoSlopeNorm(vcenter=1.0, vmin=low, vmax=high), "RdBu_r"
    else:
        norm, cmap = Normalize(vmin=min(low, 1.0), vmax=max(high, 1.0 + 1e-6)), "Reds"
    first, last = (steps[0], steps[-1]) if steps else (0, 0)
    image = ax.imshow(np.ma.masked_invalid(matrix), aspect="auto", interpolation="nearest",
                      cmap=cmap, norm=norm, extent=(first - 0.5, last + 0.5,
                                                    len(labels) - 0.5, -0.5))
    ax.set_yticks(range(len(labels)), labels, fontsize=7)
    if spikes:
        ax.plot(spikes, [-0.5] * len(spikes), marker="v", color=_SPIKE_COLOR, ls="none",
                clip_on=False, ms=6, label="spike step")
    fig.colorbar(image, ax=ax, label="x fair share", pad=0.01, shrink=0.9)


# ---- saving -------------------------------------------------------------------------------

def save_png(fig: Figure, path: str | Path) -> Path:
    """Write the figure as a PNG, atomically (a temp file, then rename), so a failed save
    never leaves half an image where a good one was."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    fig.savefig(tmp, format="png", dpi=110)
    os.replace(tmp, path)
    return path


def make_figures(runs: Runs, *, effective: Optional[Mapping[str, float]] = None,
                 relative: Optional[Mapping[str, float]] = None,
                 with_throughput: Optional[bool] = None) -> tuple[dict[str, Figure], list[str]]:
    """Every figure the logs can feed, {key of PLOT_FILES: Figure}, and one line per plot
    left out and why. Throughput is drawn when there are several runs unless
    `with_throughput` says otherwise."""
    _check_runs(runs)
    if with_throughput is None:
        with_throughput = len(runs) > 1
    makers = {"memory": lambda: memory_timeline(runs),
              "imbalance": lambda: imbalance_heatmap(runs)}
    if with_throughput:
        makers["throughput"] = lambda: throughput(runs, effective, relative)
    figures, notes = {}, []
    for key, make in makers.items():
        try:
            figures[key] = make()
        except NothingToPlot as exc:
            notes.append(str(exc))
    return figures, notes


def save_figures(figures: Mapping[str, Figure], out_dir: str | Path) -> list[Path]:
    """Save make_figures' figures into `out_dir` (which must exist) under PLOT_FILES."""
    return [save_png(fig, Path(out_dir) / PLOT_FILES[key]) for key, fig in figures.items()]


def draw_plots(runs: Runs, out_dir: str | Path, *,
               effective: Optional[Mapping[str, float]] = None,
               relative: Optional[Mapping[str, float]] = None,
               with_throughput: Optional[bool] = None) -> tuple[list[Path], list[str]]:
    """make_figures, then save_figures: the files written and the plots left out (why)."""
    figures, notes = make_figures(runs, effective=effective, relative=relative,
                                  with_throughput=with_throughput)
    return save_figures(figures, out_dir), notes
