"""The training loop: AdamW, gradient accumulation over micro-batches, validation, logging.

    .venv/bin/spikeguard train --preset tiny --steps 50

B = sequences per micro-batch, T = sequence length, E = experts per MoE layer.

The memory guard (spikeguard.runtime) is applied from outside through one seam: all
micro-batches of a step run forward and backward inside `guard.run_step(fn)` (which
re-runs the step whole if the device runs out of memory anywhere in it), and the
guard's record of that step (`guard.history[-1]`: peak bytes, budget, decisions) is merged
into the step record. The optimizer is built before the guard because the guard may need
it (to count optimizer state against the budget), hence `guard_factory(model, optimizer)`.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Collection, Iterator, Optional, Sequence

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from torch import nn

from spikeguard.data.corpus import Corpus
from spikeguard.errors import UsageError
from spikeguard.model.config import ModelConfig
from spikeguard.model.dispatch import expert_imbalance
from spikeguard.train.log import open_log, step_line, write_record

# (model, optimizer) -> guard; the guard offers `step()` (a context manager) and `history`.
GuardFactory = Callable[[nn.Module, torch.optim.Optimizer], Any]

# Validation windows come from their own generator so that changing eval_batches or
# eval_every never changes the training batches (and so the training losses).
_VAL_SEED_OFFSET = 1_000_003


@dataclass(kw_only=True)
class TrainConfig:
    """How long and how to train; validated on creation (UsageError on a bad value)."""

    steps: int = 100
    batch_size: int = 8          # sequences per micro-batch
    micro_batches: int = 1       # micro-batches accumulated into one optimizer step
    lr: float = 3e-3
    weight_decay: float = 0.1
    grad_clip: float = 1.0       # max global gradient norm
    seed: int = 0
    eval_every: int = 50         # steps between validation losses (also one at the end)
    eval_batches: int = 4        # fixed validation batches of batch_size sequences

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "micro_batches", "eval_every", "eval_batches"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise UsageError(f"train.{name} must be a positive integer, got {value!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0:
            raise UsageError(f"train.seed must be a non-negative integer, got {self.seed!r}")
        for name in ("lr", "grad_clip"):
            value = getattr(self, name)
            if not _is_real(value) or not math.isfinite(value) or value <= 0:
                raise UsageError(f"train.{name} must be a positive number, got {value!r}")
        if not _is_real(self.weight_decay) or not math.isfinite(self.weight_decay) \
                or self.weight_decay < 0:
            raise UsageError(f"train.weight_decay must be >= 0, got {self.weight_decay!r}")

    def to_dict(self) -> dict:
        return asdict(self)


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def make_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW; weight decay only on matrices (decaying norm gains and biases pulls them
    toward zero for no regularisation benefit)."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.dim() >= 2 else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr)


@torch.no_grad()
def evaluate(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Mean cross-entropy (without the load-balancing term) over fixed batches."""
    was_training = model.training
    model.eval()
    try:
        losses = [model(idx_BT, targets_BT).ce_loss for idx_BT, targets_BT in batches]
    finally:
        model.train(was_training)
    return torch.stack(losses).mean().item()


class _Reporter:
    """Step lines to the console; a rich progress bar on top when it is a terminal."""

    def __init__(self, console: Console, progress: Optional[Progress], task_id: Any):
        self.console, self.progress, self.task_id = console, progress, task_id

    def line(self, text: str) -> None:
        # soft_wrap: a long line stays one line in a pipe or file (rich wraps at 80 there).
        self.console.print(text, soft_wrap=True, markup=False, highlight=False)

    def advance(self) -> None:
        if self.progress is not None:
            self.progress.advance(self.task_id)


@contextlib.contextmanager
def _reporter(console: Console, num_steps: int) -> Iterator[_Reporter]:
    if not console.is_terminal:
        yield _Reporter(console, None, None)
        return
    progress = Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(),
                        TimeRemainingColumn(), console=console)
    with progress:
        yield _Reporter(progress.console, progress, progress.add_task("train", total=num_steps))


def train(model: nn.Module, model_cfg: ModelConfig, train_cfg: TrainConfig, corpus: Corpus, *,
          guard: Any = None, guard_factory: Optional[GuardFactory] = None,
          log_path: Optional[str | Path] = None,
          console: Optional[Console] = None, parallel: Any = None,
          observers: Sequence[Any] = (), checkpoint: Any = None,
          skip_steps: Collection[int] = ()) -> list[dict[str, Any]]:
    """Train `model` in place for `train_cfg.steps` steps; returns one record per step.

    Records hold step, loss (the objective: cross-entropy + aux), ce_loss, aux_loss,
    grad_norm, tokens, step_time_s, tokens_per_s, imbalance (worst layer),
    imbalance_per_layer, val_loss on evaluation steps, val_loss_init (the initial weights'
    validation loss) on the first record, plus whatever the guard recorded for the step.

    `parallel` (spikeguard.parallel.training.ExpertParallelHooks) makes this one rank of an
    expert-parallel group: its own data shard, scaled loss, gradient all-reduce, skew
    steering, and a cluster summary in every record; only the main rank prints.

    `observers` (e.g. spikeguard.routing.trace's recorder and replayer) get
    `before_step(step)` before a step's first forward and `after_step(step, record)` after
    its optimizer update, on every rank in the same order.

    `checkpoint` (spikeguard.train.checkpoint.Checkpointer) resumes from its last save and
    saves on its interval; `skip_steps` are dropped (their data drawn, nothing trained), as a
    job restarted after a crash drops the batch that killed it.
    """
    if guard is not None and guard_factory is not None:
        raise UsageError("pass either guard or guard_factory to train(), not both")
    seq_len = model_cfg.seq_len
    corpus.check_seq_len(seq_len)
    console = console or Console()
    with contextlib.ExitStack() as stack:
        log_file = stack.enter_context(open_log(log_path)) if log_path is not None else None
        torch.manual_seed(train_cfg.seed)
        shard = parallel.seed_offset if parallel is not None else 0
        train_gen = torch.Generator().manual_seed(train_cfg.seed + shard)
        val_gen = torch.Generator().manual_seed(train_cfg.seed + _VAL_SEED_OFFSET + shard)
        val_batches = [corpus.get_batch("val", train_cfg.batch_size, seq_len, val_gen)
                       for _ in range(train_cfg.eval_batches)]
        optimizer = make_optimizer(model, train_cfg)
        start = checkpoint.restore(model, optimizer, train_gen) if checkpoint is not None else 0
        # Before the guard exists: the initial weights' loss needs no memory management.
        val_loss_init = evaluate(model, val_batches) if start == 0 else None
        if guard_factory is not None:
            guard = guard_factory(model, optimizer)
        model.train()
        records = []
        quiet = parallel is not None and not parallel.is_main
        reporter = stack.enter_context(_reporter(console, train_cfg.steps)) if not quiet else None

        def finish(record: dict[str, Any]) -> None:
            """Keep, log, print and checkpoint a finished (or dropped) step."""
            records.append(record)
            if log_file is not None:
                write_record(log_file, record)
            if reporter is not None:
                reporter.line(step_line(record, train_cfg.steps))
                reporter.advance()
            if checkpoint is not None:
                checkpoint.after_step(record["step"], model, optimizer, train_gen,
                                      last=record["step"] == train_cfg.steps)

        for step in range(start + 1, train_cfg.steps + 1):
            if step in skip_steps:
                _skip_step(train_cfg, corpus, train_gen, seq_len)
                finish({"step": step, "skipped": True, "tokens": 0, "step_time_s": 0.0})
                continue
            if parallel is not None:
                parallel.before_step(step)
            for observer in observers:
                observer.before_step(step)
            record = _train_step(model, optimizer, train_cfg, corpus, train_gen, seq_len, guard,
                                 parallel)
            record = {"step": step, **record}
            if step == 1 and val_loss_init is not None:
                record["val_loss_init"] = val_loss_init
            if step % train_cfg.eval_every == 0 or step == train_cfg.steps:
                record["val_loss"] = evaluate(model, val_batches)
            if guard is not None and getattr(guard, "history", None):
                # The loop's own keys win a name clash: "step" must stay the loop's count.
                for key, value in dict(guard.history[-1]).items():
                    record.setdefault(key, value)
            for observer in observers:
                observer.after_step(step, record)
            if parallel is not None:
                record.update(parallel.summarize(record, record.pop("_received_per_layer")))
            else:
                record.pop("_received_per_layer")
            finish(record)
    return records


def _skip_step(cfg: TrainConfig, corpus: Corpus, generator: torch.Generator, seq_len: int) -> None:
    """Draw the dropped step's micro-batches, so later steps see the data they would have."""
    for _ in range(cfg.micro_batches):
        corpus.get_batch("train", cfg.batch_size, seq_len, generator)


def _train_step(model: nn.Module, optimizer: torch.optim.Optimizer, cfg: TrainConfig,
                corpus: Corpus, generator: torch.Generator, seq_len: int,
                guard: Any, parallel: Any = None) -> dict[str, Any]:
    """One optimizer step over cfg.micro_batches micro-batches (gradient accumulation)."""
    moe_blocks = model.moe_blocks()
    imbalance_per_layer = [1.0] * len(moe_blocks)
    received_per_layer = [0] * len(moe_blocks)  # routed copies this process's experts got
    scale = parallel.loss_scale if parallel is not None else 1.0
    start_s = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    # Drawn before the step, so that a re-run of the step (the guard's safety net) sees the
    # same data and produces bitwise the same gradients.
    batches = [corpus.get_batch("train", cfg.batch_size, seq_len, generator)
               for _ in range(cfg.micro_batches)]

    def micro_batches() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        loss_sum, ce_sum, aux_sum = torch.zeros(()), torch.zeros(()), torch.zeros(())
        for i in range(len(moe_blocks)):
            imbalance_per_layer[i], received_per_layer[i] = 1.0, 0
        for idx_BT, targets_BT in batches:
            out = model(idx_BT, targets_BT)
            # Divide before backward so accumulated gradients equal the mean over
            # micro-batches, i.e. the gradient of one big batch.
            (out.loss / cfg.micro_batches * scale).backward()
            loss_sum += out.loss.detach()
            ce_sum += out.ce_loss.detach()
            aux_sum += out.aux_loss.detach()
            # A spike is a property of one micro-batch (that is what memory sees), so a
            # layer's imbalance for the step is its worst micro-batch, not the step's sum.
            for i, block in enumerate(moe_blocks):
                imbalance_per_layer[i] = max(imbalance_per_layer[i],
                                             expert_imbalance(block.last_tokens_per_expert))
                received_per_layer[i] = max(received_per_layer[i],
                                            sum(block.last_tokens_per_expert))
        return loss_sum, ce_sum, aux_sum

    if guard is None:
        loss_sum, ce_sum, aux_sum = micro_batches()
    elif hasattr(guard, "run_step"):
        loss_sum, ce_sum, aux_sum = guard.run_step(micro_batches)
    else:
        with guard.step():
            loss_sum, ce_sum, aux_sum = micro_batches()
    if parallel is not None:
        parallel.after_backward(model)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    optimizer.step()
    step_time_s = time.perf_counter() - start_s
    num_tokens = cfg.micro_batches * cfg.batch_size * seq_len
    return {
        "loss": loss_sum.item() / cfg.micro_batches,
        "ce_loss": ce_sum.item() / cfg.micro_batches,
        "aux_loss": aux_sum.item() / cfg.micro_batches,
        "grad_norm": grad_norm.item(),
        "tokens": num_tokens,
        "step_time_s": step_time_s,
        "tokens_per_s": num_tokens / step_time_s,
        "imbalance": max(imbalance_per_layer, default=1.0),
        "imbalance_per_layer": imbalance_per_layer,
        "_received_per_layer": received_per_layer,
    }


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """First/last training loss, initial/final validation loss, overall tokens per second."""
    records = [r for r in records if not r.get("skipped")]
    if not records:
        return {}
    val_losses = [r["val_loss"] for r in records if r.get("val_loss") is not None]
    total_s = sum(r["step_time_s"] for r in records)
    return {
        "steps": len(records),
        "loss_first": records[0]["loss"],
        "loss_last": records[-1]["loss"],
        "val_loss_init": records[0].get("val_loss_init"),
        "val_loss_final": val_losses[-1] if val_losses else None,
        "tokens_per_s": sum(r["tokens"] for r in records) / total_s if total_s else 0.0,
        "train_time_s": total_s,
    }
