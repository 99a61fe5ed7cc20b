"""The bench's figures agree: one report, built once from known jobs, rendered as the
terminal/docs table, the JSON, the throughput plot's bars and the docs page, shows the
same number for each ratio everywhere, and that number is the ratio of totals (the table's
own tok/s over the ceiling's), not a median of per-segment ratios.

    .venv/bin/python -m pytest tests/bench/test_bench_figures.py -q
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from spikeguard.bench import outputs, results
from spikeguard.bench.bench_docs import page
from spikeguard.bench.plots import make_figures
from spikeguard.bench.runner import Job, PolicyRun
from spikeguard.bench.spread import spread
from spikeguard.bench.table import table_header, table_rows

SEGMENTS = [(1, 3), (4, 6), (7, 9)]


def _rec(step, seconds, tokens=100):
    return {"step": step, "step_time_s": seconds, "tokens": tokens,
            "tokens_per_s": tokens / seconds}


def _run(policy, seconds_per_segment, crash_at=None):
    """A policy's run over SEGMENTS: each step of segment i takes seconds_per_segment[i];
    with crash_at, the job dies there (checkpoint at the segment's start) and restarts."""
    run = PolicyRun(policy)
    for (first, last), sec in zip(SEGMENTS, seconds_per_segment):
        steps = list(range(first, last + 1))
        if crash_at in steps:
            done = [_rec(s, sec) for s in steps if s < crash_at]
            run.jobs.append(Job(policy, first, last, sum(r["step_time_s"] for r in done) + 3.0,
                                crash_at, done))
            run.dropped.add(crash_at)
            again = [_rec(s, sec) for s in steps if s != crash_at]
            run.jobs.append(Job(policy, first, last, sec * len(again), None, again))
        else:
            run.jobs.append(Job(policy, first, last, sec * len(steps), None,
                                [_rec(s, sec) for s in steps]))
    return run


@pytest.fixture
def report(tmp_path):
    # The ceiling is slow in one segment (machine noise): the median of per-segment
    # ratios and the ratio of totals then differ, as they did in the issue (0.692 vs 0.55).
    runs = {"ceiling": _run("ceiling", [0.01, 0.01, 0.05]),
            "none": _run("none", [0.012, 0.011, 0.05], crash_at=5),
            "full": _run("full", [0.02, 0.02, 0.03]),
            "adaptive": _run("adaptive", [0.011, 0.012, 0.05])}
    figures = {p: results.policy_figures(r, 1000, SEGMENTS, 284.0, 900 if p == "ceiling" else None)
               for p, r in runs.items()}
    results.add_ratios(figures)
    safe = results.pick_safe_static(figures)
    figures["safe-static"] = {**figures[safe], "is": safe}
    report = {
        "command": "spikeguard bench --preset tiny", "date": "2026-12-01 12:00 UTC",
        "machine": {"platform": "test", "cpus": 2, "torch": "2.13.0", "device": "CPU only"},
        "workload": {"preset": "tiny", "ep": 2, "pp": 1, "dp": 1, "nproc": 2, "schedule": None,
                     "num_layers": None, "num_experts": None, "steps": 9, "batch_size": 1,
                     "micro_batches": 1, "pattern": "production", "trace": "t.jsonl",
                     "spike_steps": [5], "segments": 3, "checkpoint_every": 3,
                     "restart_cost_s": 284.0},
        "budget_bytes": 1000, "budget_rule": "given", "policies": figures,
        "order": [*runs, "safe-static"], "work": str(tmp_path)}
    return report, runs


def test_every_rendering_shows_the_same_ratios(report, tmp_path):
    report, runs = report
    pol = report["policies"]
    ceiling_tps = pol["ceiling"]["tokens_per_s"]
    # The definition: ratio of totals, checkable by hand from the tok/s column.
    medians = {n: float(np.median(f["segment_ratios"])) for n, f in pol.items()}
    assert any(abs(medians[n] - pol[n]["relative_to_ceiling"]) > 0.02 for n in pol), \
        "the fixture must tell the two definitions apart"
    for name, f in pol.items():
        assert f["relative_to_ceiling"] == pytest.approx(f["tokens_per_s"] / ceiling_tps)
        assert f["effective_relative_to_ceiling"] == pytest.approx(
            f["effective_tokens_per_s"] / ceiling_tps)
    assert pol["none"]["lost_seconds"] > 0
    assert pol["none"]["effective_relative_to_ceiling"] < pol["none"]["relative_to_ceiling"]

    # The table (terminal and docs print the same rows).
    header = table_header(report)
    rows = {row[0].split(" (")[0]: dict(zip(header, row)) for row in table_rows(report)}
    for name, f in pol.items():
        row = rows[name]
        tps = float(row["tok/s"])
        assert row["vs ceiling"].split(" ")[0] == f"{f['relative_to_ceiling']:.3f}"
        assert float(row["vs ceiling"].split(" ")[0]) == pytest.approx(
            tps / float(rows["ceiling"]["tok/s"]), abs=0.002)   # by hand from the tok/s column
        assert row["effective vs ceiling"] == f"{f['effective_relative_to_ceiling']:.3f}"
        assert row["at 284 s/restart"] == f"{f['effective_relative_at_restart_cost']:.3f}"
        # The segments' spread, and the segments a +-0.01 would need (spikeguard.bench.spread).
        if name != "ceiling":
            s = spread(f["segment_ratios"])
            assert f["segment_spread"] == s
            assert row["vs ceiling"].endswith(f"({s['min']:.2f}-{s['max']:.2f})")
            assert row["segments for +-0.01"] == f"~{s['n_for_0.01']}"

    # The JSON holds the same numbers.
    loaded = json.loads(json.dumps(report, default=str))
    for name, f in pol.items():
        for key in ("tokens_per_s", "relative_to_ceiling", "effective_relative_to_ceiling",
                    "effective_relative_at_restart_cost"):
            assert loaded["policies"][name][key] == f[key]

    # The throughput plot, as the bench draws it: its bars are the report's ratios.
    logs = {name: run.final_records() for name, run in runs.items()}
    figures, _ = make_figures(logs, **outputs.throughput_bars(report))
    ax = figures["throughput"].axes[0]
    heights = [p.get_height() for p in ax.patches]
    names = list(logs)
    assert heights[:len(names)] == pytest.approx([pol[n]["relative_to_ceiling"] for n in names])
    assert heights[len(names):] == pytest.approx(
        [pol[n]["effective_relative_to_ceiling"] for n in names])
    labels = {t.get_text() for t in ax.texts}
    for name in names:
        assert f"{pol[name]['relative_to_ceiling']:.2f}x" in labels
        assert f"{pol[name]['effective_relative_to_ceiling']:.2f}x" in labels

    # The docs page: every table row, and the definition it states.
    text = page(report, [], tmp_path, "bench.md")
    for row in table_rows(report):
        assert "| " + " | ".join(row) + " |" in text
    assert "ratio of totals" in text and "median over segments" not in text
