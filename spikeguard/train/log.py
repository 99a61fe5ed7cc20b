"""The per-step log line and the JSON-lines step log.

One fixed-width line per step, so columns line up in a terminal and in a log file:

    step   12 | loss 2.314 |  41.2k tok/s | imb 1.9x | val 2.401
    step   12 | loss 2.314 |  41.2k tok/s | imb 1.9x | peak 1.82 MiB / 2.00 MiB | save 28 rec 3 off 1 | evict 61.3 MiB back 61.3 MiB

The memory fields appear only when a memory guard added them to the step record; under
expert parallelism the decisions are given per rank, joined by '+' (rank 0 first).
`evict` (only when nonzero) is the guard's `evicted_bytes`: earlier layers' saved tensors
moved to host to make room, a decision the save/rec/off counts do not show, and `back` its
`prefetched_bytes`, what of them was brought back to the device for backward (measured at
the copy); per rank ('0+61.30 MiB') where the record has `rank_evicted_bytes` (the
cluster summaries gather them), else one rank's, named ('r0').
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from spikeguard.memory.budget import byte_unit, format_bytes


def format_rate(per_s: float) -> str:
    """12 -> '12', 6340 -> '6.34k', 41234 -> '41.2k', 1.5e6 -> '1.50M' (3 significant digits)."""
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if per_s >= scale:
            value = per_s / scale
            decimals = 2 if value < 10 else 1 if value < 100 else 0
            return f"{value:.{decimals}f}{suffix}"
    return f"{per_s:.0f}"


def step_line(record: dict[str, Any], num_steps: int) -> str:
    """The fixed-width console line of one step record."""
    width = max(4, len(str(num_steps)))
    if record.get("skipped"):
        return f"step {record['step']:>{width}} | skipped: the batch was dropped after a crash"
    parts = [
        f"step {record['step']:>{width}}",
        f"loss {record['loss']:.3f}",
        f"{format_rate(record['tokens_per_s']):>6} tok/s",
        f"imb {record['imbalance']:.1f}x",
    ]
    if "max_rank_imbalance" in record:
        parts.append(f"rank-imb {record['max_rank_imbalance']:.2f}x "
                     f"(r{record['hot_rank']} L{record['hot_layer']})")
    if "peak_bytes" in record and "budget_bytes" in record:
        budget = record["budget_bytes"]
        peak = record.get("max_peak_bytes", record["peak_bytes"])  # the cluster's worst rank
        unit = byte_unit(max(budget or 0, peak or 0))
        budget_text = format_bytes(budget, unit=unit) if budget else "none"
        where = f" r{record['peak_rank']}" if "peak_rank" in record else ""
        parts.append(f"peak {format_bytes(peak, unit=unit)}{where} / {budget_text}")
    per_rank = record.get("rank_decisions")
    decisions = record.get("decisions")
    if isinstance(per_rank, list) and all(isinstance(d, dict) for d in per_rank):
        # One figure per rank, joined by '+': "save 12+4 rec 0+6 off 0+2".
        parts.append(" ".join(
            f"{label} " + "+".join(str(d.get(action, 0)) for d in per_rank)
            for label, action in (("save", "save"), ("rec", "recompute"), ("off", "offload"))))
    elif isinstance(decisions, dict):
        parts.append(f"save {decisions.get('save', 0)} rec {decisions.get('recompute', 0)} "
                     f"off {decisions.get('offload', 0)}")
    evicted = _evicted_text(record)
    if evicted:
        back = _evicted_text(record, "prefetched_bytes") or "0"
        parts.append(f"evict {evicted} back {back}")
    if record.get("val_loss") is not None:
        parts.append(f"val {record['val_loss']:.3f}")
    spike = record.get("spike")   # a pipeline's: where the step's spike was
    if isinstance(spike, dict):
        what = "rank" if spike["measure"] == "rank" else "expert"
        parts.append(f"spike {spike['ratio']:.2f}x {what} r{spike['rank']} s{spike['stage']} "
                     f"L{spike['layer']} mb{spike['micro_batch']}")
    return " | ".join(parts)


def evicted_per_rank(record: dict[str, Any],
                     field: str = "evicted_bytes") -> tuple[list[int], str]:
    """Bytes the guard evicted in the step (earlier layers' saved tensors moved to host),
    or with `field="prefetched_bytes"` brought back of them, per rank where the record has
    them (`rank_evicted_bytes`), else the record's own figure and, in a cluster record (one
    with `rank_decisions`), whose it is (' r0'): a log written before the cluster summaries
    gathered evictions has one rank's."""
    per_rank = record.get(f"rank_{field}")
    if isinstance(per_rank, list):
        return [int(b or 0) for b in per_rank], ""
    own = [int(record.get(field) or 0)]
    if isinstance(record.get("rank_decisions"), list):
        return own, f" r{record.get('rank', 0)}"
    return own, ""


def _evicted_text(record: dict[str, Any], field: str = "evicted_bytes") -> str:
    """'61.3 MiB', per rank '0+61.30 MiB' in one unit; '' when it is zero."""
    per_rank, whose = evicted_per_rank(record, field)
    if not any(per_rank):
        return ""
    if len(per_rank) == 1:
        return format_bytes(per_rank[0]) + whose
    unit = byte_unit(max(per_rank))
    return "+".join(format_bytes(b, unit=unit).split()[0] if b else "0"
                    for b in per_rank) + f" {unit}"


def _json_safe(value: Any) -> Any:
    """Non-finite floats become null: NaN / Infinity are not JSON, and a diverged loss
    must not make the whole log unreadable to strict parsers."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def check_log_path(path: str | Path, *, mode: str = "new") -> Path:
    """UsageError unless `path` can be this run's log (spikeguard.files' rules: an existing
    file needs mode "append" (--resume) or "overwrite"): lets the CLI fail before any work."""
    from spikeguard.files import check_output

    return check_output("--log", path, overwrite=mode == "overwrite", append=mode == "append")


def open_log(path: str | Path, mode: str = "new"):
    """Open a JSON-lines log (spikeguard.files.LineFile): "new" refuses an existing file,
    "append" (a resumed run) adds to it, "overwrite" replaces it when the run ends."""
    from spikeguard.files import LineFile

    p = check_log_path(path, mode=mode)
    return LineFile(p, mode=mode, what="--log")


def write_record(log_file, record: dict[str, Any]) -> None:
    """One JSON object per line, flushed so an interrupted run keeps its steps."""
    line = json.dumps(_json_safe(record), default=str)
    if hasattr(log_file, "write_line"):
        log_file.write_line(line)
    else:   # any text file the caller opened
        log_file.write(line + "\n")
        log_file.flush()


def memory_summary(records: list[dict[str, Any]]) -> str:
    """What the guard did over a run, in one line: worst peak against the budget, steps over
    it, safety-net re-runs, and the decisions on spike steps against calm ones (spike steps
    are the skew injector's, when one ran)."""
    guarded = [r for r in records if "budget_bytes" in r and not r.get("skipped")]
    if not guarded:
        return ""
    budget = guarded[0]["budget_bytes"]
    peaks = [r.get("max_peak_bytes", r.get("peak_bytes", 0)) or 0 for r in guarded]
    unit = byte_unit(max(max(peaks), budget or 0))
    over = sum(1 for p in peaks if budget and p > budget)
    text = (f"memory: peak {format_bytes(max(peaks), unit=unit)} / "
            f"{format_bytes(budget, unit=unit) if budget else 'none'} | {over} steps over | "
            f"{sum(r.get('safety_net_reruns', 0) for r in guarded)} safety-net re-runs")
    evicted = [evicted_per_rank(r) for r in guarded]
    if any(sum(b) for b, _ in evicted):
        whose = {w for _, w in evicted if w}
        back = sum(sum(evicted_per_rank(r, "prefetched_bytes")[0]) for r in guarded)
        text += (f" | evicted {format_bytes(sum(sum(b) for b, _ in evicted))}"
                 f"{''.join(sorted(whose))} on {sum(1 for b, _ in evicted if sum(b))} steps, "
                 f"{format_bytes(back)} back")
    if any("skew_spike" in r for r in guarded):
        for name, spike in (("spike", True), ("calm", False)):
            chosen = [r for r in guarded if r.get("skew_spike") is spike]
            totals = {a: 0 for a in ("save", "recompute", "offload")}
            for r in chosen:
                for d in r.get("rank_decisions") or [r.get("decisions") or {}]:
                    for a in totals:
                        totals[a] += (d or {}).get(a, 0)
            text += (f" | {len(chosen)} {name} steps: save {totals['save']} rec "
                     f"{totals['recompute']} off {totals['offload']}")
    return text
