"""Spawned rank function for tests/runtime/test_runtime_entry_exchange.py (importable by
the children)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

import spikeguard
from spikeguard.bench import oracle_bench
from spikeguard.bench.oracle_ep import ExpertParallel
from spikeguard.bench.runtime_ratios import plain_step
from spikeguard.data.corpus import load_corpus
from spikeguard.model import model_config
from spikeguard.parallel.launch_utils import close_gloo, init_gloo
from spikeguard.plan.cost_rates import FORMAT, VERSION, use_rates

# `small` with top-4 over 16 narrow experts: the dispatch exchange's rows (4 sent per token,
# 128 wide) weigh beside a layer's attention part, as on `medium`.
WIDE_EXCHANGE = dict(top_k=4, d_expert=64, num_experts=16)
# Rates timed on this machine's CPU (rank 0 of `medium`, EP=2), frozen so the plans do not
# move with the load: with them, before the entry check counted the exchange's rows, rank 1
# ran out in micro-batch 1, layer 3's dispatch (the regrouping copy of its received rows),
# every step, at 0.6x.
RATES = {"format": FORMAT, "version": VERSION,
         "stage_s_per_token": {"gate_up": 4.30e-06, "silu": 3.75e-07, "act": 1.31e-07,
                               "down": 2.01e-06},
         "d2h_s_per_byte": 9.65e-11, "h2d_s_per_byte": 1.40e-10, "copies_overlap": False}


def adaptive_steps_worker(rank: int, world_size: int, store_path: str, out_dir: str,
                          fraction: float, steps: int) -> None:
    """Adaptive at `fraction` of this rank's true peak for `steps` steps; writes its records."""
    init_gloo(rank, world_size, store_path)
    try:
        torch.manual_seed(0)
        cfg = model_config("small", **WIDE_EXCHANGE)
        layout = ExpertParallel(cfg, 0, dist.group.WORLD)
        gen = torch.Generator().manual_seed(1000 * rank)   # as oracle_ep: each rank its data
        corpus = load_corpus(None)
        batches = [corpus.get_batch("train", 8, cfg.seq_len, gen) for _ in range(2)]
        peak, _ = oracle_bench.probe(cfg, 0, batches, layout)
        budget = int(fraction * peak)
        guard = spikeguard.attach(layout.build(), budget=budget, policy="adaptive")
        use_rates(guard.cost, RATES)
        for _ in range(steps):
            guard.run_step(lambda: plain_step(guard.model, batches))
        keys = ("peak_bytes", "budget_bytes", "safety_net_reruns", "decisions", "evicted_bytes",
                "full_layers")
        records = [{k: h[k] for k in keys} for h in guard.history]
        guard.detach()
        (Path(out_dir) / f"steps_rank{rank}.json").write_text(json.dumps(records))
    finally:
        close_gloo()
