"""`spikeguard bench`: every memory policy on the same routing spikes, side by side.

    .venv/bin/spikeguard bench --json bench.json --plots docs/img/bench --docs docs/bench.md

1. A measurement pass trains with the skew injector (or replays --trace), everything
   saved and no limit, and records the routing trace: from now on every policy sees
   exactly these loads.
2. The budget (unless given): what the calm steps of that pass peaked at, plus 10% of
   their activations, so that the spikes do not fit with everything saved.
3. Policies ceiling (no guard, no limit), none, offload, experts, full and adaptive train
   under that budget, interleaved by segments (spikeguard.bench.runner); `none` dies on
   the spikes and is restarted from its checkpoints.
4. Figures (spikeguard.bench.results), `safe-static` (the fastest static setting that
   survived), a table, a JSON file, plots and a docs page.
On a machine without a GPU the device is emulated by the CPU allocator (every live storage counted, as a device allocator would): every figure
is a CPU figure, and the page says so.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shutil
import tempfile
from pathlib import Path
from typing import Any

from spikeguard.bench.bench_config import NO_LIMIT, POLICIES, BenchConfig
from spikeguard.errors import UsageError
from spikeguard.names import PATTERNS, SCHEDULES


def add_parser(commands) -> None:
    bench = commands.add_parser("bench", help="every policy on the same routing spikes, "
                                              "side by side (crashes and restarts included)")
    work = bench.add_argument_group("workload")
    work.add_argument("--preset", default="small",
                      help="model preset (default small; tiny's 1-2 ms steps are too short "
                           "to time: for a short run keep small and lower --steps and "
                           "--batch-size)")
    work.add_argument("--ep", type=int, default=2, help="expert-parallel size (default 2)")
    work.add_argument("--pp", type=int, default=1,
                      help="pipeline stages (default 1: none); processes = pp x ep x dp")
    work.add_argument("--dp", type=int, default=1, help="data-parallel replicas (default 1)")
    work.add_argument("--schedule", default="1f1b", choices=SCHEDULES,
                      help="pipeline schedule (default 1f1b)")
    work.add_argument("--num-layers", type=int, default=None, help="override the preset's")
    work.add_argument("--num-experts", type=int, default=None, help="override the preset's")
    work.add_argument("--steps", type=int, default=200)
    work.add_argument("--batch-size", type=int, default=8)
    work.add_argument("--micro-batches", type=int, default=None,
                      help="per optimizer step (default 1; with --pp, --pp)")
    work.add_argument("--seed", type=int, default=0)
    work.add_argument("--pattern", default="production", choices=PATTERNS,
                      help="routing skew (default production: 2.9%% spike steps)")
    work.add_argument("--spike-prob", type=float, default=None)
    work.add_argument("--spike-max", type=float, default=None,
                      help="largest spike, max/mean tokens per rank (default min(2.6, ep))")
    work.add_argument("--skew-seed", type=int, default=0)
    work.add_argument("--spike-from-layer", type=int, default=0, metavar="L",
                      help="spikes start at layer L (the layers before route calmly on a "
                           "spike step; default 0, every layer)")
    work.add_argument("--trace", default=None, metavar="FILE",
                      help="replay this recorded trace instead of recording one")
    run = bench.add_argument_group("comparison")
    run.add_argument("--policies", default=",".join(POLICIES),
                     help=f"comma-separated, from {', '.join(POLICIES)} (default all)")
    run.add_argument("--budget", default="auto",
                     help="device budget per rank (default auto: calm-step peak + 10%% of "
                          "its activations)")
    run.add_argument("--segments", type=int, default=8,
                     help="interleaving: policies take turns every steps/segments steps")
    run.add_argument("--checkpoint-every", type=int, default=25)
    run.add_argument("--restart-cost", type=float, default=284.0, metavar="SECONDS",
                     help="cold-restart cost per crash for the at-scale figure (default 284)")
    out = bench.add_argument_group("outputs")
    out.add_argument("--work", default=None, metavar="DIR",
                     help="folder for traces, logs and checkpoints (default: a new temp dir)")
    out.add_argument("--json", default=None, metavar="FILE")
    out.add_argument("--plots", default=None, metavar="DIR")
    out.add_argument("--docs", default=None, metavar="FILE.md",
                     help="write the benchmark page (command, machine, table, plots)")
    out.add_argument("--overwrite", action="store_true",
                     help="replace existing --json, --docs and --plots files (refused "
                          "without it)")
    bench.set_defaults(run=run_bench)


def _workload(cfg: BenchConfig) -> list[str]:
    """The `train` arguments every job of the bench shares (model, layout, data)."""
    model = [a for k, v in cfg.overrides.items() for a in ("--" + k.replace("_", "-"), str(v))]
    L = cfg.layout
    layout = ["--nproc", str(L.nproc), "--ep", str(L.ep)]
    if L.pp > 1:
        layout += ["--pp", str(L.pp), "--schedule", cfg.schedule]
    train = cfg.run.train
    return ["--preset", cfg.preset, *model, *layout, "--batch-size", str(train.batch_size),
            "--micro-batches", str(train.micro_batches), "--seed", str(train.seed),
            "--threads", "1", "--eval-every", str(cfg.steps), "--eval-batches", "1"]


def _common(cfg: BenchConfig, trace: Path) -> list[str]:
    return _workload(cfg) + ["--trace", str(trace),
                             "--checkpoint-every", str(cfg.checkpoint_every)]


def _measure(cfg: BenchConfig, work: Path, echo, pool) -> tuple[Path, list[dict]]:
    """The measurement pass: records (or replays) the trace with everything saved."""
    from spikeguard.bench.runner import JobRunner

    base = _workload(cfg) + ["--policy", "none", "--budget", NO_LIMIT]
    if cfg.trace is not None:
        trace = Path(cfg.trace)
        extra = ["--trace", str(trace)]
    else:
        trace = work / "trace.jsonl"
        skew = cfg.skew
        extra = ["--skew", skew.pattern, "--skew-seed", str(skew.seed),
                 "--record-trace", str(trace)]
        if skew.spike_prob is not None:
            extra += ["--spike-prob", str(skew.spike_prob)]
        extra += ["--spike-max", str(skew.spike_max if skew.spike_max is not None
                                     else min(2.6, float(cfg.layout.ep)))]
        if skew.spike_from_layer:
            extra += ["--spike-from-layer", str(skew.spike_from_layer)]
    job = JobRunner(base, work, cfg.layout.nproc, echo, pool).run("measure", extra, 1,
                                                                  cfg.steps, "measure")
    if job.crashed_step is not None:
        raise UsageError("the measurement pass ran out of a 1 TiB budget")
    return trace, _mark_spikes(job.records, trace)


def _mark_spikes(records: list[dict], trace: Path) -> list[dict]:
    """Every step's `skew_spike` from the trace's own loads (a pipeline's step record has
    no injector target), where the measurement pass's record did not say."""
    if all("skew_spike" in r for r in records):
        return records
    from spikeguard.routing.trace import load_trace

    loaded = load_trace(trace)
    return [r if "skew_spike" in r else {**r, "skew_spike": loaded.rank_ratio(r["step"])[1]}
            for r in records]


def _budget_from(records: list[dict]) -> tuple[int, int, int]:
    """(budget, calm peak, static) from the measurement pass."""
    from spikeguard.train.auto_budget import auto_budget

    calm = [r for r in records if not r.get("skew_spike")]
    if not calm:
        raise UsageError("the trace has no calm step to size the budget from; give --budget")
    peak = max(r["max_peak_bytes"] for r in calm)
    static = max(r["static_bytes"] for r in calm)
    return auto_budget(peak, static), peak, static


def _layout_text(cfg: BenchConfig) -> str:
    L = cfg.layout
    parts = [f"PP={L.pp}"] if L.pp > 1 else []
    parts += [f"DP={L.dp}"] if L.dp > 1 else []
    return " x ".join(parts + [f"EP={L.ep}"]) + f" ({L.nproc} processes)"


def _segments(steps: int, count: int) -> list[tuple[int, int]]:
    edges = [round(i * steps / count) for i in range(count + 1)]
    return [(edges[i] + 1, edges[i + 1]) for i in range(count)]


def run_bench(args: argparse.Namespace) -> int:
    from rich.console import Console

    from spikeguard.bench.worker import WorkerPool
    from spikeguard.extras import require

    # numpy: the replayed trace every policy sees; matplotlib: --plots. Said before any job.
    require("numpy", "bench", "spikeguard bench")
    if args.plots:
        require("matplotlib", "bench", "spikeguard bench --plots")
    cfg = BenchConfig.from_args(args)
    console = Console()
    if not console.is_terminal:
        console = Console(width=200)  # a log file gets the table unwrapped

    def echo(text: str) -> None:
        console.print(text, markup=False, highlight=False, soft_wrap=True)

    temporary = cfg.work is None
    work = Path(tempfile.mkdtemp(prefix="spikeguard-bench-")) if temporary else Path(cfg.work)
    work.mkdir(parents=True, exist_ok=True)
    pool = WorkerPool(work / "workers", cfg.layout.nproc)
    try:
        _bench(cfg, work, pool, echo, console)
    except UsageError as exc:
        # A job failed: its logs are what the user needs, so the folder is kept and named.
        raise UsageError(f"{exc} (the bench's logs are in {work})") from None
    except BaseException:
        if temporary:    # interrupted or worse: nothing of use left behind, unnamed
            pool.close()
            shutil.rmtree(work, ignore_errors=True)
        raise
    finally:
        pool.close()
    return 0


def _bench(cfg: BenchConfig, work: Path, pool, echo, console) -> None:
    from spikeguard.bench import outputs, results
    from spikeguard.bench.runner import JobRunner, PolicyRun, run_policy_segment
    from spikeguard.memory.budget import format_bytes

    echo(f"bench: {cfg.preset}, {_layout_text(cfg)}, {cfg.steps} steps, work in {work}")
    load_start = _load()
    echo("measurement pass (everything saved, no limit; records the routing trace):")
    trace, measured = _measure(cfg, work, echo, pool)
    spikes = [r["step"] for r in measured if r.get("skew_spike")]
    policies = list(cfg.policies)
    if cfg.budget is None:
        budget, calm_peak, static = _budget_from(measured)
        how = (f"auto: the calm steps' peak with everything saved, {format_bytes(calm_peak)} "
               f"(of which {format_bytes(static)} parameters, gradients and optimizer state), "
               f"plus 10% of its activations")
    else:
        budget, how = cfg.budget, "given"
    echo(f"budget {format_bytes(budget)} per rank ({how}); spike steps in the trace: {spikes}")
    segments = _segments(cfg.steps, cfg.segments)
    runner = JobRunner(_common(cfg, trace), work, cfg.layout.nproc, echo, pool)
    runs = {p: PolicyRun(p) for p in policies}
    for i, (first, last) in enumerate(segments):
        echo(f"segment {i + 1}/{len(segments)}: steps {first}-{last}")
        order = policies[i % len(policies):] + policies[:i % len(policies)]
        for policy in order:
            policy_args = [] if policy == "ceiling" else ["--policy", policy, "--budget", str(budget)]
            run_policy_segment(runner, runs[policy], policy_args, work / "ckpt" / policy,
                               first, last)
    pool.close()
    measured_peak = max(r["max_peak_bytes"] for r in measured)
    figures = {p: results.policy_figures(runs[p], budget, segments, cfg.restart_cost,
                                         measured_peak if p == "ceiling" else None)
               for p in policies}
    results.add_ratios(figures)
    safe = results.pick_safe_static(figures)
    if safe is not None:
        figures["safe-static"] = {**figures[safe], "is": safe}
    report = _report(cfg, figures, budget, how, spikes, trace, work, load_start)
    report["jobs"] = sum(len(r.jobs) for r in runs.values()) + 1   # + the measurement pass
    report["worker_startups_s"] = pool.startups
    outputs.print_table(console, report)
    echo(f"jobs: {report['jobs']} on {len(pool.startups)} worker start-up(s) of "
         f"{sum(pool.startups):.1f} s in all")
    if cfg.json:
        outputs.write_json(cfg.json, report, cfg.overwrite)
        echo(f"wrote {cfg.json}")
    plot_files = [] if not cfg.plots else outputs.write_plots(
        cfg.plots, outputs.plot_runs(runs, measured), report, cfg.overwrite, echo)
    if cfg.docs:
        outputs.write_docs(cfg.docs, report, plot_files, cfg.overwrite)
        echo(f"wrote {cfg.docs}")


def _load():
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def _report(cfg: BenchConfig, figures, budget, how, spikes, trace, work,
            load_start) -> dict[str, Any]:
    import torch

    L, train = cfg.layout, cfg.run.train
    return {
        "command": "spikeguard " + " ".join(cfg.argv),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "torch": torch.__version__,
                    # other work on the machine, 1-minute load average: at the start, the end
                    "load_average": [load_start, _load()],
                    "device": "CPU only: the device is emulated by the CPU allocator (every live storage)"},
        "workload": {"preset": cfg.preset, "ep": L.ep, "pp": L.pp, "dp": L.dp,
                     "nproc": L.nproc, "schedule": cfg.schedule if L.pp > 1 else None,
                     "num_layers": cfg.overrides.get("num_layers"),
                     "num_experts": cfg.overrides.get("num_experts"),
                     "steps": cfg.steps,
                     "batch_size": train.batch_size, "micro_batches": train.micro_batches,
                     "pattern": None if cfg.trace else cfg.skew.pattern,
                     "spike_from_layer": None if cfg.trace else cfg.skew.spike_from_layer,
                     "trace": str(trace), "spike_steps": spikes,
                     "segments": cfg.segments, "checkpoint_every": cfg.checkpoint_every,
                     "restart_cost_s": cfg.restart_cost},
        "budget_bytes": budget,
        "budget_rule": how,
        "policies": figures,
        "order": list(cfg.policies) + (["safe-static"] if "safe-static" in figures else []),
        "work": str(work),
    }
