"""The guard's own cost on calm steps: the plain model vs policy none vs adaptive.

    .venv/bin/python scripts/calm_overhead.py --reps 15               # one process
    .venv/bin/torchrun --nproc-per-node 2 scripts/calm_overhead.py --reps 15   # EP=2
    .venv/bin/python scripts/calm_overhead.py --profile adaptive      # cProfile of one policy
    .venv/bin/python scripts/calm_overhead.py --hf qwen3_moe --clock cpu   # a transformers model
    .venv/bin/python scripts/calm_overhead.py --titan deepseek_v3 --clock cpu   # a torchtitan one
    .venv/bin/torchrun --nproc-per-node 1 scripts/calm_overhead.py --titan deepseek_v3 --fsdp

The built-in `small` model, 1 micro-batch of 8 x 128 tokens per rank (the bench's calm
step), forward and backward, no optimizer step (so routing stays where it is, and every
step is calm). Three copies of the same model take turns every step in one process
(`plain`: no guard; `none`: a guard of policy none, which pays the device counter and the
saved-tensor hooks; `adaptive`), so the machine's noise hits all alike; the first round
warms up and is dropped. Budget: the calm step's true peak plus 10% (`--budget-factor`;
calm steps fit, so adaptive keeps everything). Prints medians and the spread
(lowest-highest) of seconds per step, and of the per-round ratio plain/this its median with
a 95% interval of that median (spikeguard/bench/spread.py: order statistics, no assumed
distribution; a cost "under 2%" is shown only where the interval's low end is >= 0.98), the
range, and the rounds that would resolve +-0.01; then the bytes adaptive evicted per step, the
layers it ran hookless (spikeguard/runtime/hookless.py) and the forwards it ran calm, as
the plain model's own (spikeguard/runtime/calm_forward.py), with those that left calm at a
layer.
`--clock cpu` times this process's CPU only: steadier on a shared machine, blind to
waiting in collectives. `--hf NAME` measures a transformers MoE model instead (hf_bench's
sizes: 4 layers, 8 experts, top-2, width 128; under torchrun laid out with transformers' own
`DistributedConfig(fsdp_size=N, ep_size=N)`), 8 x 128 tokens per rank likewise; `--titan
NAME` a torchtitan one (spikeguard.integrations.titan_models, the same sizes; under torchrun
torchtitan's own expert parallelism over the N ranks); with `--fsdp` laid out as
torchtitan's Trainer lays it out (its own parallelize function: FSDP2 over the N ranks, one
included, and its EP over them where N > 1; spikeguard.integrations.titan_models
`build_titan_fsdp_model`). CPU figures: the device is emulated.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import time
import warnings

import torch

import spikeguard
from spikeguard.bench.spread import interval, ratio_spread, rounds_text
from spikeguard.data.corpus import load_corpus
from spikeguard.errors import UsageError
from spikeguard.model import build_model, model_config
from spikeguard.parallel.launch_utils import run_under_torchrun

POLICIES = ("plain", "none", "adaptive")


def _setup(group, hf: str, titan: str = "", fsdp: bool = False):
    cfg = model_config("small")
    corpus = load_corpus(None)
    rank = group.rank() if group is not None else 0
    gen = torch.Generator().manual_seed(100 + rank)
    batches = [corpus.get_batch("train", 8, cfg.seq_len, gen)]
    if hf:
        return cfg, batches, _hf_models(hf, group)
    if titan:
        return cfg, batches, _titan_models(titan, group, cfg.seq_len, fsdp)
    models = {}
    for p in POLICIES:
        model = build_model(cfg, seed=0)
        if group is not None:
            from spikeguard.parallel import parallelize_experts
            parallelize_experts(model, group)
        models[p] = model
    return cfg, batches, models


def _hf_models(name: str, group) -> dict:
    from spikeguard.integrations.hf_models import HFSizes, build_hf_model, distribute_hf_model

    models = {}
    for p in POLICIES:
        model = build_hf_model(name, HFSizes(d_model=128, num_layers=4, d_expert=128),
                               seed=0)   # hf_bench's sizes
        if group is not None:
            model = distribute_hf_model(model, group.size(), group.size())
        models[p] = model
    return models


def _titan_models(name: str, group, seq_len: int, fsdp: bool) -> dict:
    from spikeguard.integrations.titan_models import (TitanSizes, build_titan_fsdp_model,
                                                      build_titan_model)
    warnings.filterwarnings("ignore", message="In CPU autocast")   # as titan_ratios does
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    sizes = TitanSizes(d_model=128, num_layers=4, d_expert=128, seq_len=seq_len)
    ep = group.size() if group is not None else 1
    if fsdp:
        return {p: build_titan_fsdp_model(name, sizes, group.size(), seed=0, ep=ep)
                for p in POLICIES}
    return {p: build_titan_model(name, sizes, seed=0, ep=ep) for p in POLICIES}


CLOCK = time.perf_counter


def _step(model, batches) -> None:
    for idx_BT, targets_BT in batches:
        if getattr(model, "config", None) is not None and hasattr(model.config, "model_type"):
            # a transformers model: the labels are the window itself (it shifts them)
            w_BT = torch.cat([idx_BT, targets_BT[:, -1:]], dim=1)
            model(input_ids=w_BT, labels=w_BT).loss.backward()
        elif any(c.__module__.startswith("torchtitan") for c in type(model).__mro__):
            # (FSDP2 makes the model's class a subclass of torchtitan's)
            from spikeguard.integrations.titan_models import lm_loss
            lm_loss(model, idx_BT, targets_BT).backward()
        else:
            model(idx_BT, targets_BT).loss.backward()


def _budget(models, batches, group, factor: float) -> int:
    probe = spikeguard.attach(models["none"], budget=1 << 50, policy="none")
    probe.run_step(lambda: _step(models["none"], batches))
    peak = probe.history[-1]["peak_bytes"]
    probe.detach()
    if group is not None:
        t = torch.tensor([peak])
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        peak = int(t.item())
    return int(peak * factor)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--profile", choices=POLICIES, default=None,
                        help="cProfile --reps steps of this policy instead of timing")
    parser.add_argument("--budget-factor", type=float, default=1.1,
                        help="budget = this x the calm step's true peak (worst rank)")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="cpu: this process's CPU time (less noisy on a shared machine)")
    parser.add_argument("--hf", default="", help="a transformers MoE model type (qwen3_moe, "
                        "mixtral, olmoe) instead of the built-in small")
    parser.add_argument("--titan", default="", help="a torchtitan MoE (deepseek_v3, qwen3) "
                        "instead of the built-in small")
    parser.add_argument("--fsdp", action="store_true", help="with --titan, under torchrun "
                        "(one rank included): FSDP2 as torchtitan's Trainer applies it")
    args = parser.parse_args()
    if args.reps < 1 or args.threads < 1 or args.budget_factor <= 0 or (args.hf and args.titan):
        parser.exit(2, "calm_overhead.py: --reps and --threads take 1 or more, "
                    "--budget-factor a positive number; --hf or --titan, not both\n")
    if args.fsdp and not (args.titan and "WORLD_SIZE" in os.environ):
        parser.exit(2, "calm_overhead.py: --fsdp goes with --titan, under torchrun "
                    "(--nproc-per-node 1 for one rank)\n")
    global CLOCK
    CLOCK = time.process_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(args.threads)
    if "WORLD_SIZE" in os.environ and (int(os.environ["WORLD_SIZE"]) > 1 or args.fsdp):
        # the models live in _measure's frame: gone before the group is closed
        run_under_torchrun(lambda group: _measure(args, parser, group))
    else:
        _measure(args, parser, None)


def _measure(args, parser, group) -> None:
    try:   # an unknown model type: one line, exit 2
        cfg, batches, models = _setup(group, args.hf, args.titan, args.fsdp)
    except UsageError as err:
        parser.exit(2, f"calm_overhead.py: {err}\n")
    budget = _budget(models, batches, group, args.budget_factor)
    guards = {p: spikeguard.attach(models[p], budget=budget, policy=p)
              for p in POLICIES if p != "plain"}

    def run(p):
        """One step, timed whole (the guard's step scope included); the gradients are
        dropped first, as after an optimizer step (zero_grad's default)."""
        models[p].zero_grad(set_to_none=True)
        start = CLOCK()
        if p in guards:
            guards[p].run_step(lambda: _step(models[p], batches))
        else:
            _step(models[p], batches)
        return CLOCK() - start

    rank0 = group is None or group.rank() == 0
    if args.profile:
        run(args.profile)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.reps):
            run(args.profile)
        prof.disable()
        if rank0:
            pstats.Stats(prof).sort_stats("tottime").print_stats(30)
            pstats.Stats(prof).sort_stats("cumulative").print_stats(40)
        _detach(guards)
        return
    times = {p: [] for p in POLICIES}
    for rep in range(args.reps + 1):
        for p in POLICIES:
            seconds = run(p)
            if rep:
                times[p].append(seconds)
    evicted, hookless, calm = {}, {}, {}
    for p, g in guards.items():
        d = g.history[-1]["decisions"]
        assert d["recompute"] == 0 and d["offload"] == 0, (p, d)
        evicted[p] = sum(r["evicted_bytes"] for r in g.history[1:]) / max(1, len(g.history) - 1)
        hookless[p] = sum(r.get("hookless_layers", 0) for r in g.history[1:]) \
            / max(1, len(g.history) - 1)
        calm[p] = (sum(r["calm_forwards"] for r in g.history[1:]) / max(1, len(g.history) - 1),
                   sum(r["calm_left"] for r in g.history[1:]) / max(1, len(g.history) - 1))
    if rank0:
        where = f"EP={group.size()}" if group is not None else "one process"
        if args.fsdp:
            where = "FSDP2 on one rank" if group.size() == 1 else \
                f"FSDP2 over {group.size()} ranks, EP={group.size()}"
        name = args.hf or args.titan or "small"
        print(f"calm step of {name}, 8 x {cfg.seq_len} tokens per rank, {where}, "
              f"{args.reps} rounds, {args.threads} thread(s), {args.clock} clock, "
              f"budget {budget / 2**20:.1f} MiB")
        for p in POLICIES:
            s = ratio_spread(times[p], times["plain"])
            print(f"  {p:9s} {statistics.median(times[p]) * 1e3:7.1f} ms "
                  f"({min(times[p]) * 1e3:.1f}-{max(times[p]) * 1e3:.1f})   plain/this "
                  f"{s['median']:.3f} [95% {interval(s)}] ({rounds_text(s)})"
                  + (f"   evicted {evicted[p] / 2**20:.1f} MiB/step, hookless layers "
                     f"{hookless[p]:.1f}/step, calm forwards {calm[p][0]:.2f}/step"
                     + (f" ({calm[p][1]:.2f} left calm)" if calm[p][1] else "")
                     if p in evicted else ""))
    _detach(guards)


def _detach(guards: dict) -> None:
    """An attached guard's tensor hooks on its blocks' aux-loss graphs keep it, its model
    and the group alive past gc (see launch_utils.run_under_torchrun): detached here."""
    for g in guards.values():
        g.detach()


if __name__ == "__main__":
    main()
