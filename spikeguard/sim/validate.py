"""The simulator against the runtime on this machine (CPU, emulated device), `small` model.

    .venv/bin/python -m spikeguard.sim.validate --steps 4 --reps 7

1. Peak bytes: the runtime trains the `small` preset under each policy with the budget
   runtime_ratios uses (0.85x the ceiling's peak), recording its routing as a trace
   (spikeguard.bench.trace) and the ledger's peak per step; the simulator replays the
   trace with the same budget, the guard's own calibrated cost model, and predicts the
   peak per step. Single process: both must agree within 10% (tests/sim/test_sim_validation.py).
   `none` cannot run under that budget (it dies, and the simulator must say it crashes);
   its peak is compared with no limit.
2. Throughput ratios: spikeguard.bench.runtime_ratios measures ceiling, full and adaptive
   side by side; the simulator's device is this machine, measured (`measure_device`: the
   plain model's FLOP rate and backward/forward time ratio; the expert stages and host
   copies from the guard's own cost calibration), and predicts full/ceiling and
   adaptive/ceiling. Timing-based, so this is a
   script whose figures go in docs/simulator.md, never a timed test.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Optional

import torch

from spikeguard.sim.config import SimConfig, load_config

BUDGET_FRACTION = 0.85
RUNTIME_POLICIES = ("none", "experts", "offload", "full", "adaptive")


def _batches(cfg, corpus, steps: int, batch_size: int, micro_batches: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    return [[corpus.get_batch("train", batch_size, cfg.seq_len, gen) for _ in range(micro_batches)]
            for _ in range(steps)]


def sim_config(budget: int, steps: int, batch_size: int, micro_batches: int,
               trace: Optional[str] = None, **device) -> SimConfig:
    over = {"device.capacity_bytes": budget, "workload.steps": steps,
            "layout.micro_batch_size": batch_size,
            "layout.global_batch": batch_size * micro_batches, "workload.trace": trace}
    over.update({f"device.{k}": v for k, v in device.items()})
    return load_config("small", overrides=over)


def compare_peaks(steps: int = 3, batch_size: int = 8, micro_batches: int = 2, seed: int = 0,
                  policies=RUNTIME_POLICIES, folder: Optional[str] = None) -> dict:
    """Runtime ledger peaks against simulated peaks, per policy and step (see module doc)."""
    import spikeguard
    from spikeguard.bench.trace import TraceRecorder, TraceWriter, make_header
    from spikeguard.data.corpus import load_corpus
    from spikeguard.errors import DeviceOutOfMemory
    from spikeguard.model import build_model, model_config
    from spikeguard.sim.engine import simulate

    cfg = model_config("small")
    batches = _batches(cfg, load_corpus(None), steps, batch_size, micro_batches, seed)
    tmp = tempfile.TemporaryDirectory() if folder is None else None
    trace_path = str(Path(folder or tmp.name) / "small.trace.jsonl")

    def run(policy: str, budget: int, record: bool = False):
        model = build_model(cfg, seed=seed)
        guard = spikeguard.attach(model, budget=budget, policy=policy)
        recorder = None
        if record:
            header = make_header(num_layers=cfg.num_layers, num_experts=cfg.num_experts,
                                 top_k=cfg.top_k, ep=1, micro_batches=micro_batches,
                                 tokens_per_micro_batch=batch_size * cfg.seq_len, preset="small")
            recorder = TraceRecorder(model, micro_batches, TraceWriter(trace_path, header))
        crashed = False
        try:
            for step, step_batches in enumerate(batches, start=1):
                if recorder:
                    recorder.before_step(step)
                with guard.step():
                    for idx_BT, targets_BT in step_batches:
                        model(idx_BT, targets_BT).loss.backward()
                if recorder:
                    recorder.after_step(step, guard.history[-1])
                model.zero_grad(set_to_none=True)
        except DeviceOutOfMemory:
            crashed = True
        finally:
            if recorder:
                recorder.detach()
        return [h["peak_bytes"] for h in guard.history], crashed, guard.cost

    ceiling, _, _ = run("none", 1 << 50, record=True)
    budget = int(BUDGET_FRACTION * ceiling[0])
    out = {"budget_bytes": budget, "policies": {}}
    try:
        for policy in policies:
            measured, crashed, cost = run(policy, budget)
            sim_cfg = sim_config(budget, steps, batch_size, micro_batches, trace_path)
            sim = simulate(sim_cfg.with_changes(run={"policies": (policy, "ceiling")}), cost=cost)
            predicted = sim.policies[policy]
            row = {"measured_peaks": measured, "runtime_crashed": crashed,
                   "predicted_peaks": predicted.peak_step.tolist(),
                   "sim_crashes": predicted.crashes}
            if policy == "none":   # compare without the limit it cannot live under
                row["measured_peaks"] = ceiling
                row["predicted_peaks"] = sim.policies["ceiling"].peak_step.tolist()
            out["policies"][policy] = row
    finally:
        if tmp is not None:
            tmp.cleanup()
    return out


def measure_device(reps: int = 7, batch_size: int = 8, micro_batches: int = 2,
                   seed: int = 0) -> dict:
    """This machine as the simulator's device: the plain model's forward and forward +
    backward times (interleaved, medians), so the achieved FLOP rate and the backward /
    forward ratio. Measured, not fitted to any ratio the simulator then predicts."""
    import statistics
    import time

    from spikeguard.data.corpus import load_corpus
    from spikeguard.model import build_model, model_config
    from spikeguard.sim.shape import build

    cfg = model_config("small")
    batches = _batches(cfg, load_corpus(None), 1, batch_size, micro_batches, seed)[0]
    model = build_model(cfg, seed=seed)
    fwd, step = [], []
    for rep in range(reps + 1):
        start = time.perf_counter()
        for idx_BT, targets_BT in batches:
            model(idx_BT, targets_BT).loss  # graph built, then dropped
        mid = time.perf_counter()
        for idx_BT, targets_BT in batches:
            model(idx_BT, targets_BT).loss.backward()
        end = time.perf_counter()
        model.zero_grad(set_to_none=True)
        if rep:
            fwd.append(mid - start)
            step.append(end - mid)
    fwd_s, step_s = statistics.median(fwd), statistics.median(step)
    tokens = batch_size * micro_batches * cfg.seq_len
    flops = build(sim_config(1 << 40, 1, batch_size, micro_batches)).model_flops_per_token * tokens
    return {"flop_rate": flops / step_s, "backward_ratio": (step_s - fwd_s) / fwd_s,
            "forward_s": fwd_s, "step_s": step_s}


def compare_ratios(reps: int = 7, batch_size: int = 8, micro_batches: int = 2) -> dict:
    """Measured runtime_ratios against the simulator with this machine as its device."""
    import spikeguard
    from spikeguard.bench.runtime_ratios import measure
    from spikeguard.model import build_model, model_config
    from spikeguard.sim.engine import simulate

    device = measure_device(reps, batch_size, micro_batches)
    measured = measure("small", batch_size, micro_batches, reps, BUDGET_FRACTION)
    budget = measured["budget_bytes"]
    flop_rate = device["flop_rate"]
    # The guard's own calibration of the expert stages and host copies on this machine.
    guard = spikeguard.attach(build_model(model_config("small")), budget=budget, policy="adaptive")
    cost = guard.cost
    sim_cfg = sim_config(budget, 4, batch_size, micro_batches, peak_flops=flop_rate, efficiency=1.0,
                         backward_ratio=device["backward_ratio"],
                         host_bytes_per_s=2 / (cost.d2h_s_per_byte + cost.h2d_s_per_byte))
    sim = simulate(sim_cfg.with_changes(run={"policies": ("ceiling", "full", "adaptive")}), cost=cost)
    tps = {p: sim.policies[p].tokens_per_s for p in ("ceiling", "full", "adaptive")}
    return {"measured": {"full_over_ceiling": measured["full_over_ceiling"],
                         "adaptive_over_ceiling": measured["adaptive_over_ceiling"]},
            "simulated": {"full_over_ceiling": tps["full"] / tps["ceiling"],
                          "adaptive_over_ceiling": tps["adaptive"] / tps["ceiling"]},
            "flop_rate": flop_rate, "backward_ratio": device["backward_ratio"],
            "budget_bytes": budget,
            "sim_decisions": dict(sim.policies["adaptive"].decisions),
            "runtime_decisions": measured["policies"]["adaptive"]["decisions"]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    peaks = compare_peaks(steps=args.steps)
    print(f"peak bytes per step, budget {peaks['budget_bytes']} (CPU, emulated device):")
    for policy, row in peaks["policies"].items():
        errs = [p / m - 1 for m, p in zip(row["measured_peaks"], row["predicted_peaks"])]
        print(f"  {policy:9s} measured {row['measured_peaks']} predicted {row['predicted_peaks']} "
              f"worst error {max(errs, key=abs):+.2%} | runtime crashed {row['runtime_crashed']}, "
              f"sim crashes {row['sim_crashes']}")
    ratios = compare_ratios(reps=args.reps)
    print(f"throughput ratios (CPU, emulated device; this machine measured as the device: "
          f"{ratios['flop_rate']:.3g} FLOP/s, backward/forward {ratios['backward_ratio']:.2f}):")
    for key in ("full_over_ceiling", "adaptive_over_ceiling"):
        m, s = ratios["measured"][key], ratios["simulated"][key]
        print(f"  {key:22s} measured {m:.3f} simulated {s:.3f} ({s / m - 1:+.1%})")
    print(f"  adaptive decisions: runtime {ratios['runtime_decisions']} sim {ratios['sim_decisions']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
