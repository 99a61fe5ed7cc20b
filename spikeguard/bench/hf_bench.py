"""Throughput of a Hugging Face MoE model under the guard, side by side (CPU figures).

    .venv/bin/python -m spikeguard.bench.hf_bench --hf mixtral --reps 9

One process, the same batches for every policy, runs interleaved (ceiling, none, full,
experts, adaptive, ceiling, ...) so machine noise hits all alike; medians of the reps
after one warm-up round, each ratio per round with its spread. The ceiling is the plain
transformers model, no guard, no limit;
"none" is the guard with an unlimited budget (its bookkeeping alone); the rest run under
`--fraction` x the ceiling's peak (the device's true peak with everything kept). On a
CPU-only machine the device is emulated by the CPU allocator (every live storage): these
are CPU figures, not GPU ones.

Under transformers' own expert parallelism, every model laid out with
`DistributedConfig(fsdp_size=N, ep_size=N)` and each rank on its own batches:

    .venv/bin/python -m torch.distributed.run --standalone --nproc-per-node 2 \
        -m spikeguard.bench.hf_bench --hf qwen3_moe --ep 2

The budget is the fraction of the worst rank's ceiling peak; the times are rank 0's (the
exchanges keep the ranks in step); rank 0 prints. Every ratio is per round, the ceiling's
seconds over the policy's in the same round: the median over the reps with its quartiles
and the rounds a +-0.01 would need (spikeguard.bench.spread, as runtime_ratios prints it).
"""

from __future__ import annotations

import sys
import time

import torch

import spikeguard
from spikeguard.bench.runtime_ratios import print_table, summarize_ratios, time_interleaved
from spikeguard.data.corpus import load_corpus
from spikeguard.errors import UsageError
from spikeguard.integrations.hf_models import HFSizes, build_hf_model, distribute_hf_model

POLICIES = ("ceiling", "none", "full", "experts", "adaptive")
UNLIMITED = 1 << 50


def _step(model, windows) -> float:
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    for w_BT in windows:
        model(input_ids=w_BT, labels=w_BT).loss.backward()
    return time.perf_counter() - start


def _guarded_step(model, guard, windows) -> float:
    with guard.step():
        return _step(model, windows)


def _world_max(value: int, ep: int) -> int:
    if ep == 1:
        return value
    import torch.distributed as dist
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def measure(source: str, sizes: HFSizes, batch_size: int, micro_batches: int, reps: int,
            fraction: float, seed: int = 0, ep: int = 1, rank: int = 0) -> dict:
    corpus = load_corpus(None)
    gen = torch.Generator().manual_seed(seed + 1000 * rank)   # each rank its own data
    windows = []
    for _ in range(micro_batches):
        idx_BT, targets_BT = corpus.get_batch("train", batch_size, sizes.seq_len, gen)
        windows.append(torch.cat([idx_BT, targets_BT[:, -1:]], dim=1))

    def build():
        model = build_hf_model(source, sizes, seed=seed)
        return model if ep == 1 else distribute_hf_model(model, ep, ep)
    models = {p: build() for p in POLICIES}
    probe = spikeguard.attach(build(), budget=UNLIMITED, policy="none")
    _guarded_step(probe.model, probe, windows)
    ceiling_peak = _world_max(probe.history[-1]["peak_bytes"], ep)
    probe.detach()
    budget = int(fraction * ceiling_peak)
    guards = {p: spikeguard.attach(models[p], budget=UNLIMITED if p == "none" else budget,
                                   policy=p) for p in POLICIES if p != "ceiling"}
    times = time_interleaved(models, guards, windows, reps, POLICIES, step=_step)
    tokens = batch_size * micro_batches * (sizes.seq_len + 1)
    layout = f", transformers' EP {ep} x FSDP2, rank 0's times" if ep > 1 else ""
    result = summarize_ratios(times, guards, tokens, ceiling_peak, budget,
                              f"{source} (transformers{layout})")
    # Under EP: every rank's worst peak against the budget (the table shows rank 0's).
    result["world_peak_bytes"] = {p: _world_max(result["policies"][p]["peak_bytes"], ep)
                                  for p in POLICIES}
    return result


def main(argv=None) -> int:
    from spikeguard.errors import ArgumentParser
    from spikeguard.train.config import MAX_THREADS

    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hf", default="mixtral", help="model type or config JSON")
    for flag, default in (("--d-model", 128), ("--num-layers", 4), ("--num-experts", 8),
                          ("--top-k", 2), ("--d-expert", 128), ("--seq-len", 128)):
        parser.add_argument(flag, type=int, default=default)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--micro-batches", type=int, default=2)
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--fraction", type=float, default=0.85)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1,
                        help="under torchrun: transformers' EP over the N ranks (N = --ep)")
    try:
        args = parser.parse_args(argv)   # a mistake is one line (UsageError), no abbreviation
        for name in ("batch_size", "micro_batches", "reps"):
            if getattr(args, name) <= 0:
                raise UsageError(f"--{name.replace('_', '-')} must be positive")
        if not 0 < args.threads <= MAX_THREADS:
            raise UsageError(f"--threads must be in [1, {MAX_THREADS}], got {args.threads}")
        if not 0 < args.fraction <= 1:
            raise UsageError(f"--fraction must be in (0, 1], got {args.fraction}")
        sizes = HFSizes(d_model=args.d_model, num_layers=args.num_layers,
                        num_experts=args.num_experts, top_k=args.top_k,
                        d_expert=args.d_expert, seq_len=args.seq_len)
        from spikeguard.model.config import activation_bytes_floor, check_trainable_size
        check_trainable_size(sizes.num_params, activation_bytes_floor(   # train's own check
            args.batch_size * sizes.seq_len, getattr(sizes, "vocab_size", 256), sizes.d_model,
            sizes.num_layers), f"model {args.hf}")
        torch.set_num_threads(args.threads)
        if args.ep == 1:
            _report(args, sizes, 0)
        else:
            _check_world(args.ep)
            from spikeguard.parallel.launch_utils import run_under_torchrun
            # the models live in measure's frame: gone before the group is closed
            run_under_torchrun(lambda group: _report(args, sizes, group.rank()))
    except UsageError as err:
        print(f"spikeguard: error: {err}", file=sys.stderr)
        return 2
    return 0


def _report(args, sizes: HFSizes, rank: int) -> None:
    result = measure(args.hf, sizes, args.batch_size, args.micro_batches, args.reps,
                     args.fraction, ep=args.ep, rank=rank)
    if rank == 0:
        print_table(result)
        print("worst rank's peak: " + " | ".join(
            f"{p} {v / 2**20:.2f} MiB" for p, v in result["world_peak_bytes"].items()))


def _check_world(ep: int) -> None:
    """--ep > 1 runs under torchrun with that many processes."""
    import os
    if int(os.environ.get("WORLD_SIZE", "1")) != ep:
        raise UsageError(f"--ep {ep} runs under torchrun with {ep} processes "
                         f"(python -m torch.distributed.run --standalone --nproc-per-node {ep} "
                         f"-m spikeguard.bench.hf_bench ... --ep {ep})")


if __name__ == "__main__":
    sys.exit(main())
