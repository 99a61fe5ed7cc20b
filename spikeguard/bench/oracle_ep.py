"""The oracle bench (spikeguard/bench/oracle_bench.py) under expert parallelism.

    .venv/bin/python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        -m spikeguard.bench.oracle_ep --preset small --reps 11

Every rank runs oracle_bench's rows (ceiling, full, none, experts, offload, oracle,
adaptive) on the built-in model laid out by spikeguard.parallel.parallelize_experts, gloo,
each rank on its own batches (the same every step: no optimizer step, so every step
routes alike on every rank), the rounds interleaved alike on every rank. Per rank:

  true peak      the rank's all-saved step, a probe with no limit (its own peak)
  budget         the fraction of the rank's OWN true peak: every rank cut by the same
                 share of what it needs (with the max over ranks a lighter rank would be
                 cut less, or not at all, and its oracle problem would not be the
                 fraction's)
  oracle         solved from the rank's exact per-layer routed counts (the copies its
                 local experts receive) and in-use at each decision, on its own adaptive
                 guard's calibrated byte and cost model, run for real through its guard's
                 `decide` seam; run only where every rank's problem has a solution
  static in advance
                 the static plan the byte model predicts fits on every rank at the least
                 predicted cost of the slowest rank (full when none does)

A step under EP is the slowest rank's (the exchanges keep the ranks in step): the ratios
are per round from rank 0's wall clock of the whole step; tok/s counts every rank's
tokens. Peak / budget, overruns, re-runs and decisions are each rank's. A static policy
that runs out on one rank ends on every rank (the group's agreed end), and is shown so.
Rank 0 prints. CPU figures, emulated device.
"""

from __future__ import annotations

import gc
import json
import math
import sys

import torch
import torch.distributed as dist

from spikeguard.bench import oracle_bench
from spikeguard.bench.runtime_ratios import check_workload, decision_cells, workload_parser
from spikeguard.bench.spread import cell, needed
from spikeguard.data.corpus import load_corpus
from spikeguard.errors import UsageError
from spikeguard.memory.budget import format_bytes
from spikeguard.model import build_model, model_config

MEMORY = ("peak_bytes", "overruns", "safety_net_reruns", "decisions", "evicted_bytes",
          "prefetched_bytes", "note")


class ExpertParallel(oracle_bench.OneProcess):
    """oracle_bench's layout on the default group: every rank builds the same model and
    keeps its slice of the experts."""

    def __init__(self, cfg, seed: int, group):
        super().__init__(cfg, seed)
        self.group = group

    def build(self):
        from spikeguard.parallel import parallelize_experts
        return parallelize_experts(build_model(self.cfg, seed=self.seed), self.group)

    def all_ranks(self, flag: bool) -> bool:
        t = torch.tensor([int(not flag)])
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        return int(t.item()) == 0

    def static_in_advance(self, problems: dict) -> str:
        mine = oracle_bench.static_predictions(problems)
        every = gather(mine)
        best = ("full", float("inf"))
        for name in mine:
            if all(r[name][0] for r in every):
                slowest = max(r[name][1] for r in every)
                if slowest < best[1]:
                    best = (name, slowest)
        return best[0]


def gather(obj) -> list:
    """`obj` of every rank, rank 0's first (every rank calls it at the same point)."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def measure(preset: str, batch_size: int, micro_batches: int, reps: int, fractions,
            seed: int = 0) -> dict:
    """Every rank's rows at every fraction; the same dict on every rank: rank 0's timing
    and, under "ranks", each rank's memory, decisions, cost-model line and oracle."""
    cfg = model_config(preset)
    rank, world = dist.get_rank(), dist.get_world_size()
    layout = ExpertParallel(cfg, seed, dist.group.WORLD)
    gen = torch.Generator().manual_seed(seed + 1000 * rank)   # each rank its own data
    corpus = load_corpus(None)
    batches = [corpus.get_batch("train", batch_size, cfg.seq_len, gen)
               for _ in range(micro_batches)]
    peak, seen = oracle_bench.probe(cfg, seed, batches, layout)
    budgets = []
    for f in fractions:
        mine = oracle_bench.one_budget(cfg, seed, batches, peak, seen, f, reps, layout)
        every = gather(mine)
        merged = {k: v for k, v in every[0].items()   # rank 0's clock: the group's step
                  if k not in ("budget_bytes", "true_peak_bytes", "predicted")}
        merged["ranks"] = [_rank_part(r) for r in every]   # each rank's own figures
        budgets.append(merged)
        gc.collect()   # this budget's models (guard and model hold each other) before the next
    return {"preset": preset, "ep": world, "reps": reps, "batch_size": batch_size,
            "micro_batches": micro_batches,
            "tokens_per_step": world * batch_size * micro_batches * cfg.seq_len,
            "true_peak_bytes": [r["true_peak_bytes"] for r in budgets[0]["ranks"]]
            if budgets else [], "budgets": budgets}


def _rank_part(result: dict) -> dict:
    return {"budget_bytes": result["budget_bytes"], "true_peak_bytes": result["true_peak_bytes"],
            "predicted": result["predicted"],
            "oracle": result["policies"].get("oracle", {}).get("note")
            or result["not_run"].get("oracle", ""),
            "policies": {p: {k: row.get(k) for k in MEMORY}
                         for p, row in result["policies"].items()}}


def table_lines(result: dict) -> list[str]:
    """The markdown table per budget (what docs/oracle.md shows for EP)."""
    lines, tokens, ep = [], result["tokens_per_step"], result["ep"]
    for b in result["budgets"]:
        ranks = b["ranks"]
        per_rank = "; ".join(f"rank {i}: budget {format_bytes(r['budget_bytes'])}, true peak "
                             f"{format_bytes(r['true_peak_bytes'])}" for i, r in enumerate(ranks))
        lines += ["", f"`{result['preset']}`, EP={ep}, at {b['fraction']:.2f}x of each rank's "
                  f"true peak ({per_rank}; CPU, emulated device; rank 0's step times, "
                  f"per-round ratios: medians of {result['reps']} interleaved rounds, "
                  f"quartiles in brackets)", "",
                  "| policy | tok/s (all ranks) | vs ceiling | rounds for +-0.01 | peak / budget "
                  "per rank | overruns | re-runs | save / recompute / offload (last step) "
                  "| evicted (last step) |", "|---|---|---|---|---|---|---|---|---|"]
        for name, row in b["policies"].items():
            tag = {b["static_in_advance"]: " (static in advance)"}.get(name, "")
            if name == b["static_in_hindsight"]:
                tag += " (static in hindsight)"
            rows = [r["policies"][name] for r in ranks]
            mem = "; ".join(f"{format_bytes(m['peak_bytes'])} / "
                            + ("none" if name == "ceiling" else format_bytes(r["budget_bytes"]))
                            for m, r in zip(rows, ranks))
            cells = [decision_cells(m) for m in rows]
            lines.append(f"| {name}{tag} | {tokens / row['median_s']:.0f} "
                         f"| {cell(row['vs_ceiling'])} "
                         f"| {'-' if name == 'ceiling' else needed(row['vs_ceiling'])} | {mem} "
                         f"| {' / '.join(str(m['overruns']) for m in rows)} "
                         f"| {' / '.join(str(m['safety_net_reruns']) for m in rows)} "
                         f"| {'; '.join(c[0] for c in cells)} | {'; '.join(c[1] for c in cells)} |")
        for name, note in b["not_run"].items():
            if name == "oracle":   # not run where some rank has no plan: those ranks' notes
                note = "; ".join(f"rank {i}: {r['oracle']}" for i, r in enumerate(ranks)
                                 if r["oracle"].startswith("no combination")) or note
            lines.append(f"| {name} | - | - | - | - | - | - | {note} | - |")
        lines += ["", f"(per rank: rank 0; rank 1{'; ...' if ep > 2 else ''}) static in advance "
                  f"(the byte model's pick, fitting on every rank): "
                  f"{b['static_in_advance'] or 'none fits'}; static in hindsight (the best "
                  f"median vs ceiling that ran): {b['static_in_hindsight']}", ""]
        if "adaptive_over_oracle" in b:
            ao = b["adaptive_over_oracle"]
            gap = "-" if math.isnan(b["gap_closed"]) else format(b["gap_closed"], ".0%")
            lines += [f"adaptive/oracle {cell(ao)} (range {ao['min']:.2f}-{ao['max']:.2f}; "
                      f"{needed(ao)} rounds would resolve +-0.01); adaptive/ceiling "
                      f"{cell(b['adaptive_over_ceiling'])}, gap from full to the ceiling "
                      f"closed {gap}", ""]
        for i, r in enumerate(ranks):
            lines += [f"rank {i}: " + oracle_bench.predicted_line(r["predicted"]) + "; oracle: "
                      + r["oracle"], ""]
    return lines[:-1]


def main(argv=None) -> int:
    parser = workload_parser(__doc__.splitlines()[0])
    parser.add_argument("--fractions", default="0.85,0.7",
                        help="budgets as fractions of each rank's true peak, comma-separated")
    worker = None
    try:
        args = parser.parse_args(argv)
        fractions = oracle_bench.parse_fractions(args.fractions)
        check_workload(args)
        worker = _join(args.preset)
        torch.set_num_threads(args.threads)
        torch.manual_seed(0)
        result = measure(args.preset, args.batch_size, args.micro_batches, args.reps, fractions)
        if worker.is_main:
            print("\n".join(table_lines(result)), flush=True)
            if args.json:
                from spikeguard.files import atomic_write
                atomic_write(args.json, json.dumps(result, indent=1) + "\n",
                             overwrite=args.overwrite, what="--json")
    except UsageError as err:
        print(f"spikeguard: error: {err}", file=sys.stderr)
        _leave(worker)
        return 2
    _leave(worker)   # (another error ends the rank as it is: a peer may be gone)
    return 0


def _leave(worker) -> None:
    """Leave the group cleanly (no model outlives measure(): see close_gloo)."""
    if worker is not None:
        from spikeguard.parallel.launch_utils import close_gloo
        close_gloo()


def _join(preset: str):
    """This rank's place in the torchrun job's gloo group; a UsageError outside torchrun."""
    from spikeguard.parallel.expert_parallel import check_divisible
    from spikeguard.parallel.launch import init_worker

    worker = init_worker()
    if worker is None or worker.world_size < 2:
        raise UsageError("oracle_ep runs under torchrun on 2 or more ranks: python -m "
                         "torch.distributed.run --standalone --nproc-per-node 2 -m "
                         "spikeguard.bench.oracle_ep ...")
    check_divisible(model_config(preset).num_experts, worker.world_size)
    return worker


if __name__ == "__main__":
    raise SystemExit(main())
