"""`spikeguard report`: the bench's plots, drawn from any training log.

    .venv/bin/spikeguard train --preset tiny --steps 20 --budget 4MiB --log runs/a.jsonl
    .venv/bin/spikeguard report runs/a.jsonl runs/b.jsonl --plots runs/plots

Each log is one run, named by its file stem (parent/stem where two stems collide). It
draws the memory timeline and the imbalance heatmap, and the throughput bars when there
are several logs, then prints the paths it wrote; a plot no log can feed is one line
saying why. Every input is read and checked before anything is written, and a PNG is
only ever written over a PNG: never over a log or another file.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from spikeguard.errors import UsageError

TRACE_FORMAT = "spikeguard-trace"  # spikeguard.routing.trace's header, to name the mistake
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def add_parser(commands: Any) -> argparse.ArgumentParser:
    """Add `report` to the CLI's subcommands (the `commands` of add_subparsers)."""
    report = commands.add_parser("report", help="draw the bench's plots from training logs")
    report.add_argument("logs", nargs="+", metavar="RUN.jsonl",
                        help="training logs (spikeguard train --log), one run each")
    report.add_argument("--plots", required=True, metavar="DIR",
                        help="folder for the PNGs (created if missing)")
    report.add_argument("--overwrite", action="store_true",
                        help="replace PNGs already in --plots (refused without it)")
    report.set_defaults(run=run_report)
    return report


def run_report(args: argparse.Namespace) -> int:
    from spikeguard.extras import require

    require("matplotlib", "plots", "spikeguard report")
    from spikeguard.bench.plots import PLOT_FILES, make_figures, save_figures

    paths = [Path(p) for p in args.logs]
    runs = {name: read_log(path) for name, path in zip(run_names(paths), paths)}
    out_dir = _check_out_dir(Path(args.plots), paths, PLOT_FILES.values(), args.overwrite)
    figures, notes = make_figures(runs)
    if not figures:
        raise UsageError("no plot could be drawn: " + "; ".join(notes))
    for note in notes:
        print(f"skipped: {note}")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        written = save_figures(figures, out_dir, overwrite=args.overwrite)
    except OSError as exc:
        raise UsageError(f"cannot write plots to {out_dir}: {exc.strerror or exc}") from None
    for path in written:
        print(path)
    return 0


def read_log(path: Path) -> list[dict[str, Any]]:
    """The step records of a JSON-lines training log; UsageError (with the line number)
    for a missing, empty or malformed one. Blank lines are allowed."""
    if not path.exists():
        raise UsageError(f"log not found: {path}")
    if path.is_dir():
        raise UsageError(f"log is a directory, not a file: {path}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise UsageError(f"log is not UTF-8 text (a JSON-lines training log?): {path}") from None
    except OSError as exc:
        raise UsageError(f"cannot read log {path}: {exc.strerror or exc}") from None
    records = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        records.append(_parse_record(line, path, number))
    if not records:
        raise UsageError(f"log is empty (no step records): {path}")
    return records


def _parse_record(line: str, path: Path, number: int) -> dict[str, Any]:
    where = f"{path} line {number}"
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise UsageError(f"{where}: not JSON ({exc.msg}, column {exc.colno})") from None
    if not isinstance(record, dict):
        raise UsageError(f"{where}: expected a JSON object (one step record), "
                         f"got {type(record).__name__}")
    if record.get("format") == TRACE_FORMAT:
        raise UsageError(f"{path} is a routing trace, not a training log "
                         "(make one with spikeguard train --log FILE)")
    step = record.get("step")
    if isinstance(step, bool) or not isinstance(step, int):
        raise UsageError(f"{where}: a step record needs an integer 'step', got {step!r}")
    return record


def run_names(paths: list[Path]) -> list[str]:
    """File stems; parent/stem for stems that collide; the same file twice is an error."""
    resolved = [p.resolve() for p in paths]
    for i, p in enumerate(resolved):
        if p in resolved[:i]:
            raise UsageError(f"log given twice: {paths[i]}")
    stems = [p.stem for p in paths]
    names = [f"{p.resolve().parent.name}/{p.stem}" if stems.count(p.stem) > 1 else p.stem
             for p in paths]
    if len(set(names)) < len(names):
        raise UsageError("two logs share a folder name and a file name; rename one: "
                         + ", ".join(str(p) for p, n in zip(paths, names)
                                     if names.count(n) > 1))
    return names


def _check_out_dir(out_dir: Path, logs: list[Path], file_names, overwrite: bool) -> Path:
    """The --plots folder must be a folder (or creatable), no PNG it would write may land
    on a log or on a file that is not a PNG, and an existing PNG needs --overwrite
    (spikeguard.files' rule for every output)."""
    if out_dir.exists() and not out_dir.is_dir():
        raise UsageError(f"--plots must be a folder, but is a file: {out_dir}")
    parent = next((p for p in out_dir.absolute().parents if p.exists()), None)
    if not out_dir.exists() and parent is not None and not parent.is_dir():
        raise UsageError(f"--plots cannot be created under a file: {parent}")
    folder = out_dir if out_dir.exists() else parent
    if folder is not None and not os.access(folder, os.W_OK | os.X_OK):
        # A folder that cannot be written is the user's input, found before drawing
        # (it was exit 3, a write that failed once work began).
        raise UsageError(f"cannot write plots to {out_dir}: " + (
            "the folder is not writable" if folder == out_dir
            else f"{folder} is not writable, so it cannot be created"))
    inputs = {p.resolve() for p in logs}
    for name in file_names:
        target = out_dir / name
        if target.resolve() in inputs:
            raise UsageError(f"--plots would overwrite the log {target}; choose another folder")
        if target.is_dir():
            raise UsageError(f"--plots holds a folder where a plot goes: {target}")
        if target.exists() and not _is_png(target):
            raise UsageError(f"--plots holds {target}, which is not a PNG; it will not be "
                             "overwritten (move it or choose another folder)")
        if target.exists() and not overwrite:
            raise UsageError(f"--plots {target} exists; pass --overwrite to replace it")
    return out_dir


def _is_png(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(len(_PNG_SIGNATURE)) == _PNG_SIGNATURE
    except OSError:
        return False
