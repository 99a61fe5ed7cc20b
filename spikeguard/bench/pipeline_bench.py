"""Pipeline x expert parallel benchmark: adaptive vs the ceiling vs full recompute, side by side.

    .venv/bin/python -m spikeguard.bench.pipeline_bench --nproc 4 --pp 2 --ep 2 --reps 9

Spawns `nproc` gloo ranks on this machine (CPU, emulated device). Every rank builds three
copies of the same model, one per policy, each cut into the same stages and sharded the
same way: the ceiling (no guard, no limit), `full` (every layer recomputed) and
`adaptive` under a per-rank budget of `--budget-fraction` of that rank's peak with
everything saved (measured on a first, discarded round with a `none` guard and no limit).
Gradients are bitwise equal under every policy, so the three copies keep identical weights
and see identical routing: the runs differ only in memory handling. Each round runs one
optimizer step of every policy on the same batch, in a rotating order; a step's time is
the slowest rank's (barrier, step, all-reduce of the time). Rank 0 prints medians over
the rounds after the first (warm-up) and the ratios to the ceiling.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

POLICIES = ("ceiling", "full", "adaptive")


def _rank(rank: int, world: int, store: str, opts: dict) -> None:
    import spikeguard
    from spikeguard.data.corpus import load_corpus
    from spikeguard.model import build_model, model_config
    from spikeguard.parallel.launch_utils import close_gloo, init_gloo
    from spikeguard.parallel.mesh import MeshGroups, ParallelLayout
    from spikeguard.parallel.pipeline_training import PipelineRank
    from spikeguard.train.loop import TrainConfig, make_optimizer

    init_gloo(rank, world, store)
    layout = ParallelLayout(world, pp=opts["pp"], ep=opts["ep"])
    cfg = model_config(opts["preset"], num_layers=opts["num_layers"])
    M, B = opts["micro_batches"], opts["batch_size"]
    layout.check(num_layers=cfg.num_layers, num_experts=cfg.num_experts, micro_batches=M)
    groups = MeshGroups.build(layout)
    corpus = load_corpus(None)
    train_cfg = TrainConfig(batch_size=B, micro_batches=M)

    def make(policy: str, budget=None):
        prank = PipelineRank(build_model(cfg, seed=0), groups, micro_batches=M, batch_size=B)
        opts_ = [make_optimizer(m, train_cfg) for m in prank.modules.stages]
        if policy != "ceiling":
            by_id = {id(m): o for m, o in zip(prank.modules.stages, opts_)}
            prank.attach_guards(lambda m: spikeguard.attach(
                m, budget=budget, policy=policy, optimizer=by_id[id(m)]))
        return prank, opts_

    gen = torch.Generator().manual_seed(1000 * groups.data_shard)
    batches = [corpus.get_batch("train", M * B, cfg.seq_len, gen) for _ in range(opts["reps"] + 1)]

    def step(prank, optimizers, batch) -> float:
        dist.barrier()
        start = time.perf_counter()
        for o in optimizers:
            o.zero_grad(set_to_none=True)
        prank.step(*batch)
        prank.clip_grad_norm_(1.0)
        for o in optimizers:
            o.step()
        seconds = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
        return seconds.item()

    probe, probe_opts = make("none", "1TiB")
    step(probe, probe_opts, batches[0])
    peak = probe.guards[0].history[-1]["peak_bytes"]
    probe.close()
    del probe, probe_opts
    budget = int(peak * opts["budget_fraction"])
    runs = {p: make(p, budget if p == "adaptive" else "1TiB") for p in POLICIES}
    times = {p: [] for p in POLICIES}
    records = {p: [] for p in POLICIES}
    warmup_reruns = 0
    for i, batch in enumerate(batches):
        order = POLICIES[i % 3:] + POLICIES[:i % 3]
        for p in order:
            prank, optimizers = runs[p]
            seconds = step(prank, optimizers, batch)
            if i:  # the first round warms up
                times[p].append(seconds)
                if prank.guards:
                    records[p].append(prank.guards[0].history[-1])
            elif p == "adaptive":
                warmup_reruns += prank.guards[0].history[-1]["safety_net_reruns"]
    summary = {p: {"median_s": statistics.median(times[p]),
                   "peak": max((r["peak_bytes"] for r in records[p]), default=None),
                   "overruns": sum(r["peak_bytes"] > r["budget_bytes"] for r in records[p]),
                   "reruns": sum(r["safety_net_reruns"] for r in records[p]),
                   "decisions": _sum(records[p])} for p in POLICIES}
    gathered: list = [None] * world
    dist.all_gather_object(gathered, {"summary": summary, "budget": budget, "peak": peak,
                                      "warmup_reruns": warmup_reruns})
    if rank == 0:
        _report(gathered, opts, cfg, layout, M * B * cfg.seq_len * groups.num_shards)
    for prank, _ in runs.values():
        prank.close()
    runs = groups = None  # the group must be unreferenced when it is torn down
    close_gloo()


def _sum(records: list) -> dict:
    total = {"save": 0, "recompute": 0, "offload": 0}
    for r in records:
        for k in total:
            total[k] += r["decisions"][k]
    return total


def _report(gathered: list, opts: dict, cfg, layout, tokens_per_step: int) -> None:
    from spikeguard.memory.budget import format_bytes

    s0 = gathered[0]["summary"]
    ceiling = tokens_per_step / s0["ceiling"]["median_s"]
    print(f"pipeline bench (CPU, emulated device): {opts['preset']} ({cfg.num_layers} layers, "
          f"{cfg.num_experts} experts top-{cfg.top_k}), {layout.nproc} ranks = pp {layout.pp} x "
          f"dp {layout.dp} x ep {layout.ep}, 1F1B, {opts['micro_batches']} micro-batches of "
          f"{opts['batch_size']} x {cfg.seq_len} tokens per shard; medians of {opts['reps']} "
          f"rounds, policies interleaved; adaptive budget {opts['budget_fraction']:g} x each "
          f"rank's peak with everything saved")
    print("| policy | tokens/s | vs ceiling | worst peak / budget (rank) | overruns | "
          "safety-net re-runs | save / recompute / offload (all ranks) |")
    print("|---|---|---|---|---|---|---|")
    for p in POLICIES:
        rate = tokens_per_step / s0[p]["median_s"]
        peaks = [(g["summary"][p]["peak"] or 0, r) for r, g in enumerate(gathered)]
        worst, wrank = max(peaks)
        budget = gathered[wrank]["budget"] if p == "adaptive" else None
        where = ("-" if p == "ceiling" else f"{format_bytes(worst)} / "
                 f"{format_bytes(budget) if budget else 'none'} (r{wrank})")
        dec = [g["summary"][p]["decisions"] for g in gathered]
        dec_text = "-" if p == "ceiling" else " / ".join(
            str(sum(d[k] for d in dec)) for k in ("save", "recompute", "offload"))
        over = sum(g["summary"][p]["overruns"] for g in gathered)
        reruns = sum(g["summary"][p]["reruns"] for g in gathered)
        print(f"| {p} | {rate:.0f} | {rate / ceiling:.3f} | {where} | {over} | {reruns} "
              f"| {dec_text} |")
    full = tokens_per_step / s0["full"]["median_s"]
    adaptive = tokens_per_step / s0["adaptive"]["median_s"]
    print(f"adaptive safety-net re-runs in the discarded first round (no measurements yet): "
          f"{sum(g['warmup_reruns'] for g in gathered)} over all ranks")
    if ceiling != full:
        print(f"adaptive closes {(adaptive - full) / (ceiling - full):.0%} of the gap between full "
              f"recompute and the ceiling")


def main(argv=None) -> None:
    from spikeguard.parallel.launch_utils import run_spawned

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--ep", type=int, default=2)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--num-layers", type=int, default=None)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--budget-fraction", type=float, default=0.85)
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--store", default="/tmp/spikeguard_pipeline_bench_store")
    args = parser.parse_args(argv)
    opts = {k: getattr(args, k) for k in ("pp", "ep", "preset", "num_layers", "micro_batches",
                                          "batch_size", "budget_fraction", "reps")}
    run_spawned(_rank, args.nproc, (opts,), store_path=Path(args.store), timeout_s=1800)


if __name__ == "__main__":
    main()
