"""What recording every backward's collectives costs under transformers' EP with FSDP2.

    .venv/bin/torchrun --nproc-per-node 2 scripts/hf_ep_span_cost.py --reps 7

A tiny Qwen3-MoE (2 layers, width 32, 4 experts) under `DistributedConfig(fsdp_size=2,
ep_size=2)`, 2 gloo ranks, policy adaptive with no budget (calm steps), 2 micro-batches of
4 x 33 tokens per rank and step, forward and backward. Each round times 10 steps (after
one untimed) in three modes, on a fresh model each: "off" (`Span.begin` a no-op: no
template, so a backward refusal would end the job), "every" (every backward watched by
the recording mode: a key never confirmed, as before spans were confirmed) and "on"
(as shipped: a key's span watched until seen twice alike, then only counted); the order
rotates, the first round is a warm-up. Prints the median and spread of seconds per step
(wall clock and this process's CPU) of rank 0. CPU, emulated device.
"""

from __future__ import annotations

import sys
import statistics
import time

import torch
import torch.distributed as dist

import spikeguard
from spikeguard.errors import ArgumentParser, UsageError
from spikeguard.parallel import family_backward, family_journal
from spikeguard.parallel.launch_utils import run_under_torchrun

STEPS = 10


def build():
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.distributed.configuration_utils import DistributedConfig
    cfg = AutoConfig.for_model(
        "qwen3_moe", hidden_size=32, intermediate_size=32, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        vocab_size=256, num_experts=4, num_experts_per_tok=2, use_cache=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).float()
    kind = type(model)
    dc, _, mesh = kind.prepare_distribute_model(DistributedConfig(fsdp_size=2, ep_size=2))
    return kind.maybe_distribute_model(model, dc, mesh)


def timed(mode: str) -> tuple[float, float]:
    """Seconds per step (wall, CPU) of STEPS calm steps in `mode` (off, every, on)."""
    begin, alike = family_backward.Span.begin, family_journal.alike
    if mode == "off":
        family_backward.Span.begin = lambda self: None
    elif mode == "every":
        family_journal.alike = lambda template, span: False
    try:
        model = build()
        guard = spikeguard.attach(model, budget=1 << 40, policy="adaptive")
        gen = torch.Generator().manual_seed(dist.get_rank())
        data = [torch.randint(0, 256, (4, 33), generator=gen) for _ in range(2)]

        def body():
            for w in data:
                model(input_ids=w, labels=w).loss.backward()
        guard.run_step(body)
        dist.barrier()
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(STEPS):
            guard.run_step(body)
        dist.barrier()
        out = ((time.perf_counter() - wall) / STEPS, (time.process_time() - cpu) / STEPS)
        guard.detach()
        return out
    finally:
        family_backward.Span.begin, family_journal.alike = begin, alike


def main() -> None:
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7)
    try:
        args = parser.parse_args()
        if args.reps <= 0:
            raise UsageError(f"--reps must be positive, got {args.reps}")
    except UsageError as err:
        print(f"hf_ep_span_cost: {err}", file=sys.stderr)
        sys.exit(2)
    torch.set_num_threads(1)
    run_under_torchrun(lambda group: _measure(args))   # no model outlives timed()


def _measure(args) -> None:
    modes = ("off", "every", "on")
    rows = {mode: [] for mode in modes}
    for rep in range(args.reps + 1):
        for mode in modes[rep % 3:] + modes[:rep % 3]:
            got = timed(mode)
            if rep:
                rows[mode].append(got)
    if dist.get_rank() == 0:
        for mode in modes:
            for i, clock in enumerate(("wall", "cpu")):
                v = [r[i] * 1e3 for r in rows[mode]]
                print(f"recording {mode:5s} {clock:4s} {statistics.median(v):6.1f} ms/step "
                      f"({min(v):.1f}-{max(v):.1f})")


if __name__ == "__main__":
    main()
