"""The guard's own cost on calm steps under a pipeline: PP=2 x EP=2, plain vs none vs adaptive.

    .venv/bin/torchrun --nproc-per-node 4 scripts/calm_overhead_pp.py --reps 10 --clock cpu

scripts/calm_overhead.py's measurement in the fourth layout: the built-in `small` model
(`--layers`, default 4: two per stage), cut into 2 stages of torch.distributed.pipelining's
1F1B schedule (spikeguard.parallel.PipelineRank, the trainer's own), each stage's experts
split over 2 ranks; `--micro-batches` micro-batches of `--batch-size` sequences a step on
each (dp = 1). Three pipelines of the same model take turns every step in the same
processes (`plain`: no guard; `none`; `adaptive`), gradients dropped before each as after
an optimizer step, so every step is calm and the machine's noise hits all alike; the first
round warms up and is dropped. Budget per rank: its calm step's true peak (a probe
pipeline under policy none) times `--budget-factor`. Prints, per rank, the median of the
per-round ratios plain/this with a 95% interval of that median (spikeguard/bench/spread.py),
their range and the rounds that would resolve +-0.01, the forwards that ran calm a step
(runtime/calm_forward.py: under none every forward of shapes seen before; under adaptive
those whose start proof also walks the forwards the stage runs before their backward,
each calm forward's bytes modelled in the ledger for the residency), and the layers
adaptive ran hookless a step (runtime/hookless.py: under a pipeline, proven against the
forwards its stage runs before each micro-batch's backward too). `--clock cpu` times each
process's CPU only: steadier on a shared machine, blind to the waits of the schedule's
sends and the all-to-alls.
CPU figures: the device is emulated.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

import spikeguard
from spikeguard.bench.spread import interval, needed, ratio_spread
from spikeguard.data.corpus import load_corpus
from spikeguard.model import build_model, model_config
from spikeguard.parallel.launch_utils import run_under_torchrun
from spikeguard.parallel.mesh import MeshGroups, ParallelLayout
from spikeguard.parallel.pipeline_training import PipelineRank

POLICIES = ("plain", "none", "adaptive")
WORLD = 4


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--budget-factor", type=float, default=1.1,
                        help="budget = this x the rank's calm true peak")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    args = parser.parse_args()
    for name in ("reps", "layers", "micro_batches", "batch_size"):
        if getattr(args, name) < 1:
            parser.exit(2, f"calm_overhead_pp.py: --{name.replace('_', '-')} must be "
                           f"positive, got {getattr(args, name)}\n")
    if args.layers % 2:
        parser.exit(2, f"calm_overhead_pp.py: --layers must be even (2 stages), "
                       f"got {args.layers}\n")
    if not args.budget_factor > 0:
        parser.exit(2, "calm_overhead_pp.py: --budget-factor must be positive\n")
    if int(os.environ.get("WORLD_SIZE", "1")) != WORLD:
        parser.exit(2, "calm_overhead_pp.py: run it under torchrun --nproc-per-node 4 "
                       "(PP=2 x EP=2)\n")
    return args


def _pipeline(cfg, groups, args, policy: str, budget: int) -> PipelineRank:
    prank = PipelineRank(build_model(cfg, seed=0), groups, micro_batches=args.micro_batches,
                         batch_size=args.batch_size)
    if policy != "plain":
        prank.attach_guards(lambda m: spikeguard.attach(m, budget=budget, policy=policy))
    return prank


def _step(prank: PipelineRank, tokens, clock) -> float:
    prank.modules.zero_grad(set_to_none=True)
    dist.barrier()
    start = clock()
    prank.step(tokens[:, :-1], tokens[:, 1:])
    return clock() - start


def main() -> None:
    args = _arguments()
    torch.set_num_threads(1)
    run_under_torchrun(lambda group: _measure(args))   # no pipeline outlives _measure


def _measure(args) -> None:
    rank = dist.get_rank()
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    cfg = model_config("small", num_layers=args.layers)
    groups = MeshGroups.build(ParallelLayout(WORLD, pp=2, ep=2))
    gen = torch.Generator().manual_seed(100 + groups.data_shard)
    seqs = args.micro_batches * args.batch_size
    tokens = load_corpus(None).get_batch("train", seqs, cfg.seq_len, gen)
    tokens = torch.cat([tokens[0], tokens[1][:, -1:]], dim=1)   # windows of seq_len + 1

    probe = _pipeline(cfg, groups, args, "none", 1 << 50)
    _step(probe, tokens, clock)
    budget = int(max(g.history[-1]["peak_bytes"] for g in probe.guards) * args.budget_factor)
    probe.close()
    pranks = {p: _pipeline(cfg, groups, args, p, budget) for p in POLICIES}
    times = {p: [] for p in POLICIES}
    for rep in range(args.reps + 1):
        for p in POLICIES:
            seconds = _step(pranks[p], tokens, clock)
            if rep:
                times[p].append(seconds)
    history = pranks["adaptive"].guards[0].history[1:]
    calm = {p: statistics.mean(r["calm_forwards"] for r in pranks[p].guards[0].history[1:])
            for p in ("none", "adaptive")}
    mine = {"rank": rank, "stage": pranks["plain"].stage_ids[0], "budget": budget,
            "times": times, "calm": calm,
            "hookless": statistics.mean(r["hookless_layers"] for r in history),
            "cut": [statistics.mean(r["decisions"][k] for r in history)
                    for k in ("recompute", "offload")]
            + [statistics.mean(r["evicted_bytes"] for r in history) / 2**20]}
    everyone = [None] * WORLD
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        _report(everyone, args, cfg)
    for prank in pranks.values():
        prank.close()


def _report(ranks: list, args, cfg) -> None:
    print(f"calm step of small ({args.layers} layers), PP=2 x EP=2, {args.micro_batches} "
          f"micro-batches of {args.batch_size} x {cfg.seq_len} tokens per stage, "
          f"{args.reps} rounds, {args.clock} clock, budget {args.budget_factor}x each "
          f"rank's calm true peak; CPU, emulated device")
    print("| rank (stage) | plain ms | none: plain/this [95%] (range, rounds for +-0.01) "
          "| adaptive: plain/this [95%] (range, rounds for +-0.01) "
          "| calm forwards / step, none / adaptive "
          "| adaptive hookless layers / step | adaptive recompute / offload ops, "
          "evicted MiB / step |")
    print("|---|---|---|---|---|---|---|")
    for r in ranks:
        t = r["times"]
        cells = []
        for p in ("none", "adaptive"):
            s = ratio_spread(t[p], t["plain"])
            cells.append(f"{s['median']:.3f} [95% {interval(s)}] ({s['min']:.3f}-{s['max']:.3f}, "
                         f"{needed(s)})")
        print(f"| {r['rank']} ({r['stage']}) | {statistics.median(t['plain']) * 1e3:.1f} | "
              f"{cells[0]} | {cells[1]} | {r['calm']['none']:.1f} / {r['calm']['adaptive']:.1f} "
              f"| {r['hookless']:.1f} | "
              f"{r['cut'][0]:.1f} / {r['cut'][1]:.1f}, {r['cut'][2]:.2f} |")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
