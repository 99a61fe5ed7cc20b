"""Spawned rank function for tests/bench/test_bench_oracle_ep.py (importable by the children)."""

from __future__ import annotations

import json
from pathlib import Path

import spikeguard
from spikeguard.bench import oracle_bench
from spikeguard.bench.runtime_ratios import plain_step
from spikeguard.errors import DeviceOutOfMemory
from spikeguard.parallel.launch_utils import close_gloo, init_gloo
from spikeguard.plan.cost import CostModel
from spikeguard.plan.cost_rates import rates_of, use_rates
from spikeguard.plan.oracle_evict import solve_evict

from ep_case import ep_case

# `medium`'s proportions at `tiny`'s size: experts narrower than the model (d_expert <
# d_model) and top-4, so the exchange's rows weigh beside the expert path's tensors.
NARROW_EXPERTS = dict(d_model=64, d_expert=16, num_layers=4, num_experts=8, top_k=4)


def oracle_plans_worker(rank: int, world_size: int, store_path: str, out_dir: str,
                        fraction: float) -> None:
    """oracle_ep's oracle row on one rank: probe, adaptive's calibrating step, the oracle
    solved on its byte model, then its plans run under the budget. Writes what happened."""
    init_gloo(rank, world_size, store_path)
    try:
        case = ep_case(rank, "tiny", **NARROW_EXPERTS)
        layout, batches, seen = case.layout, case.batches, case.seen
        budget = int(fraction * case.peak)
        adaptive = spikeguard.attach(layout.build(), budget=budget, policy="adaptive")
        # Rates frozen: timed at attach and corrected online, they moved the oracle's
        # plans with the machine's load (CI here once chose plans this test rejects).
        use_rates(adaptive.cost, rates_of(CostModel()))
        adaptive.run_step(lambda: plain_step(adaptive.model, batches))
        problems = oracle_bench.oracle_problems(seen, adaptive, budget)
        solutions = {mb: solve_evict(p, adaptive.cost.offload_s_for_bytes)
                     for mb, p in problems.items()}
        found = {"budget": budget, "feasible": layout.all_ranks(
            all(s.feasible for s in solutions.values()))}
        if found["feasible"]:
            choices = {(mb, i): problems[mb].layers[i].options[c].label
                       for mb, s in solutions.items() for i, c in enumerate(s.choices)}
            evict_at = {(mb, i): n for mb, s in solutions.items()
                        for i, n in enumerate(s.evict_at)}
            guard = spikeguard.attach(layout.build(), budget=budget, policy="none")
            guard.decide = oracle_bench.PlanTable(guard, choices, evict_at).decide
            try:
                guard.run_step(lambda: plain_step(guard.model, batches))
                found["error"] = None
                found["peak"] = guard.history[-1]["peak_bytes"]
            except DeviceOutOfMemory as err:
                found["error"] = str(err).splitlines()[0]
            found["plans"] = sorted({c.describe() for c in choices.values()})
            found["evicted"] = sum(evict_at.values())
        (Path(out_dir) / f"oracle_rank{rank}.json").write_text(json.dumps(found))
    finally:
        close_gloo()
