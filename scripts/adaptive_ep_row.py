"""The EP oracle bench's adaptive row alone, beside the ceiling, at one fraction.

    .venv/bin/python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        scripts/adaptive_ep_row.py --preset medium --batch-size 4 --reps 8 --fraction 0.7

As spikeguard/bench/oracle_ep.py lays it out (each rank its own batches, the budget the
fraction of the rank's own true peak, adaptive's first step its calibration and not
counted, the rounds interleaved with the ceiling and the first dropped, the cost rates
timed as the bench times them), without the other rows and the oracle: a few minutes on
`medium` where the whole page takes 20. Rank 0 prints the per-round ratio to the ceiling
(rank 0's clock of the whole step), tok/s of both ranks, and per rank the safety net's
re-runs of every step, the whole-layer fallbacks, the peak and the last step's decisions.
CPU figures, emulated device.
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
import torch.distributed as dist

import spikeguard
from spikeguard.bench import oracle_bench
from spikeguard.bench.oracle_ep import ExpertParallel, gather
from spikeguard.bench.runtime_ratios import memory_row, plain_step, time_interleaved
from spikeguard.bench.spread import cell, needed, ratio_spread
from spikeguard.data.corpus import load_corpus
from spikeguard.memory.budget import format_bytes
from spikeguard.model import model_config
from spikeguard.parallel.launch import init_worker
from spikeguard.parallel.launch_utils import close_gloo


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="medium")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--micro-batches", type=int, default=2)
    parser.add_argument("--reps", type=int, default=8)
    parser.add_argument("--fraction", type=float, default=0.7)
    args = parser.parse_args()
    _check(parser, args)
    init_worker()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg, rank = model_config(args.preset), dist.get_rank()
    layout = ExpertParallel(cfg, 0, dist.group.WORLD)
    gen = torch.Generator().manual_seed(1000 * rank)   # as oracle_ep: each rank its data
    corpus = load_corpus(None)
    batches = [corpus.get_batch("train", args.batch_size, cfg.seq_len, gen)
               for _ in range(args.micro_batches)]
    peak, _ = oracle_bench.probe(cfg, 0, batches, layout)
    budget = int(args.fraction * peak)
    models = {"ceiling": layout.build(), "adaptive": layout.build()}
    guard = spikeguard.attach(models["adaptive"], budget=budget, policy="adaptive")
    guard.run_step(lambda: plain_step(models["adaptive"], batches))   # calibrates, as the bench
    times = time_interleaved(models, {"adaptive": guard}, batches, args.reps, list(models),
                             step=plain_step)
    row = memory_row(guard, peak)
    mine = (f"rank {rank}: re-runs per step {[h['safety_net_reruns'] for h in guard.history]} "
            f"(the first calibrates), whole layers {sum(h['full_layers'] for h in guard.history)}"
            f", peak {format_bytes(row['peak_bytes'])} / {format_bytes(budget)} (true peak "
            f"{format_bytes(peak)}), last step {row['decisions']}, evicted "
            f"{format_bytes(row['evicted_bytes'])}")
    every = gather(mine)
    if rank == 0:
        tokens = dist.get_world_size() * args.batch_size * args.micro_batches * cfg.seq_len
        spread = ratio_spread(times["adaptive"], times["ceiling"])
        print(f"{args.preset}, EP={dist.get_world_size()}, {args.fraction:.2f}x: adaptive vs "
              f"ceiling {cell(spread)} (range {spread['min']:.2f}-{spread['max']:.2f}; "
              f"{needed(spread)} rounds would resolve +-0.01); tok/s "
              + ", ".join(f"{p} {tokens / statistics.median(t):.0f}" for p, t in times.items())
              + " (CPU, emulated device)", flush=True)
        print("\n".join(every), flush=True)
    guard.detach()
    close_gloo()


def _check(parser, args) -> None:
    """Bad input: one line, exit 2, before any rank builds a model."""
    from spikeguard.model.config import PRESETS
    why = ""
    if args.preset not in PRESETS:
        why = f"--preset must be one of {', '.join(sorted(PRESETS))}, got {args.preset!r}"
    elif min(args.batch_size, args.micro_batches) < 1 or args.reps < 2:
        why = "--batch-size and --micro-batches take 1 or more, --reps 2 or more"
    elif not 0 < args.fraction <= 1:
        why = f"--fraction must be in (0, 1], got {args.fraction}"
    elif int(os.environ.get("WORLD_SIZE", "1")) < 2:
        why = "run it under torch.distributed.run --nproc-per-node 2 (or more)"
    if why:
        parser.exit(2, f"adaptive_ep_row.py: {why}\n")


if __name__ == "__main__":
    main()
