"""Throughput per run (spikeguard.bench.plots): bars against the ceiling, and the effective
(crash-discounted) figure beside them."""

from __future__ import annotations

from statistics import median
from typing import Any, Mapping, Optional

from spikeguard.extras import require

# matplotlib and numpy are the `plots` extra: a missing one is one line naming it.
np = require("numpy", "plots", "the plots")
Figure = require("matplotlib.figure", "plots", "the plots").Figure

from spikeguard.bench.plot_records import (
    CEILING, NothingToPlot, Records, Runs, canvas, check_runs, completed, num)


def throughput_stats(records: Records) -> Optional[tuple[float, float, float]]:
    """(25th percentile, median, 75th percentile) tokens/s over completed steps, or None."""
    rates = [v for r in completed(records) if (v := num(r, "tokens_per_s")) is not None]
    if not rates:
        return None
    q25, q75 = np.percentile(rates, [25, 75])
    return float(q25), float(median(rates)), float(q75)


def throughput(runs: Runs, effective: Optional[Mapping[str, float]] = None,
               relative: Optional[Mapping[str, float]] = None,
               effective_relative: Optional[Mapping[str, float]] = None) -> Figure:
    """One bar per run. With a run named `ceiling`, bars are ratios to it: the run's median
    tokens/s over completed steps divided by the ceiling's (whisker: the run's 25-75%
    range, over the same), or the bench's `relative` ({name: ratio}, its
    relative_to_ceiling) when given, so the picture and the table say the same number.
    Without a ceiling, bars are median tokens/s. `effective` ({name: tokens/s}) adds a
    hatched bar: throughput counting lost time and restarts, which a log alone cannot
    know (as a ratio, over the ceiling's effective figure); `effective_relative` ({name:
    ratio}, the bench's effective_relative_to_ceiling) gives those bars as they are."""
    check_runs(runs)
    stats = {name: throughput_stats(records) for name, records in runs.items()}
    if all(s is None for s in stats.values()) and not relative:
        raise NothingToPlot("throughput: no log has a completed step with tokens_per_s")
    names = list(runs)
    ceiling = stats.get(CEILING)
    base = ceiling[1] if ceiling and ceiling[1] > 0 else None
    as_ratio = base is not None or bool(relative)
    fig = canvas(Figure(figsize=(max(5.0, 1.3 * len(names) + 2), 4.2), layout="constrained"))
    ax = fig.subplots()
    x = np.arange(len(names))
    if effective_relative:
        effective = effective_relative
    width = 0.38 if effective else 0.6
    heights, err = _main_bars(names, stats, base if as_ratio else None, relative)
    what = ("bench: tokens/s over the ceiling's" if relative else
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
        if as_ratio and eff_base and not effective_relative:
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
    return num(values, name) if values else None


def _label(ax, bar, y: float, text: str) -> None:
    ax.annotate(text, (bar.get_x() + bar.get_width() / 2, y), xytext=(0, 4),
                textcoords="offset points", ha="center", fontsize=8)
