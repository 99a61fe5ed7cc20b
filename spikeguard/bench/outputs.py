"""What `spikeguard bench` writes, all from one report: the terminal table, `--json`, the
plots and the `--docs` page. None of them computes a figure: each reads the report's
fields (spikeguard.bench.results defines them), so they cannot disagree
(tests/bench/test_bench_figures.py renders all four from one report and compares).

Every file goes through spikeguard.files: checked before any job runs (an existing one
needs `--overwrite`; none may be the `--trace` the bench reads, or another output),
written to a temporary name and renamed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from spikeguard.errors import UsageError


def plot_files(folder: Optional[str]) -> list[Path]:
    from spikeguard.bench.plots import PLOT_FILES

    return [] if folder is None else [Path(folder) / name for name in PLOT_FILES.values()]


def check_outputs(*, json: Optional[str], docs: Optional[str], plots: Optional[str],
                  trace: Optional[str], overwrite: bool) -> None:
    """Every output of the bench, before any job runs (UsageError, exit 2)."""
    from spikeguard.files import check_outputs as check

    files = None
    if plots is not None:
        folder = Path(plots)
        if folder.exists() and not folder.is_dir():
            raise UsageError(f"--plots {folder} is a file")
        if not folder.exists() and not folder.absolute().parent.is_dir():
            raise UsageError(f"--plots {folder}: folder {folder.absolute().parent} does not exist")
        files = plot_files(plots) if folder.is_dir() else None
    check({"--json": json, "--docs": docs, "--plots": files},
          inputs={"--trace": trace}, overwrite=overwrite)


def throughput_bars(report: dict) -> dict[str, dict[str, Any]]:
    """What the throughput plot draws, per policy: with a ceiling, the report's
    relative_to_ceiling and effective_relative_to_ceiling as they are; without one, the
    tokens/s (the plot's own medians) and effective_tokens_per_s."""
    policies = report["policies"]
    if "ceiling" in policies:
        return {"relative": {n: f["relative_to_ceiling"] for n, f in policies.items()},
                "effective_relative": {n: f["effective_relative_to_ceiling"]
                                       for n, f in policies.items()}}
    return {"effective": {n: f["effective_tokens_per_s"] for n, f in policies.items()}}


def plot_runs(runs: dict, measured: list[dict]) -> dict[str, list[dict]]:
    """The plots' logs: each policy's final records, the ceiling's memory taken from the
    measurement pass (it runs without a guard, so it logs no bytes; the pass is the same
    trace, everything saved, no limit)."""
    logs = {name: run.final_records() for name, run in runs.items()}
    if "ceiling" in logs:
        peaks = {r["step"]: r.get("max_peak_bytes") for r in measured}
        logs["ceiling"] = [{**r, "max_peak_bytes": peaks.get(r["step"]),
                            "peak_bytes": peaks.get(r["step"])} for r in logs["ceiling"]]
    return logs


def write_json(path: str, report: dict, overwrite: bool) -> None:
    from spikeguard.files import atomic_write

    atomic_write(path, json.dumps(report, indent=1, default=str), overwrite=overwrite,
                 what="--json")


def write_plots(folder: str, logs: dict[str, list[dict]], report: dict, overwrite: bool,
                echo) -> list[Path]:
    from spikeguard.bench.plots import make_figures, save_figures

    Path(folder).mkdir(exist_ok=True)
    figures, notes = make_figures(logs, **throughput_bars(report))
    for note in notes:
        echo(f"plot left out: {note}")
    written = save_figures(figures, folder, overwrite=overwrite)
    for path in written:
        echo(f"wrote {path}")
    return written


def write_docs(path: str, report: dict, plots: list[Path], overwrite: bool) -> None:
    from spikeguard.bench.bench_docs import page
    from spikeguard.files import atomic_write

    docs = Path(path)
    atomic_write(docs, page(report, plots, docs.parent, docs.name), overwrite=overwrite,
                 what="--docs")


def print_table(console, report: dict) -> None:
    from rich.table import Table

    from spikeguard.bench.table import table_header, table_rows
    from spikeguard.memory.budget import format_bytes

    table = Table(title=f"spikeguard bench: budget {format_bytes(report['budget_bytes'])} per "
                        f"rank (CPU, emulated device)")
    for i, name in enumerate(table_header(report)):
        table.add_column(name, justify="left" if i == 0 else "right")
    for row in table_rows(report):
        table.add_row(*row)
    console.print(table)
