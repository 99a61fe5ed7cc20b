"""The comparison table, as rows of text: the terminal table (bench_cli) and the docs page
(bench_docs) print the same rows. Every number is a field of the report
(spikeguard.bench.results), formatted, never computed here."""

from __future__ import annotations

from spikeguard.bench import spread
from spikeguard.memory.budget import format_bytes

TABLE_HEADER = ["policy", "tok/s", "vs ceiling", "segments for +-0.01", "peak", "over budget",
                "OOM + restarts", "lost s", "effective vs ceiling", "at 284 s/restart",
                "save/rec/off", "evicted"]
RESTART_COLUMN = TABLE_HEADER.index("at 284 s/restart")


def table_header(report: dict) -> list[str]:
    header = list(TABLE_HEADER)
    header[RESTART_COLUMN] = f"at {report['workload']['restart_cost_s']:g} s/restart"
    return header


def _fmt(value, spec: str, none: str = "-") -> str:
    return none if value is None else format(value, spec)


def _relative(f: dict, name: str) -> str:
    """The ratio to the ceiling (of totals: results.add_ratios), with the lowest and
    highest segment's ratio beside it (the spread, from the same report)."""
    text = _fmt(f["relative_to_ceiling"], ".3f")
    ratios = (f.get("segment_ratios") or []) if name != "ceiling" else []
    return f"{text} ({min(ratios):.2f}-{max(ratios):.2f})" if len(ratios) > 1 else text


def _needed(f: dict, name: str) -> str:
    """The segments of this length a +-0.01 on the ratio would need, from the segments'
    spread (results.add_ratios; a report from before the field: its segment ratios)."""
    s = f.get("segment_spread") or spread.of(f.get("segment_ratios"))
    return "-" if name == "ceiling" or s is None else spread.needed(s)


def _evicted(f: dict) -> str:
    """Bytes evicted to host over the run, on how many steps (and whose, when the log had
    one rank's only), and how much of it came back for backward: '183 MiB on 3 steps,
    183 MiB back (r0)', '0', '-' for a report without them."""
    if "evicted_bytes" not in f:
        return "-"
    if not f["evicted_bytes"]:
        return "0"
    whose = f" ({f['evicted_whose']})" if f.get("evicted_whose") else ""
    back = f", {format_bytes(f['prefetched_bytes'])} back" if "prefetched_bytes" in f else ""
    return (f"{format_bytes(f['evicted_bytes'])} on {f.get('evicted_steps', 0)} steps"
            f"{back}{whose}")


def table_rows(report: dict) -> list[list[str]]:
    """The comparison as rows of text (the terminal table and the docs page share them)."""
    rows = []
    for name in report["order"]:
        f = report["policies"][name]
        label = f"{name} ({f['is']})" if "is" in f else name
        d = f["decisions"]
        rows.append([
            label, _fmt(f["tokens_per_s"], ".0f"), _relative(f, name), _needed(f, name),
            format_bytes(f["peak_bytes"]) if f["peak_bytes"] else "-",
            str(f["overruns"]), str(f["oom_events"]), _fmt(f["lost_seconds"], ".1f"),
            _fmt(f.get("effective_relative_to_ceiling"), ".3f"),
            _fmt(f.get("effective_relative_at_restart_cost"), ".3f"),
            f"{d['save']}/{d['recompute']}/{d['offload']}", _evicted(f),
        ])
    return rows
