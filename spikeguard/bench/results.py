"""From the bench's jobs to the figures: throughput, crashes, lost time, memory, decisions.

Definitions (also in docs/bench.md):
  tokens_per_s            tokens of the steps kept / the time of those steps (training only;
                          process start-up, evaluation and checkpoint writes excluded)
  relative_to_ceiling     tokens_per_s / the ceiling's tokens_per_s: a ratio of totals, so
                          the table's tok/s column divided by the ceiling's row gives it by
                          hand. Every policy trains the same steps in the same interleaved
                          segments, so each total spans the same minutes of the machine; a
                          median of per-segment ratios (used before) dropped the heavy
                          segments and disagreed with the tok/s beside it (0.692 next to
                          5,111 / 9,235 = 0.55). The per-segment ratios are kept
                          (segment_ratios) and shown as the spread, never as the ratio;
                          segment_spread: their median, quartiles, range and `n_for_0.01`,
                          the segments of this length a +-0.01 would need
                          (spikeguard.bench.spread).
  lost_seconds            measured: per crash, the time of the steps the restart re-does
                          (as they first ran) + the crashed job's wall time beyond its
                          completed steps (the partial step, the dying worker's teardown,
                          the replacement worker's start-up)
  effective_tokens_per_s  tokens kept / (training time + lost_seconds)
  effective_tokens_per_s_at_restart_cost
                          as above, with each crash's measured restart replaced by the
                          configured cold-restart cost (default 284 s, measured at scale)
  effective_relative_to_ceiling (_at_restart_cost)
                          effective_tokens_per_s (_at_restart_cost) / the ceiling's
                          tokens_per_s (the ceiling never crashes: its effective figure is
                          its tokens_per_s)
  peak_bytes              worst rank's peak over the run (the ceiling has no guard: its peak
                          is the measurement pass's, everything saved, no limit)
  overruns                steps whose worst-rank peak exceeded the budget
"""

from __future__ import annotations

from typing import Optional

from spikeguard.bench import spread
from spikeguard.bench.runner import PolicyRun
from spikeguard.train.log import evicted_per_rank

STATIC_CANDIDATES = ("none", "offload", "experts", "full")  # what safe-static picks from
ACTIONS = ("save", "recompute", "offload")


def _kept(records: list[dict]) -> list[dict]:
    return [r for r in records if not r.get("skipped") and "step_time_s" in r]


def _segment_rate(records: list[dict], first: int, last: int) -> Optional[float]:
    kept = [r for r in _kept(records) if first <= r["step"] <= last]
    seconds = sum(r["step_time_s"] for r in kept)
    return sum(r["tokens"] for r in kept) / seconds if seconds else None


def lost_seconds(run: PolicyRun) -> tuple[float, float, int]:
    """(measured lost seconds, seconds of re-done steps, crashes) of one policy."""
    lost = redone = 0.0
    crashes = 0
    for i, job in enumerate(run.jobs):
        if job.crashed_step is None:
            continue
        crashes += 1
        done = sum(r.get("step_time_s", 0.0) for r in job.records)
        restart_from = run.jobs[i + 1].first_step if i + 1 < len(run.jobs) else job.crashed_step
        redo = sum(r.get("step_time_s", 0.0) for r in job.records if r["step"] >= restart_from)
        redone += redo
        lost += redo + max(0.0, job.wall_s - done)
    return lost, redone, crashes


def policy_figures(run: PolicyRun, budget: int, segments: list[tuple[int, int]],
                   restart_cost_s: float, measured_peak: Optional[int] = None) -> dict:
    records = run.final_records()
    kept = _kept(records)
    tokens = sum(r["tokens"] for r in kept)
    seconds = sum(r["step_time_s"] for r in kept)
    lost, redone, crashes = lost_seconds(run)
    peaks = [r.get("max_peak_bytes", r.get("peak_bytes")) for r in kept]
    peaks = [p for p in peaks if p]   # an unguarded run logs no peak (or 0 under EP)
    decisions = {a: 0 for a in ACTIONS}
    for r in kept:
        for d in r.get("rank_decisions") or ([r["decisions"]] if r.get("decisions") else []):
            for a in ACTIONS:
                decisions[a] += (d or {}).get(a, 0)
    evicted = [evicted_per_rank(r) for r in kept]
    return {
        "tokens": tokens,
        "train_seconds": seconds,
        "tokens_per_s": tokens / seconds if seconds else 0.0,
        "segment_tokens_per_s": [_segment_rate(records, a, b) for a, b in segments],
        "peak_bytes": max(peaks) if peaks else measured_peak,
        "budget_bytes": budget if run.policy != "ceiling" else None,
        "overruns": sum(1 for p in peaks if p > budget) if run.policy != "ceiling" else 0,
        "oom_events": crashes,
        "restarts": crashes,
        "dropped_steps": sorted(run.dropped),
        "lost_seconds": lost,
        "redone_seconds": redone,
        "effective_tokens_per_s": tokens / (seconds + lost) if seconds + lost else 0.0,
        "effective_tokens_per_s_at_restart_cost":
            tokens / (seconds + redone + crashes * restart_cost_s) if seconds else 0.0,
        "restart_cost_s": restart_cost_s,
        "safety_net_reruns": sum(r.get("safety_net_reruns", 0) for r in kept),
        "decisions": decisions,
        # Earlier layers' saved tensors moved to host, over the kept steps: every rank's
        # where the log has them per rank, else the log's own rank's (named in "whose").
        "evicted_bytes": sum(sum(b) for b, _ in evicted),
        "evicted_steps": sum(1 for b, _ in evicted if sum(b)),
        "evicted_whose": "".join(sorted({w.strip() for _, w in evicted if w})),
        "prefetched_bytes": sum(sum(evicted_per_rank(r, "prefetched_bytes")[0]) for r in kept),
        "jobs": len(run.jobs),
        "job_wall_seconds": sum(j.wall_s for j in run.jobs),
    }


def segment_ratios(f: dict, ceiling: dict) -> list[float]:
    """Per segment, the policy's throughput over the ceiling's in the same segment."""
    return [a / b for a, b in zip(f["segment_tokens_per_s"], ceiling["segment_tokens_per_s"])
            if a and b]


def ratio(value: Optional[float], base: Optional[float]) -> Optional[float]:
    """The one ratio of the bench: a policy's figure over the ceiling's (None without one)."""
    return value / base if value is not None and base else None


def add_ratios(figures: dict[str, dict]) -> None:
    """relative_to_ceiling, the effective ratios and segment_ratios, in place; the table,
    the JSON, the plots and the docs page all read these fields and compute none."""
    ceiling = figures.get("ceiling")
    base = ceiling["tokens_per_s"] if ceiling is not None else None
    for f in figures.values():
        f["segment_ratios"] = segment_ratios(f, ceiling) if ceiling is not None else []
        # Their median, quartiles, range and the segments a +-0.01 would need.
        f["segment_spread"] = spread.of(f["segment_ratios"])
        f["relative_to_ceiling"] = ratio(f["tokens_per_s"], base)
        f["effective_relative_to_ceiling"] = ratio(f["effective_tokens_per_s"], base)
        f["effective_relative_at_restart_cost"] = ratio(
            f["effective_tokens_per_s_at_restart_cost"], base)


def pick_safe_static(figures: dict[str, dict]) -> Optional[str]:
    """The static setting with no crash and the highest throughput (the interleaved ratio
    to the ceiling when there is one): the one a careful team would have tuned to survive
    this trace's worst spike."""
    survivors = [p for p in STATIC_CANDIDATES if p in figures and figures[p]["oom_events"] == 0]

    def speed(p: str) -> float:
        rel = figures[p].get("relative_to_ceiling")
        return rel if rel is not None else figures[p]["tokens_per_s"]
    return max(survivors, key=speed, default=None)
