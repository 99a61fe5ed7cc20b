"""Per-layer, per-rank imbalance over steps, a heatmap per run (spikeguard.bench.plots)."""

from __future__ import annotations

from collections import Counter
from typing import Any, Optional

from spikeguard.extras import require

# matplotlib and numpy are the `plots` extra: a missing one is one line naming it.
np = require("numpy", "plots", "the plots")
_colors = require("matplotlib.colors", "plots", "the plots")
Normalize, TwoSlopeNorm = _colors.Normalize, _colors.TwoSlopeNorm
Figure = require("matplotlib.figure", "plots", "the plots").Figure
MaxNLocator = require("matplotlib.ticker", "plots", "the plots").MaxNLocator

from spikeguard.bench.plot_records import (
    NothingToPlot, Records, Runs, SPIKE_COLOR, canvas, check_runs, completed, spike_steps)

MAX_STEP_SPAN = 100_000  # heatmap columns: a log with steps 1 and 10**9 must not fill memory


def imbalance_matrix(records: Records) -> tuple[Optional[np.ndarray], list[str], list[int], str]:
    """(matrix [rows, steps], row labels, steps, what it measures). Rows are layer x rank
    (tokens a rank received over the mean, from rank_imbalance) when the log is expert-
    parallel, else layers (max/mean tokens per expert). Columns are every step from the
    first to the last; one without a completed record (crashed, skipped) is NaN."""
    done = completed(records)
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
    check_runs(runs)
    matrices = {name: imbalance_matrix(records) for name, records in runs.items()}
    if all(m[0] is None for m in matrices.values()):
        raise NothingToPlot("imbalance: no log has rank_imbalance or imbalance_per_layer")
    heights = [max(2.0, 0.9 + 0.22 * (len(m[1]) or 4)) for m in matrices.values()]
    num_steps = max(len(m[2]) for m in matrices.values())
    fig = canvas(Figure(figsize=(min(16.0, max(7.0, 3 + 0.06 * num_steps)),
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
        ax.plot(spikes, [-0.5] * len(spikes), marker="v", color=SPIKE_COLOR, ls="none",
                clip_on=False, ms=6, label="spike step")
    fig.colorbar(image, ax=ax, label="x fair share", pad=0.01, shrink=0.9)
