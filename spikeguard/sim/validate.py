"""The simulator against the runtime on this machine (CPU, emulated device), `small` model.

    .venv/bin/python -m spikeguard.sim.validate --steps 4 --reps 7

1. Peak bytes: the runtime trains the `small` preset under each policy with the budget
   runtime_ratios uses (0.85x the ceiling's peak), recording its routing as a trace
   (spikeguard.routing.trace) and the device's bytes at their peak per step (the emulated
   device counts every live storage: guard.history's `peak_bytes`); the simulator replays
   the trace with the same budget, the guard's own calibrated cost model, and predicts the
   peak per step and the plans. Single process and 4 processes (PP=2 x EP=2, in
   validate_pp.py): within 5% (tests/sim/test_sim_validation.py), and single process the
   same plans, step by step.
   `none` cannot run under that budget (it dies, and the simulator must say it crashes);
   its peak is compared with no limit.
2. Throughput ratios: ceiling, full and adaptive measured side by side as
   spikeguard.bench.runtime_ratios does, and in the same interleaved rounds this machine
   measured as the simulator's device (`measure_ratios`: the plain model's forward time,
   hence its FLOP rate, and its backward/forward time ratio; the expert stages and host
   copies from the guard's own cost calibration); the simulator then predicts
   full/ceiling and adaptive/ceiling. Timing-based, so this is a
   script whose figures go in docs/simulator.md, never a timed test.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Optional

import torch

from spikeguard.errors import ArgumentParser, UsageError
from spikeguard.sim.config import SimConfig, load_config

BUDGET_FRACTION = 0.85
RUNTIME_POLICIES = ("none", "experts", "offload", "full", "adaptive")
DECISION_KEYS = ("save", "recompute", "offload", "evicted_bytes")


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
    """The device's peak bytes per step against the simulated ones, per policy, and the
    plans of every step (save / recompute / offload counts, bytes evicted)."""
    import spikeguard
    from spikeguard.routing.trace import TraceRecorder, TraceWriter, make_header
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
        # The rates calibrated at attach rank every plan of the run: timings measured on
        # this shared machine mid-run would re-rank them, and the simulator, given the
        # rates, could not follow (the runtime's plans moved with the machine's load).
        guard.cost.freeze()
        recorder = None
        if record:
            header = make_header(num_layers=cfg.num_layers, num_experts=cfg.num_experts,
                                 top_k=cfg.top_k, ep=1, micro_batches=micro_batches,
                                 tokens_per_micro_batch=batch_size * cfg.seq_len, preset="small")
            recorder = TraceRecorder(model, micro_batches, TraceWriter(trace_path, header, overwrite=True))
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
        steps_decided = [dict(h["decisions"], evicted_bytes=h["evicted_bytes"])
                         for h in guard.history]
        return [h["peak_bytes"] for h in guard.history], crashed, guard.cost, steps_decided

    ceiling, _, _, _ = run("none", 1 << 50, record=True)
    budget = int(BUDGET_FRACTION * ceiling[0])
    out = {"budget_bytes": budget, "policies": {}}
    try:
        for policy in policies:
            measured, crashed, cost, runtime_decisions = run(policy, budget)
            sim_cfg = sim_config(budget, steps, batch_size, micro_batches, trace_path)
            sim = simulate(sim_cfg.with_changes(run={"policies": (policy, "ceiling")}), cost=cost)
            predicted = sim.policies[policy]
            row = {"measured_peaks": measured, "runtime_crashed": crashed,
                   "predicted_peaks": predicted.peak_step.tolist(),
                   "sim_crashes": predicted.crashes,
                   # per step: save / recompute / offload counts and bytes evicted
                   "runtime_decisions": runtime_decisions,
                   "sim_decisions": [{a: d.get(a, 0) for a in DECISION_KEYS}
                                     for d in predicted.decisions_step]}
            if policy == "none":   # compare without the limit it cannot live under
                row["measured_peaks"] = ceiling
                row["predicted_peaks"] = sim.policies["ceiling"].peak_step.tolist()
            out["policies"][policy] = row
    finally:
        if tmp is not None:
            tmp.cleanup()
    return out


def measure_ratios(reps: int = 15, batch_size: int = 8, micro_batches: int = 2,
                   seed: int = 0) -> dict:
    """runtime_ratios' measurement (same batches, budget 0.85x the ceiling's peak, runs
    interleaved, medians, first round dropped), with this machine measured as the
    simulator's device in the same rounds, so machine noise hits both alike:

      forward     the plain model's forward alone (its FLOP rate, and backward/forward);
      ceiling     the plain model's step;  full / adaptive: guarded steps (the ratios);
      guard_none  the guard keeping everything under no limit (its bookkeeping alone);
      checkpoint  plain torch checkpointing of every block, no guard.
    The last two are diagnostics; the simulator uses only `forward` and `ceiling`."""
    import statistics
    import time

    import spikeguard
    from spikeguard.data.corpus import load_corpus
    from spikeguard.model import build_model, model_config

    cfg = model_config("small")
    batches = _batches(cfg, load_corpus(None), 1, batch_size, micro_batches, seed)[0]
    probe = spikeguard.attach(build_model(cfg, seed=seed), budget=1 << 50, policy="none")
    with probe.step():
        for idx_BT, targets_BT in batches:
            probe.model(idx_BT, targets_BT).loss.backward()
    budget = int(BUDGET_FRACTION * probe.history[-1]["peak_bytes"])
    plain = build_model(cfg, seed=seed)
    ckpt = _checkpointed(build_model(cfg, seed=seed))
    guards = {"full": spikeguard.attach(build_model(cfg, seed=seed), budget=budget, policy="full"),
              "adaptive": spikeguard.attach(build_model(cfg, seed=seed), budget=budget,
                                            policy="adaptive"),
              "guard_none": spikeguard.attach(build_model(cfg, seed=seed), budget=1 << 50,
                                              policy="none")}

    def forward_only():
        for idx_BT, targets_BT in batches:
            plain(idx_BT, targets_BT).loss  # graph built, then dropped

    def step(model):
        for idx_BT, targets_BT in batches:
            model(idx_BT, targets_BT).loss.backward()
        model.zero_grad(set_to_none=True)

    def guarded(guard):
        with guard.step():
            step(guard.model)

    runs = {"forward": forward_only, "ceiling": lambda: step(plain),
            "checkpoint": lambda: step(ckpt), **{n: (lambda g=g: guarded(g)) for n, g in guards.items()}}
    times = {name: [] for name in runs}
    for rep in range(reps + 1):
        for name, fn in runs.items():
            start = time.perf_counter()
            fn()
            if rep:
                times[name].append(time.perf_counter() - start)
    med = {name: statistics.median(t) for name, t in times.items()}
    hist = guards["adaptive"].history[1:]
    return {"median_s": med, "budget_bytes": budget, "cost": guards["adaptive"].cost,
            "runtime_decisions": hist[-1]["decisions"],
            "overruns": sum(h["peak_bytes"] > h["budget_bytes"] for h in hist)}


def _checkpointed(model):
    """Every transformer block under torch.utils.checkpoint (non-reentrant), no guard."""
    import functools

    from torch.utils.checkpoint import checkpoint

    for block in model.blocks:
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
    return model


def compare_ratios(reps: int = 15, batch_size: int = 8, micro_batches: int = 2) -> dict:
    """Measured throughput ratios against the simulator with this machine as its device."""
    from spikeguard.sim.engine import simulate
    from spikeguard.sim.shape import build

    m = measure_ratios(reps, batch_size, micro_batches)
    med, budget, cost = m["median_s"], m["budget_bytes"], m["cost"]
    tokens = batch_size * micro_batches * 128
    # model_flops_per_token counts training (3x the forward): the forward's share is a third
    fwd_flops = build(sim_config(budget, 1, batch_size, micro_batches)).model_flops_per_token * tokens / 3
    flop_rate = fwd_flops / med["forward"]
    backward_ratio = (med["ceiling"] - med["forward"]) / med["forward"]
    # The guard's own calibration of the expert stages and host copies on this machine.
    sim_cfg = sim_config(budget, 4, batch_size, micro_batches, peak_flops=flop_rate, efficiency=1.0,
                         backward_ratio=backward_ratio,
                         host_bytes_per_s=2 / (cost.d2h_s_per_byte + cost.h2d_s_per_byte))
    sim = simulate(sim_cfg.with_changes(run={"policies": ("ceiling", "full", "adaptive")}), cost=cost)
    tps = {p: sim.policies[p].tokens_per_s for p in ("ceiling", "full", "adaptive")}
    return {"measured": {"full_over_ceiling": med["ceiling"] / med["full"],
                         "adaptive_over_ceiling": med["ceiling"] / med["adaptive"]},
            "simulated": {"full_over_ceiling": tps["full"] / tps["ceiling"],
                          "adaptive_over_ceiling": tps["adaptive"] / tps["ceiling"]},
            "flop_rate": flop_rate, "backward_ratio": backward_ratio,
            "guard_none_over_ceiling": med["ceiling"] / med["guard_none"],
            "plain_checkpoint_over_plain": med["ceiling"] / med["checkpoint"],
            "median_s": med, "budget_bytes": budget, "overruns": m["overruns"],
            "sim_decisions": dict(sim.policies["adaptive"].decisions),
            "runtime_decisions": m["runtime_decisions"]}


def main(argv=None) -> int:
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--pp-ep", action="store_true",
                        help="also the 4-process PP=2 x EP=2 comparison (a few minutes)")
    try:
        args = parser.parse_args(argv)   # a mistake is one line, exit 2
        for name in ("steps", "reps"):
            if not 0 < getattr(args, name) <= 10_000:
                raise UsageError(f"--{name} must be in [1, 10000], got {getattr(args, name)}")
    except UsageError as err:
        print(f"spikeguard: error: {err}", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    peaks = compare_peaks(steps=args.steps)
    print(f"the device's peak bytes per step, budget {peaks['budget_bytes']} (CPU, emulated "
          f"device: every live storage):")
    for policy, row in peaks["policies"].items():
        errs = [p / m - 1 for m, p in zip(row["measured_peaks"], row["predicted_peaks"])]
        print(f"  {policy:9s} measured {row['measured_peaks']} predicted {row['predicted_peaks']} "
              f"worst error {max(errs, key=abs):+.2%} | runtime crashed {row['runtime_crashed']}, "
              f"sim crashes {row['sim_crashes']}")
        if policy == "adaptive":
            print(f"    plans per step: runtime {row['runtime_decisions']}\n"
                  f"                    sim     {row['sim_decisions']}")
    ratios = compare_ratios(reps=args.reps)
    print(f"throughput ratios (CPU, emulated device; this machine measured as the device: "
          f"{ratios['flop_rate']:.3g} FLOP/s, backward/forward {ratios['backward_ratio']:.2f}):")
    for key in ("full_over_ceiling", "adaptive_over_ceiling"):
        m, s = ratios["measured"][key], ratios["simulated"][key]
        print(f"  {key:22s} measured {m:.3f} simulated {s:.3f} ({s / m - 1:+.1%})")
    print(f"  adaptive decisions: runtime {ratios['runtime_decisions']} (last step) sim "
          f"{ratios['sim_decisions']} (4 steps); runtime overruns {ratios['overruns']}")
    print(f"  diagnostics (not simulated): the guard keeping everything, no limit: "
          f"{ratios['guard_none_over_ceiling']:.3f} of the ceiling; plain torch checkpointing "
          f"of every block, no guard: {ratios['plain_checkpoint_over_plain']:.3f}")
    if args.pp_ep:
        from spikeguard.sim.validate_pp import compare_pp_ep
        pp_ep = compare_pp_ep(steps=args.steps)
        print("PP=2 x EP=2, 4 processes: peak bytes per step per stage (worst rank of the stage):")
        for policy, row in pp_ep["policies"].items():
            errs = [p / m - 1 for ms, ps in zip(row["measured"], row["predicted"])
                    for m, p in zip(ms, ps)]
            print(f"  {policy:9s} budget {row['budget']}: measured {row['measured']} predicted "
                  f"{row['predicted']} worst error {max(errs, key=abs):+.2%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
