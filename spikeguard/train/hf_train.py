"""`spikeguard train --hf NAME_OR_JSON`: a tiny transformers MoE model, trained under the guard.

    .venv/bin/spikeguard train --hf mixtral --steps 20 --policy adaptive
    .venv/bin/spikeguard train --hf path/to/config.json --budget 3MiB --policy none

B = sequences per micro-batch, T = sequence length (tokens are bytes of the corpus).

The model is built offline at small sizes with random weights (hf_models), trained with
AdamW on the default corpus (or --data), each micro-batch's loss being transformers' own
(shifted cross-entropy plus the router's load-balancing term), so a user can watch the
guard on their architecture without a GPU. Without --budget the budget is 0.85 x the peak
of an unguarded training step (forwards, backwards and the AdamW step, with AdamW's state
resident), measured first on the guard's emulated device (CPU). Each step runs through
`guard.run_step`, whose safety net reaches backward.
"""

from __future__ import annotations

import contextlib
import copy
import time
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from spikeguard.integrations.hf_models import HFSizes, build_hf_model, tiny_config

AUTO_BUDGET_FRACTION = 0.85
UNLIMITED = 1 << 50


def _window(corpus, split: str, batch_size: int, seq_len: int, gen) -> torch.Tensor:
    """(B, T+1) token windows: transformers shifts the labels inside its loss."""
    idx_BT, targets_BT = corpus.get_batch(split, batch_size, seq_len, gen)
    return torch.cat([idx_BT, targets_BT[:, -1:]], dim=1)


@torch.no_grad()
def evaluate(model: nn.Module, windows: list[torch.Tensor]) -> float:
    """Mean next-token cross-entropy (no load-balancing term) over fixed windows."""
    was_training = model.training
    model.eval()
    try:
        losses = []
        for w_BT in windows:
            logits = model(input_ids=w_BT[:, :-1]).logits
            losses.append(F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                          w_BT[:, 1:].reshape(-1)))
    finally:
        model.train(was_training)
    return torch.stack(losses).mean().item()


def measure_unguarded_peak(model: nn.Module, optimizer, windows: list[torch.Tensor]) -> int:
    """Peak device bytes of a training step with everything kept and no limit: every
    micro-batch's forward and backward, then the optimizer step (its foreach temporaries
    beside parameters, gradients and state). Two steps are run and the larger peak taken:
    the first has no optimizer state during its backward (its optimizer step creates it),
    every later step has. Parameters, optimizer state and random generators come back as
    they were, and no gradient is left."""
    import spikeguard

    params = [p for p in model.parameters()]
    with torch.no_grad():
        weights = [p.detach().clone() for p in params]
    state = copy.deepcopy(optimizer.state_dict())
    peak = 0

    def micro_batches() -> None:
        for w_BT in windows:
            (model(input_ids=w_BT, labels=w_BT).loss / len(windows)).backward()

    with torch.random.fork_rng(devices=[]):
        guard = spikeguard.attach(model, budget=UNLIMITED, policy="none", optimizer=optimizer)
        try:
            for _ in range(2):
                optimizer.zero_grad(set_to_none=True)
                guard.run_step(micro_batches)
                optimizer.step()
                # The device's peak since the step opened: the optimizer step's included.
                peak = max(peak, guard.history[-1]["peak_bytes"], guard.meter.peak())
        finally:
            guard.detach()
            optimizer.zero_grad(set_to_none=True)
            with torch.no_grad():
                for p, w in zip(params, weights):
                    p.copy_(w)
            optimizer.load_state_dict(state)
    return peak


def train_hf(source: str, sizes: HFSizes, train_cfg, *, corpus, budget: Optional[int],
             policy: Optional[str], log_path=None, say=print) -> list[dict[str, Any]]:
    """Train a tiny `source` model under the guard; returns one record per step."""
    import spikeguard
    from spikeguard.memory.budget import format_bytes
    from spikeguard.train.log import open_log, step_line, write_record
    from spikeguard.train.loop import make_optimizer

    corpus.check_seq_len(sizes.seq_len)
    model = build_hf_model(source, sizes, seed=train_cfg.seed)
    num_params = sum(p.numel() for p in model.parameters())
    say(f"model {source} ({model.config.model_type}, transformers, random weights): "
        f"{sizes.num_layers} layers, {sizes.num_experts} experts top-{sizes.top_k}, "
        f"{num_params / 1e6:.2f}M params | {train_cfg.steps} steps x "
        f"{train_cfg.micro_batches * train_cfg.batch_size * (sizes.seq_len + 1)} tokens")
    train_gen = torch.Generator().manual_seed(train_cfg.seed)
    val_gen = torch.Generator().manual_seed(train_cfg.seed + 1_000_003)
    val = [_window(corpus, "val", train_cfg.batch_size, sizes.seq_len, val_gen)
           for _ in range(train_cfg.eval_batches)]
    val_loss_init = evaluate(model, val)
    optimizer = make_optimizer(model, train_cfg)
    if budget is None:
        probe_gen = torch.Generator().manual_seed(train_cfg.seed + 7)
        peak = measure_unguarded_peak(model, optimizer, [
            _window(corpus, "train", train_cfg.batch_size, sizes.seq_len, probe_gen)
            for _ in range(train_cfg.micro_batches)])
        budget = int(AUTO_BUDGET_FRACTION * peak)
        say(f"memory: CPU run, emulated device; budget {format_bytes(budget)} = "
            f"{AUTO_BUDGET_FRACTION} x the unguarded peak {format_bytes(peak)}")
    else:
        say(f"memory: CPU run, emulated device; budget {format_bytes(budget)}")
    guard = spikeguard.attach(model, budget=budget, policy=policy or "adaptive",
                              optimizer=optimizer)
    say(f"guard: {len(guard.moe_blocks)} MoE blocks ({type(guard.moe_blocks[0]).__name__}), "
        f"experts call planned as one region; bytes per routed copy {guard.shape.source}: "
        f"keep {guard.shape.save_per_token} B, recompute keeps {guard.shape.recompute_per_token} B")
    records = []
    with contextlib.ExitStack() as stack:
        log_file = stack.enter_context(open_log(log_path)) if log_path is not None else None
        model.train()
        for step in range(1, train_cfg.steps + 1):
            record = {"step": step, **_step(model, optimizer, guard, corpus, train_cfg,
                                            sizes.seq_len, train_gen)}
            if step == 1:
                record["val_loss_init"] = val_loss_init
            if step % train_cfg.eval_every == 0 or step == train_cfg.steps:
                record["val_loss"] = evaluate(model, val)
            for key, value in guard.history[-1].items():
                record.setdefault(key, value)
            record["imbalance"] = guard.history[-1]["max_imbalance"]
            records.append(record)
            if log_file is not None:
                write_record(log_file, record)
            say(step_line(record, train_cfg.steps))
    guard.detach()
    return records


def _step(model, optimizer, guard, corpus, cfg, seq_len: int, gen) -> dict[str, Any]:
    start_s = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    # Drawn before the step: a re-run by the guard's safety net sees the same data.
    windows = [_window(corpus, "train", cfg.batch_size, seq_len, gen)
               for _ in range(cfg.micro_batches)]

    def micro_batches() -> float:
        total = 0.0
        for w_BT in windows:
            loss = model(input_ids=w_BT, labels=w_BT).loss
            (loss / cfg.micro_batches).backward()
            total += loss.item()
        return total

    loss_sum = guard.run_step(micro_batches)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    optimizer.step()
    seconds = time.perf_counter() - start_s
    tokens = cfg.micro_batches * cfg.batch_size * (seq_len + 1)
    return {"loss": loss_sum / cfg.micro_batches, "grad_norm": grad_norm.item(),
            "tokens": tokens, "step_time_s": seconds, "tokens_per_s": tokens / seconds}


# Flags of `spikeguard train` that belong to the built-in model's runs, not to --hf.
_NOT_WITH_HF = (("nproc", 1), ("ep", None), ("skew", None), ("trace", None),
                ("record_trace", None), ("checkpoint_dir", None), ("resume", False),
                ("skip_steps", None))


def run_from_cli(args) -> int:
    """The `--hf` branch of `spikeguard train` (spikeguard.cli): checks, then trains."""
    from rich.console import Console

    from spikeguard.data.corpus import load_corpus
    from spikeguard.errors import UsageError
    from spikeguard.memory.budget import parse_bytes
    from spikeguard.train.log import check_log_path, format_rate
    from spikeguard.train.loop import TrainConfig, summarize

    for name, default in _NOT_WITH_HF:
        if getattr(args, name, default) != default:
            raise UsageError(f"--{name.replace('_', '-')} is not available with --hf yet")
    given = {k: v for k, v in dict(
        d_model=args.d_model, num_layers=args.num_layers, num_experts=args.num_experts,
        top_k=args.top_k, d_expert=args.d_expert, seq_len=args.seq_len).items() if v is not None}
    sizes = HFSizes(**given)
    tiny_config(args.hf, sizes)  # a bad name or JSON fails here, before any work
    train_cfg = TrainConfig(**{k: v for k, v in dict(
        steps=args.steps, batch_size=args.batch_size, micro_batches=args.micro_batches,
        lr=args.lr, weight_decay=args.weight_decay, grad_clip=args.grad_clip, seed=args.seed,
        eval_every=args.eval_every, eval_batches=args.eval_batches).items() if v is not None})
    budget = None if args.budget in (None, "auto") else parse_bytes(args.budget)
    if args.log is not None:
        check_log_path(args.log)
    if args.threads is not None and args.threads <= 0:
        raise UsageError(f"--threads must be a positive integer, got {args.threads}")
    corpus = load_corpus(args.data)
    console = Console()

    def say(text: str) -> None:
        console.print(text, soft_wrap=True, markup=False, highlight=False)

    threads_before = torch.get_num_threads()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    try:
        say(f"data: {corpus.source}")
        records = train_hf(args.hf, sizes, train_cfg, corpus=corpus, budget=budget,
                           policy=args.policy, log_path=args.log, say=say)
    finally:
        torch.set_num_threads(threads_before)
    s = summarize(records)
    say(f"done: {s['steps']} steps in {s['train_time_s']:.2f} s (training only) | train loss "
        f"{s['loss_first']:.3f} -> {s['loss_last']:.3f} | val loss {s['val_loss_init']:.3f} -> "
        f"{s['val_loss_final']:.3f} | {format_rate(s['tokens_per_s'])} tok/s (CPU, emulated device)")
    return 0
