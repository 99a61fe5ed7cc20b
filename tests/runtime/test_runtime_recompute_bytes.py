"""A recomputed region of the expert path (spikeguard/runtime/executor.py) keeps on the device
exactly what the planner counts for its plan, nothing per region beside it: every byte
model (the window's forecast, the oracle's, the simulator's) is per routed copy.

checkpoint's default kept torch.get_rng_state() (5,056 bytes on torch 2.13, a CPU tensor,
so counted by the emulated device) until each region's backward: 5,056 bytes per
recomputed layer and micro-batch in no byte model, enough for the oracle's plans to run
out by 4 bytes (tests/bench/test_bench_oracle_ep.py at 0.6x, issue 24).

    .venv/bin/python -m pytest tests/runtime/test_runtime_recompute_bytes.py -q
"""

from __future__ import annotations

import pytest
import torch

import spikeguard
from spikeguard.bench import oracle_bench
from spikeguard.bench.runtime_ratios import plain_step
from spikeguard.data.corpus import load_corpus
from spikeguard.model import build_model, model_config
from spikeguard.plan.catalogue import ALL_SAVE, POLICY_PLANS, Action, LayerPlan
from spikeguard.plan.oracle import Choice
from spikeguard.runtime import executor

pytestmark = pytest.mark.timeout(120)

CFG = model_config("tiny")
# The oracle's plan at 0.6x (offloading dispatch beside), and the static `experts` plan.
PLANS = [LayerPlan.of(dispatch=Action.OFFLOAD, gate_up=Action.RECOMPUTE,
                      silu=Action.RECOMPUTE, act=Action.RECOMPUTE),
         POLICY_PLANS["experts"]]


def _batches():
    gen = torch.Generator().manual_seed(0)
    corpus = load_corpus(None)
    return [corpus.get_batch("train", 4, CFG.seq_len, gen) for _ in range(2)]


def _in_use_at_decisions(plan: LayerPlan, batches) -> dict:
    """(micro-batch, layer) -> (the device's bytes, the ledger's) at each decision of a step
    running `plan` in every layer, no limit."""
    guard = spikeguard.attach(build_model(CFG, seed=0), budget=1 << 40, policy="none")
    choices = {(mb, layer): Choice(plan) for mb in range(len(batches))
               for layer in range(CFG.num_layers)}
    table = oracle_bench.PlanTable(guard, choices)
    seen = {}

    def decide(layer: int, num_routed: int):
        mb = guard.window.ctx.micro_batch
        seen[(mb, layer)] = (guard.meter.allocated(), guard.window.ledger.in_use(), num_routed)
        return table.decide(layer, num_routed)

    guard.decide = decide
    guard.run_step(lambda: plain_step(guard.model, batches))
    planner = guard.planner
    moved_off = {key: planner.fixed(ALL_SAVE, n).device_bytes - planner.fixed(plan, n).device_bytes
                 for key, (_, _, n) in seen.items()}
    guard.detach()
    return seen, moved_off


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: p.describe().replace(" ", ","))
def test_a_recomputed_layer_keeps_what_the_planner_counts(plan):
    batches = _batches()
    _, probe = oracle_bench.probe(CFG, 0, batches)
    all_saved = {(mb, layer): in_use for mb, layer, in_use, *_ in probe}
    seen, moved_off = _in_use_at_decisions(plan, batches)
    for (mb, layer), (device, ledger, _) in seen.items():
        below = sum(moved_off[(mb, j)] for j in range(layer))
        expected = all_saved[(mb, layer)] - below
        assert device == expected, (mb, layer, device, expected, device - expected)
        assert ledger == device, (mb, layer, ledger, device)


def test_a_stage_drawing_random_numbers_is_refused(monkeypatch):
    """Its RNG state is not kept: recomputed, it would draw other numbers."""
    real = executor.stage_functions

    def with_dropout(experts, counts):
        fns = real(experts, counts)
        silu = fns["silu"]
        fns["silu"] = lambda t: torch.nn.functional.dropout(silu(t), 0.5)
        return fns

    monkeypatch.setattr(executor, "stage_functions", with_dropout)
    guard = spikeguard.attach(build_model(CFG, seed=0), budget=1 << 40, policy="experts")
    with pytest.raises(AssertionError, match="draws random numbers"):
        guard.run_step(lambda: plain_step(guard.model, _batches()))
    guard.detach()
