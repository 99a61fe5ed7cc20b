"""Spawned rank function for tests/runtime/test_runtime_entry_exchange.py (importable by
the children)."""

from __future__ import annotations

import functools
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
from spikeguard.parallel.expert_parallel import ExpertParallelDispatcher
from spikeguard.parallel.launch_utils import close_gloo, init_gloo
from spikeguard.plan.cost_rates import FORMAT, VERSION, use_rates
from spikeguard.runtime.window import TrackerEvictor

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
    """Adaptive at `fraction` of this rank's true peak for `steps` steps; writes its records,
    every eviction the window asked for (where: the layer's entry, its dispatch or its
    decision) with each dispatch's exact overflow, then one more step's dispatch peaks."""
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
        asked = _record_evictions(guard)
        for _ in range(steps):
            guard.run_step(lambda: plain_step(guard.model, batches))
        keys = ("peak_bytes", "budget_bytes", "safety_net_reruns", "decisions", "evicted_bytes",
                "full_layers")
        records = [{k: h[k] for k in keys} for h in guard.history]
        peaks = _dispatch_peaks(guard)
        guard.run_step(lambda: plain_step(guard.model, batches))
        guard.detach()
        (Path(out_dir) / f"steps_rank{rank}.json").write_text(json.dumps(records))
        (Path(out_dir) / f"asked_rank{rank}.json").write_text(json.dumps(asked))
        (Path(out_dir) / f"dispatch_rank{rank}.json").write_text(json.dumps(peaks))
    finally:
        close_gloo()


def _dispatchers(guard) -> list:
    return [b.dispatcher for b in guard.moe_blocks if isinstance(b.dispatcher, ExpertParallelDispatcher)]


def _record_evictions(guard) -> list:
    """[where, step, asked bytes, the dispatch's exact overflow or None] of every eviction
    the window asks for, through the real evictor (recorded, then done as asked)."""
    asked, where = [], ["decision"]

    def evict(evictor, num_bytes, real=TrackerEvictor.evict):
        asked.append([where[0], len(guard.history), num_bytes, where[1] if where[0] == "dispatch"
                      else None])
        return real(evictor, num_bytes)

    def at(name, call, arg):
        # at the dispatch, `arg` is its exchange bytes: the overflow they make now
        where[:] = [name, guard.ledger.in_use() + arg - guard.budget_bytes]
        try:
            return call(arg)
        finally:
            where[:] = ["decision"]

    TrackerEvictor.evict = evict
    window = guard.window
    window.layer_cannot_fit = functools.partial(at, "entry", window.layer_cannot_fit)
    for dispatcher in _dispatchers(guard):
        dispatcher.make_room = functools.partial(at, "dispatch", dispatcher.make_room)
    return asked


def _dispatch_peaks(guard) -> list:
    """[exchange bytes, the device's peak above its in-use after make_room, that in-use,
    the budget] of every forward dispatch from now on (the device's peak is reset at each:
    the step's own peak is no longer recorded right)."""
    peaks, meter = [], guard.meter
    for dispatcher in _dispatchers(guard):
        def room(num_bytes, made=dispatcher.make_room):
            made(num_bytes)
            if guard.in_forward:
                peaks.append([num_bytes, 0, meter.allocated(), guard.budget_bytes])
                meter.reset_peak()

        def dispatch(*args, real=dispatcher.dispatch):
            out = real(*args)
            if guard.in_forward:
                peaks[-1][1] = meter.peak() - peaks[-1][2]
            return out

        dispatcher.make_room, dispatcher.dispatch = room, dispatch
    return peaks
