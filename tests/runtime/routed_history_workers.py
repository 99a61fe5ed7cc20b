"""Spawned rank function for tests/runtime/test_runtime_routed_history.py (importable by
the children)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
from host_marks import metered

import spikeguard
from spikeguard.bench.runtime_ratios import plain_step
from spikeguard.data.corpus import load_corpus
from spikeguard.model import build_model, model_config
from spikeguard.model.router import TopKRouter
from spikeguard.parallel import parallelize_experts
from spikeguard.parallel.launch_utils import close_gloo, init_gloo
from spikeguard.runtime.routed_history import ROUTED_HISTORY_MIN

# Selection-only bias on rank 0's experts (the first half): rank 0 routes ~1.5x its calm
# count in each biased layer (scores are softmax probabilities, ~1/8 an expert here).
HOT_BIAS = 0.04
CALM_STEPS = ROUTED_HISTORY_MIN + 2


def worker(rank: int, world_size: int, store_path: str, out_dir: str) -> None:
    """`small` at EP=2, one micro-batch of 8 x 128 tokens per rank, the same every step (as
    scripts/calm_overhead.py), adaptive at 1.1x the worst rank's calm all-saved peak:
    CALM_STEPS calm steps, then 2 steps with rank 0's experts favoured in layers 2 and 3
    only (a spike that starts late), then 2 with them favoured in every layer (a spike).
    Each phase's last step's gradients are compared with the plain model's under the same
    routing. A failing rank destroys its group and raises (no barrier a peer would miss)."""
    init_gloo(rank, world_size, store_path)
    try:
        _run(rank, out_dir)
    except BaseException:
        dist.destroy_process_group()
        raise
    close_gloo()


def _build():
    model = build_model(model_config("small"), seed=0)
    parallelize_experts(model, dist.group.WORLD)
    return model


def _favour_rank0(model, layers) -> None:
    for i, router in enumerate(m for m in model.modules() if isinstance(m, TopKRouter)):
        with torch.no_grad():
            router.expert_bias_E.zero_()
            if i in layers:
                router.expert_bias_E[: router.expert_bias_E.numel() // 2] = HOT_BIAS


def _run(rank: int, out_dir: str) -> None:
    cfg = model_config("small")
    gen = torch.Generator().manual_seed(100 + rank)
    batches = [load_corpus(None).get_batch("train", 8, cfg.seq_len, gen)]
    probe = spikeguard.attach(_build(), budget=1 << 50, policy="none")
    probe.run_step(lambda: plain_step(probe.model, batches))
    peak = torch.tensor([probe.history[-1]["peak_bytes"]])
    probe.detach()
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    guard = spikeguard.attach(_build(), budget=int(1.1 * int(peak)), policy="adaptive")
    plain = _build()
    history = guard.hookless.routed
    # the late spike before the whole one: after it, layers 2 and 3 remember spike counts
    phases, out = (("calm", (), CALM_STEPS), ("late", (2, 3), 2),
                   ("spike", (0, 1, 2, 3), 2)), {}
    for name, layers, steps in phases:
        # the spikes study the hooked path's predictions at each decision; a calm forward
        # makes them once, at its start, and checks each layer's count against them
        # (tests/parallel/test_parallel_calm_forward_ep.py)
        guard.calm.enabled = name == "calm"
        _favour_rank0(guard.model, layers)
        _favour_rank0(plain, layers)
        calm_most = {ly: max(n for n, _ in past) for ly, past in history._past.items()}
        # per step: [layer deciding, later layer, predicted routed, at its decision (else at
        # its entry, before its router ran)] and what each layer routed
        predicted, routed = [], []
        real_predict, real_note = history.predict, history.note

        def predict(micro_batch, layer):
            n = real_predict(micro_batch, layer)
            at = guard.window.ctx.layer
            predicted[-1].append([at, layer, n, at in routed[-1]])   # one micro-batch a step
            return n

        def note(micro_batch, layer, num_routed):
            routed[-1][layer] = num_routed
            real_note(micro_batch, layer, num_routed)

        history.predict, history.note = predict, note
        packed, real_pack = [0], guard.tracker.pack

        def pack(t):
            packed[0] += 1
            return real_pack(t)

        guard.tracker.pack = pack
        records = []
        for _ in range(steps):
            predicted.append([])
            routed.append({})
            packed[0] = 0
            with metered(guard.model) as meter:   # the independent meter (tests/meter.py)
                guard.run_step(lambda: plain_step(guard.model, batches))
            records.append({k: guard.history[-1][k] for k in (
                "hookless_layers", "safety_net_reruns", "peak_bytes", "budget_bytes")})
            records[-1]["meter_peak"] = meter.peak_bytes
            records[-1]["packed"] = packed[0]
        history.predict, history.note = real_predict, real_note
        guard.tracker.pack = real_pack
        plain_step(plain, batches)
        same = all((p.grad is None and q.grad is None) or torch.equal(p.grad, q.grad)
                   for p, q in zip(plain.parameters(), guard.model.parameters(), strict=True))
        out[name] = {"records": records, "grads_equal": same, "predicted": predicted,
                     "routed": routed, "calm_most": calm_most}
    guard.detach()
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(out))
