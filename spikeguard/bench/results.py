"""From the bench's jobs to the figures: throughput, crashes, lost time, memory, decisions.

Definitions (also in docs/bench.md):
  tokens_per_s            tokens of the steps kept / the time of those steps (training only;
                          process start-up, evaluation and checkpoint writes excluded)
  relative_to_ceiling     median over segments of this policy's segment throughput / the
                          ceiling's in the same segment (segments are interleaved, so the
                          ratio compares runs from the same minutes of the machine); the
                          table shows the lowest and highest segment's beside it
  lost_seconds            measured: per crash, the time of the steps the restart re-does
                          (as they first ran) + the crashed job's wall time beyond its
                          completed steps (start-up, the partial step, teardown)
  effective_tokens_per_s  tokens kept / (training time + lost_seconds)
  effective_tokens_per_s_at_restart_cost
                          as above, with each crash's measured restart replaced by the
                          configured cold-restart cost (default 284 s, measured at scale)
  effective_relative_to_ceiling (_at_restart_cost)
                          relative_to_ceiling x training time / (training time + lost time):
                          the robust ratio, discounted by the share of time the crashes took
  peak_bytes              worst rank's peak over the run (the ceiling has no guard: its peak
                          is the measurement pass's, everything saved, no limit)
  overruns                steps whose worst-rank peak exceeded the budget
"""

from __future__ import annotations

import statistics
from typing import Optional

from spikeguard.bench.runner import PolicyRun

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
        "jobs": len(run.jobs),
        "job_wall_seconds": sum(j.wall_s for j in run.jobs),
    }


def segment_ratios(f: dict, ceiling: dict) -> list[float]:
    """Per segment, the policy's throughput over the ceiling's in the same segment."""
    return [a / b for a, b in zip(f["segment_tokens_per_s"], ceiling["segment_tokens_per_s"])
            if a and b]


def add_ratios(figures: dict[str, dict]) -> None:
    """relative_to_ceiling (median of per-segment ratios) and effective ratios, in place."""
    ceiling = figures.get("ceiling")
    for name, f in figures.items():
        if ceiling is None:
            f["relative_to_ceiling"] = None
            continue
        ratios = segment_ratios(f, ceiling)
        rel = statistics.median(ratios) if ratios else None
        f["relative_to_ceiling"] = rel
        seconds = f["train_seconds"]
        crashes_at_cost = f["redone_seconds"] + f["oom_events"] * f["restart_cost_s"]
        f["effective_relative_to_ceiling"] = (
            rel * seconds / (seconds + f["lost_seconds"]) if rel is not None and seconds else None)
        f["effective_relative_at_restart_cost"] = (
            rel * seconds / (seconds + crashes_at_cost) if rel is not None and seconds else None)


def pick_safe_static(figures: dict[str, dict]) -> Optional[str]:
    """The static setting with no crash and the highest throughput (the interleaved ratio
    to the ceiling when there is one): the one a careful team would have tuned to survive
    this trace's worst spike."""
    survivors = [p for p in STATIC_CANDIDATES if p in figures and figures[p]["oom_events"] == 0]

    def speed(p: str) -> float:
        rel = figures[p].get("relative_to_ceiling")
        return rel if rel is not None else figures[p]["tokens_per_s"]
    return max(survivors, key=speed, default=None)
