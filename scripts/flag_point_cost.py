"""What one collective of the failure protocol costs a rank here, on its own.

    .venv/bin/torchrun --nproc-per-node 2 scripts/flag_point_cost.py --reps 40
    .venv/bin/torchrun --nproc-per-node 4 scripts/flag_point_cost.py --reps 40

The calm pages (scripts/calm_overhead.py, calm_overhead_pp.py) time whole steps; their
EP, PP and transformers' EP rows cost more than the one-process rows, and a step there
makes a few collectives of the failure protocol (spikeguard.runtime.agreement) beyond the
plain model's: each a meeting of the ranks, whatever it carries. This script times each
kind alone, the first two made by the guard's own code, the third a plain all-gather of
notes over the job, as `PipelineRecovery.step_end` wrote it until 12-07 (that method
needs the schedule's stages to call; it now calls `agreement.gathered`, the group notes'
call, which also waits for gloo to let go of its tensors: not timed here, nor the flag
point's same wait since then; the README's page predates both):

    flag point   ExchangeJournal.flag_point: an all-to-all of L counts and one note per
                 rank of the EP group (spikeguard's own EP, a pipeline's stages: the end
                 of each micro-batch's forward, the end of a step)
    group notes  GroupAgreement.gather: an all-gather of one row per rank of the EP group
                 (transformers' EP: each FSDP unit and the ends; torchtitan's EP: the ends)
    job notes    pipeline_recovery's step end: an all-gather of one note over the job

The EP groups are pairs of ranks (ranks 0-1, 2-3), as in the calm pages' layouts. Every
round times, on each rank, `--iters` blocks of work (`--work-ms` of matrix products on
the rank's one thread, the count calibrated on rank 0) alone, then each followed by one
collective of a kind, the kinds interleaved; a collective's cost in that round is the
difference per block, on the process's CPU clock (its threads, gloo's included) and on
the wall clock (its waits too). Prints, per kind, the median over rounds with its 95%
interval (spikeguard/bench/spread.py), rank 0's and the worst rank's. CPU figures: no
device is involved (the notes live on the CPU, as the emulated device's do).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

from spikeguard.bench.spread import spread
from spikeguard.parallel.agreement import GroupAgreement
from spikeguard.parallel.exchange_journal import ExchangeJournal
from spikeguard.parallel.launch_utils import run_under_torchrun
from spikeguard.runtime.agreement import Note

KINDS = ("flag point", "group notes", "job notes")
LOCAL_EXPERTS = 4   # `small`'s 8 experts over an EP group of 2


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=40, help="interleaved rounds")
    parser.add_argument("--iters", type=int, default=50, help="blocks of work a round, per kind")
    parser.add_argument("--work-ms", type=float, default=2.0,
                        help="the CPU time of one block of work")
    args = parser.parse_args()
    for name in ("reps", "iters"):
        if getattr(args, name) < 1:
            parser.exit(2, f"flag_point_cost.py: --{name} must be positive, "
                           f"got {getattr(args, name)}\n")
    if not 0 < args.work_ms <= 1000:
        parser.exit(2, f"flag_point_cost.py: --work-ms must be in (0, 1000], got "
                       f"{args.work_ms}\n")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world < 2 or world % 2:
        parser.exit(2, "flag_point_cost.py: run it under torchrun with an even number of "
                       f"processes (--nproc-per-node 2 or 4), got {world}\n")
    return args


def main() -> None:
    args = _arguments()
    torch.set_num_threads(1)
    run_under_torchrun(lambda group: _measure(args))


def _block_count(work_ms: float) -> int:
    """Matrix products of 128 x 128 that take `work_ms` of CPU here (rank 0's count)."""
    a = torch.randn(128, 128)
    for seconds in (0.1, 0.3):   # the first pass warms up, the second counts
        start, n = time.process_time(), 0
        while time.process_time() - start < seconds:
            a @ a
            n += 1
    count = torch.tensor([max(1, round(n * work_ms / 300))])
    dist.broadcast(count, 0)
    return int(count.item())


def _collectives() -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    pairs = [dist.new_group([r, r + 1]) for r in range(0, world, 2)]   # every rank builds all
    group = pairs[rank // 2]
    journal = ExchangeJournal(group, LOCAL_EXPERTS)
    agreement = GroupAgreement(group, journal)
    cpu = torch.device("cpu")
    job = torch.empty(world * len(Note().as_list()), dtype=torch.int64)

    def job_notes():   # pipeline_recovery.step_end's all-gather, as it wrote it
        dist.all_gather_single(job, torch.tensor(Note().as_list(), dtype=torch.int64))
        job.tolist()

    return {"flag point": lambda: journal.flag_point(None, Note(), cpu),
            "group notes": lambda: agreement.gather(Note()),
            "job notes": job_notes}


def _measure(args) -> None:
    blocks = _block_count(args.work_ms)
    a = torch.randn(128, 128)

    def work():
        for _ in range(blocks):
            a @ a

    made = _collectives()
    runs = {"work": lambda: None, **made}
    cpu = {k: [] for k in runs}
    wall = {k: [] for k in runs}
    for rep in range(args.reps + 1):   # the first round warms up and is dropped
        for kind, collective in runs.items():
            dist.barrier()
            c0, w0 = time.process_time(), time.perf_counter()
            for _ in range(args.iters):
                work()
                collective()
            if rep:
                cpu[kind].append((time.process_time() - c0) / args.iters)
                wall[kind].append((time.perf_counter() - w0) / args.iters)
    mine = {"block_ms": 1e3 * sorted(cpu["work"])[len(cpu["work"]) // 2],
            "cost": {k: {"cpu": [1e3 * (c - w) for c, w in zip(cpu[k], cpu["work"])],
                         "wall": [1e3 * (c - w) for c, w in zip(wall[k], wall["work"])]}
                     for k in KINDS}}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if dist.get_rank() == 0:
        _report(everyone, args, blocks)


def _report(ranks: list, args, blocks: int) -> None:
    print(f"one collective of the failure protocol, {len(ranks)} processes (EP groups of 2), "
          f"{args.reps} rounds of {args.iters} blocks of work ({blocks} matrix products, "
          f"{ranks[0]['block_ms']:.2f} ms CPU on rank 0) each; CPU only, no device")
    print("| collective | CPU ms, rank 0 [95%] | CPU ms, worst rank [95%] | wall ms, rank 0 "
          "[95%] | wall ms, worst rank [95%] |")
    print("|---|---|---|---|---|")
    for kind in KINDS:
        cells = []
        for clock in ("cpu", "wall"):
            per_rank = [spread(r["cost"][kind][clock]) for r in ranks]
            worst = max(range(len(per_rank)), key=lambda i: per_rank[i]["median"])
            for i in (0, worst):
                s = per_rank[i]
                lo, hi = s["ci95"]
                cells.append(f"{s['median']:.3f} [{lo:.3f} to {hi:.3f}]"
                             + (f" (rank {i})" if i == worst else ""))
        print(f"| {kind} | " + " | ".join(cells) + " |")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
