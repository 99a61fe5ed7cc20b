"""The memory timeline of the hot rank, one panel per run (spikeguard.bench.plots)."""

from __future__ import annotations

from collections import Counter
from typing import Optional

from spikeguard.extras import require

# matplotlib and numpy are the `plots` extra: a missing one is one line naming it.
np = require("numpy", "plots", "the plots")
Figure = require("matplotlib.figure", "plots", "the plots").Figure
Line2D = require("matplotlib.lines", "plots", "the plots").Line2D
Patch = require("matplotlib.patches", "plots", "the plots").Patch
MaxNLocator = require("matplotlib.ticker", "plots", "the plots").MaxNLocator

from spikeguard.bench.plot_records import (
    OFFLOAD_COLOR, RECOMPUTE_COLOR, SPIKE_COLOR, NothingToPlot, Records, Runs, canvas,
    check_runs, completed, count, hot_decisions, hot_peak, num, run_budget, spike_steps)
from spikeguard.memory.budget import byte_unit


def memory_timeline(runs: Runs) -> Figure:
    """Per run, one panel: the hot rank's peak bytes per step against the budget line,
    spike steps shaded, recompute / offload decisions marked (size: how many), safety-net
    re-runs starred, crashes an X. Panels share both axes so runs compare at a glance."""
    check_runs(runs)
    if not any(hot_peak(r) is not None for recs in runs.values() for r in recs):
        raise NothingToPlot("memory timeline: no log has peak_bytes "
                            "(train with --budget or --policy to record memory)")
    peaks = [p for recs in runs.values() for r in recs if (p := hot_peak(r)) is not None]
    budgets = [b for recs in runs.values() if (b := run_budget(recs)) is not None]
    unit = byte_unit(max(peaks + budgets))
    scale = 1024 ** ("B", "KiB", "MiB", "GiB", "TiB", "PiB").index(unit)
    shared_budget = Counter(budgets).most_common(1)[0][0] if budgets else None
    fig = canvas(Figure(figsize=(10, 1.2 + 2.3 * len(runs)), layout="constrained"))
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
    done = [r for r in completed(records) if hot_peak(r) is not None]
    crashed = [r for r in records if r.get("crashed") and isinstance(r.get("step"), int)]
    num_skipped = sum(1 for r in records if r.get("skipped"))
    for step in spikes:
        ax.axvspan(step - 0.5, step + 0.5, color=SPIKE_COLOR, alpha=0.25, lw=0)
    budget = run_budget(records)
    if budget is not None:
        ax.axhline(budget / scale, color="black", lw=1.2, ls="--", gid="budget")
    elif shared_budget is not None:  # e.g. the ceiling: show where the others' limit is
        ax.axhline(shared_budget / scale, color="grey", lw=1, ls=":", gid="others-budget")
    notes = []
    if done:
        steps = np.array([r["step"] for r in done])
        ys = np.array([hot_peak(r) for r in done]) / scale
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
        y = hot_peak(r) or budget or shared_budget
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
    for action, marker, color in (("recompute", "^", RECOMPUTE_COLOR),
                                  ("offload", "s", OFFLOAD_COLOR)):
        counts = np.array([count(hot_decisions(r), action) for r in done])
        hit = counts > 0
        if hit.any():
            ax.scatter(steps[hit], ys[hit], s=18 + 10 * np.sqrt(counts[hit]), marker=marker,
                       color=color, alpha=0.8, zorder=3, lw=0)
    reruns = np.array([(num(r, "safety_net_reruns") or 0) > 0 for r in done])
    if reruns.any():
        ax.scatter(steps[reruns], ys[reruns], s=120, marker="*", color="#7b2cbf", zorder=4)


def _memory_legend() -> list:
    return [Line2D([], [], color="#264653", lw=1.4, label="peak, hot rank"),
            Line2D([], [], color="black", ls="--", label="budget"),
            Patch(color=SPIKE_COLOR, alpha=0.25, label="spike step"),
            Line2D([], [], marker="^", color=RECOMPUTE_COLOR, ls="none", label="recompute"),
            Line2D([], [], marker="s", color=OFFLOAD_COLOR, ls="none", label="offload"),
            Line2D([], [], marker="*", color="#7b2cbf", ls="none", ms=10,
                   label="safety-net re-run"),
            Line2D([], [], marker="X", color="black", ls="none", ms=9, label="crash (OOM)"),
            Line2D([], [], color="grey", ls=":", label="others' budget")]
