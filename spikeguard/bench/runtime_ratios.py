"""Throughput of the ceiling, full recompute, adaptive and PyTorch's own checkpoint and
save_on_cpu under 0.85x the ceiling's peak.

    .venv/bin/python -m spikeguard.bench.runtime_ratios --preset small --reps 7

One process, the same data for every policy, runs interleaved (ceiling, full, adaptive,
checkpoint, save_on_cpu, ceiling, ...) so machine noise hits all alike; each ratio is per round (the ceiling's
seconds over the policy's in the same round), quoted as the median with its quartiles and
the rounds a +-0.01 would need (spikeguard.bench.spread); decisions and `evicted`
(earlier layers' saved tensors moved to host) are the last step's. The ceiling is the plain
model with no guard and no limit; `checkpoint` and `save_on_cpu` are what a user would
pick instead (spikeguard.bench.native_rows), unguarded at the same budget. On a CPU-only machine the device is emulated by the
CPU allocator (every live storage): the ratios are CPU figures.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch

import spikeguard
from spikeguard.data.corpus import load_corpus
from spikeguard.errors import UsageError
from spikeguard.memory.budget import format_bytes
from spikeguard.model import build_model, model_config
from spikeguard.bench.native_rows import NATIVE, native_runs, ran_out
from spikeguard.bench.spread import needed, ratio_spread

POLICIES = ("ceiling", "full", "adaptive")
ACTIONS = ("save", "recompute", "offload")


def plain_step(model, batches) -> float:
    """Forward and backward of every micro-batch; seconds (the step every policy of this
    bench and spikeguard/bench/oracle_bench.py runs)."""
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    for idx_BT, targets_BT in batches:
        model(idx_BT, targets_BT).loss.backward()
    return time.perf_counter() - start


def _guarded_step(model, guard, batches) -> float:
    return guard.run_step(lambda: plain_step(model, batches))


def measure(preset: str, batch_size: int, micro_batches: int, reps: int, fraction: float,
            seed: int = 0) -> dict:
    """Run the comparison; returns per-policy medians and the ratios."""
    cfg = model_config(preset)
    corpus = load_corpus(None)
    gen = torch.Generator().manual_seed(seed)
    batches = [corpus.get_batch("train", batch_size, cfg.seq_len, gen) for _ in range(micro_batches)]
    models = {p: build_model(cfg, seed=seed) for p in POLICIES + NATIVE}

    probe = spikeguard.attach(build_model(cfg, seed=seed), budget=1 << 50, policy="none")
    _guarded_step(probe.model, probe, batches)
    ceiling_peak = probe.history[-1]["peak_bytes"]
    budget = int(fraction * ceiling_peak)
    guards = {p: spikeguard.attach(models[p], budget=budget, policy=p) for p in ("full", "adaptive")}

    tokens = batch_size * micro_batches * cfg.seq_len
    # PyTorch's own checkpoint and save_on_cpu, unguarded, at the same budget (native_rows)
    with native_runs({p: models[p] for p in NATIVE}, budget) as natives:
        runs = {**guards, **natives}
        times = time_interleaved({**models, **{p: natives[p].model for p in NATIVE}}, runs,
                                 batches, reps, POLICIES + NATIVE)
        result = summarize_ratios(times, runs, tokens, ceiling_peak, budget, preset)
    for p in NATIVE:
        result["policies"][p]["native"] = True
    return result


def time_interleaved(models: dict, guards: dict, batches, reps: int, policies,
                     step=None) -> dict:
    """Seconds per step of each policy, the policies taking turns every step so that
    machine noise hits all alike; the first round warms up and is dropped. A policy
    without a guard (the ceiling) runs plainly (its allocations still pass through the
    emulated device's allocator, uncounted: the counter's cost is paid alike). `step(model, batches) -> seconds` runs
    one step's forwards and backwards (default: the built-in model's)."""
    step = step or plain_step
    times = {p: [] for p in policies}
    for rep in range(reps + 1):
        for p in policies:
            if p in guards:   # run_step: its safety net reaches backward
                seconds = guards[p].run_step(lambda: step(models[p], batches))
            else:
                seconds = step(models[p], batches)
            if rep:
                times[p].append(seconds)
    return times


def memory_row(guard, unguarded_peak: int) -> dict:
    """A policy's memory and decisions over its timed steps (its guard's history, the
    first step dropped; `unguarded_peak` for the ceiling, which has no guard)."""
    hist = guard.history[1:] if guard is not None else []
    return {
        "peak_bytes": max((h["peak_bytes"] for h in hist), default=unguarded_peak),
        "overruns": sum(h["peak_bytes"] > h["budget_bytes"] for h in hist),
        "safety_net_reruns": sum(h["safety_net_reruns"] for h in hist),
        "decisions": hist[-1]["decisions"] if hist else {},
        # The last step's, as its decisions: what adaptive keeps by moving earlier
        # layers' saved tensors to host, which the decision counts do not show.
        "evicted_bytes": hist[-1].get("evicted_bytes", 0) if hist else None,
        "prefetched_bytes": hist[-1].get("prefetched_bytes", 0) if hist else None,
    }


def summarize_ratios(times: dict, guards: dict, tokens: int, ceiling_peak: int, budget: int,
                     preset: str) -> dict:
    """Medians, memory and decisions per policy, and the ratios to the ceiling: per round,
    the ceiling's seconds over the policy's in the same round (spikeguard.bench.spread:
    median, quartiles, range, rounds for +-0.01); the summary ratios are those medians."""
    result = {"preset": preset, "tokens_per_step": tokens, "ceiling_peak_bytes": ceiling_peak,
              "budget_bytes": budget, "reps": len(times["ceiling"]), "policies": {}}
    for p in times:
        med = statistics.median(times[p])
        result["policies"][p] = {
            "median_s": med, "tokens_per_s": tokens / med,
            "vs_ceiling": ratio_spread(times[p], times["ceiling"]),
            **memory_row(guards.get(p), ceiling_peak)}
    ratio = {p: result["policies"][p]["vs_ceiling"]["median"] for p in times}
    result["adaptive_over_ceiling"] = ratio["adaptive"]
    result["full_over_ceiling"] = ratio["full"]
    gap = 1 - ratio["full"]
    result["gap_closed"] = (ratio["adaptive"] - ratio["full"]) / gap if gap > 0 else float("nan")
    return result


def print_table(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{result['preset']}: budget {format_bytes(result['budget_bytes'])} "
                        f"= {result['budget_bytes'] / result['ceiling_peak_bytes']:.2f}x ceiling peak "
                        f"(CPU; emulated device: every live storage)")
    for col in ("policy", "tokens/s", "vs ceiling", "quartiles", "rounds for +-0.01", "peak",
                "overruns", "reruns", "save / recompute / offload", "evicted"):
        table.add_column(col)
    for name, row in result["policies"].items():
        vs = row["vs_ceiling"]
        table.add_row(name, f"{row['tokens_per_s']:.0f}",
                      "ran out" if ran_out(row) else f"{vs['median']:.3f}",
                      f"{vs['q1']:.2f}-{vs['q3']:.2f}", "-" if name == "ceiling" else needed(vs),
                      format_bytes(row["peak_bytes"]), str(row["overruns"]),
                      str(row["safety_net_reruns"]), *decision_cells(row))
    console = Console(width=160)
    console.print(table)
    console.print(f"adaptive/ceiling {result['adaptive_over_ceiling']:.3f} | "
                  f"full/ceiling {result['full_over_ceiling']:.3f} | "
                  f"gap closed {result['gap_closed']:.0%}")
    console.print(f"vs ceiling: per-round ratios, the median and quartiles of {result['reps']} "
                  f"interleaved rounds; peak: the device's whole count (parameters, gradients, "
                  f"activations; this bench has no optimizer step), the ceiling's from a probe "
                  f"step with everything kept; checkpoint and save_on_cpu: PyTorch's own, "
                  f"unguarded (spikeguard.bench.native_rows), 'ran out' where a step passed "
                  f"the budget")


def decision_cells(row: dict) -> tuple[str, str]:
    """A policy row's last-step decisions ('40 / 0 / 0') and evictions ('61.3 MiB (61.3 MiB
    back)', '0', '-'), as this table prints them: the one formatting scripts/page_blocks.py
    renders the README's table with, so the page and the command cannot disagree."""
    return (_decisions(row["decisions"]),
            _evicted(row.get("evicted_bytes"), row.get("prefetched_bytes")))


def moved_of(history: list[dict]) -> dict:
    """Per-operator decisions and evictions summed over a guard's steps (`history`), in the
    fields decision_cells reads: for the benches that show a run's sum, not its last step."""
    return {"decisions": {a: sum((h.get("decisions") or {}).get(a, 0) for h in history)
                          for a in ACTIONS},
            "evicted_bytes": sum(h.get("evicted_bytes", 0) for h in history),
            "prefetched_bytes": sum(h.get("prefetched_bytes", 0) for h in history)}


def _evicted(num_bytes, back_bytes=None) -> str:
    """'61.3 MiB (61.3 MiB back)': evicted, and brought back for backward; '0'; '-'."""
    if num_bytes is None:
        return "-"
    if not num_bytes:
        return "0"
    back = f" ({format_bytes(back_bytes)} back)" if back_bytes is not None else ""
    return format_bytes(num_bytes) + back


def _decisions(counts: dict) -> str:
    if not counts:
        return "-"
    return " / ".join(str(counts.get(a, 0)) for a in ACTIONS)


def workload_parser(description: str):
    """The arguments of both one-process benches (this one and oracle_bench): the model,
    its micro-batches, the rounds, the threads and the JSON output."""
    from spikeguard.errors import ArgumentParser

    parser = ArgumentParser(description=description)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--micro-batches", type=int, default=2)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (1: steadier on a shared machine)")
    parser.add_argument("--json", default=None, metavar="FILE",
                        help="also write the figures as JSON (scripts/pages.py renders the "
                             "docs' tables from it); an existing file needs --overwrite")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --json")
    return parser


def check_workload(args) -> None:
    """workload_parser's arguments, checked before anything runs (one line each)."""
    from spikeguard.model.config import activation_bytes_floor, check_trainable_size
    from spikeguard.train.config import MAX_THREADS

    for name in ("batch_size", "micro_batches", "reps"):
        if getattr(args, name) <= 0:
            raise UsageError(f"--{name.replace('_', '-')} must be positive")
    if not 0 < args.threads <= MAX_THREADS:
        raise UsageError(f"--threads must be in [1, {MAX_THREADS}], got {args.threads}")
    cfg = model_config(args.preset)   # an unknown preset: one line
    check_trainable_size(cfg.num_params, activation_bytes_floor(   # train's own check
        args.batch_size * cfg.seq_len, cfg.vocab_size, cfg.d_model, cfg.num_layers),
        f"model {args.preset}")
    if args.json:
        from spikeguard.files import check_output
        check_output("--json", args.json, overwrite=args.overwrite)


def main(argv=None) -> int:
    parser = workload_parser(__doc__.splitlines()[0])
    parser.add_argument("--fraction", type=float, default=0.85)
    try:
        args = parser.parse_args(argv)   # a mistake is one line (UsageError), no abbreviation
        if not 0 < args.fraction <= 1:
            raise UsageError(f"--fraction must be in (0, 1], got {args.fraction}")
        check_workload(args)
        torch.set_num_threads(args.threads)
        torch.manual_seed(0)
        result = measure(args.preset, args.batch_size, args.micro_batches, args.reps,
                         args.fraction)
        print_table(result)
        if args.json:
            from spikeguard.files import atomic_write
            atomic_write(args.json, json.dumps({**result, "reps": args.reps}, indent=1) + "\n",
                         overwrite=args.overwrite, what="--json")
    except UsageError as err:
        print(f"spikeguard: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
