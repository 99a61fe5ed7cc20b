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
import time
from pathlib import Path
from typing import Any, Callable, Collection, Iterator, Optional, Sequence

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from torch import nn

from spikeguard.data.corpus import Corpus
from spikeguard.errors import UsageError
from spikeguard.model.config import ModelConfig
from spikeguard.model.dispatch import expert_imbalance  # noqa: F401  (exported by spikeguard.train)
from spikeguard.train.log import open_log, step_line, write_record
from spikeguard.train.metrics import write_step
from spikeguard.train.train_config import TrainConfig, make_optimizer  # noqa: F401  (exported)

# (model, optimizer) -> guard; the guard offers `step()` (a context manager) and `history`.
GuardFactory = Callable[[nn.Module, torch.optim.Optimizer], Any]

# Validation windows come from their own generator so that changing eval_batches or
# eval_every never changes the training batches (and so the training losses).
_VAL_SEED_OFFSET = 1_000_003


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
          log_path: Optional[str | Path] = None, console: Optional[Console] = None,
          observers: Sequence[Any] = (), checkpoint: Any = None,
          skip_steps: Collection[int] = (), metrics: Sequence[Any] = ()) -> list[dict[str, Any]]:
    """Train one built-in `model` in place on this process; returns one record per step.

    Records hold step, loss (the objective: cross-entropy + aux), ce_loss, aux_loss,
    grad_norm, tokens, step_time_s, tokens_per_s, imbalance (worst layer),
    imbalance_per_layer, val_loss on evaluation steps, val_loss_init (the initial weights'
    validation loss) on the first record, plus whatever the guard recorded for the step.
    This is `run_loop` on a LocalEngine; spikeguard.train.run builds the other layouts.
    """
    from spikeguard.train.engines import LocalEngine
    from spikeguard.train.families import BuiltinFamily

    if guard is not None and guard_factory is not None:
        raise UsageError("pass either guard or guard_factory to train(), not both")
    engine = LocalEngine(model, BuiltinFamily, grad_clip=train_cfg.grad_clip)
    if guard is not None:
        engine.guards = [guard]
    return run_loop(engine, train_cfg, corpus, seq_len=model_cfg.seq_len,
                    guard_maker=guard_factory, log_path=log_path, console=console,
                    observers=observers, checkpoint=checkpoint, skip_steps=skip_steps,
                    metrics=metrics)


def run_loop(engine, train_cfg: TrainConfig, corpus: Corpus, *, seq_len: int,
             guard_maker: Optional[GuardFactory] = None, log_path: Optional[str | Path] = None,
             console: Optional[Console] = None, observers: Sequence[Any] = (),
             checkpoint: Any = None, skip_steps: Collection[int] = (), shard: int = 0,
             quiet: bool = False, before_step: Optional[Callable[[int], None]] = None,
             log_mode: str = "new", metrics: Sequence[Any] = ()) -> list[dict[str, Any]]:
    """The one training loop, whatever the layout: `engine` (spikeguard.train.engines) is
    what this process holds and how it runs a step.

    `shard`: this process's data shard (its generators are offset by it); `quiet`: not
    the rank that prints. `guard_maker(module, optimizer)` attaches the guards once the
    optimizers exist and the checkpoint is restored (it may measure a budget first).
    `observers` (e.g. spikeguard.routing.trace's recorder and replayer) get
    `before_step(step)` before a step's first forward and `after_step(step, record)` after
    its update, on every rank in the same order; `before_step` (the skew injector's step)
    runs before them. `checkpoint` (spikeguard.train.checkpoint.Checkpointer) resumes from
    its last save and saves on its interval; `skip_steps` are dropped (their data drawn,
    nothing trained), as a job restarted after a crash drops the batch that killed it.
    `log_mode` (spikeguard.files.LineFile): "new" refuses an existing log, "append" (a
    resumed run) adds to it, "overwrite" replaces it. `metrics`
    (spikeguard.train.metrics.MetricsSink): each finished step's scalars, written where the
    log is (the caller opens and closes them; give them to the rank that prints).
    """
    corpus.check_seq_len(seq_len)
    console = console or Console()
    family = engine.family
    with contextlib.ExitStack() as stack:
        log_file = stack.enter_context(open_log(log_path, log_mode)) if log_path is not None else None
        torch.manual_seed(train_cfg.seed)
        train_gen = torch.Generator().manual_seed(train_cfg.seed + 1000 * shard)
        val_gen = torch.Generator().manual_seed(train_cfg.seed + _VAL_SEED_OFFSET + 1000 * shard)
        val_batches = [family.draw(corpus, "val", train_cfg.batch_size * engine.eval_micro_batches,
                                   seq_len, val_gen) for _ in range(train_cfg.eval_batches)]
        engine.build_optimizers(lambda m: make_optimizer(m, train_cfg))

        def draw_step() -> list:
            return [family.draw(corpus, "train", train_cfg.batch_size, seq_len, train_gen)
                    for _ in range(train_cfg.micro_batches)]

        start = checkpoint.restore(engine.checkpoint_parts, train_gen,
                                   reshardable=engine.reshardable) if checkpoint is not None else 0
        if start and not quiet:
            console.print(checkpoint.note, soft_wrap=True, markup=False, highlight=False)
        if start and not checkpoint.data_restored:
            # Resumed into another layout: this shard's data stands where it would after
            # `start` steps of this layout (every step, dropped ones too, draws once).
            for _ in range(start):
                draw_step()
        # Before the guard exists where it can (the initial weights' loss needs no memory
        # management); a pipeline's schedule is built once, with its guards, by its first
        # forward.
        if guard_maker is not None and engine.guards_before_first_forward:
            engine.attach_guards(guard_maker)
        val_loss_init = engine.evaluate(val_batches) if start == 0 else None
        if guard_maker is not None and not engine.guards_before_first_forward:
            engine.attach_guards(guard_maker)
        if start and engine.guards:
            checkpoint.restore_guards(engine.guards)   # warm: what they had learned
        for module in engine.modules:
            module.train()
        records: list[dict[str, Any]] = []
        reporter = None if quiet else stack.enter_context(_reporter(console, train_cfg.steps))

        def finish(record: dict[str, Any]) -> None:
            """Keep, log, print and checkpoint a finished (or dropped) step."""
            records.append(record)
            if log_file is not None:
                write_record(log_file, record)
            write_step(metrics, record)
            if reporter is not None:
                reporter.line(step_line(record, train_cfg.steps))
                reporter.advance()
            if checkpoint is not None:
                checkpoint.after_step(record["step"], engine.checkpoint_parts, train_gen,
                                      last=record["step"] == train_cfg.steps,
                                      guards=engine.guards, reshardable=engine.reshardable)

        for step in range(start + 1, train_cfg.steps + 1):
            if step in skip_steps:
                draw_step()   # later steps see the data they would have
                finish({"step": step, "skipped": True, "tokens": 0, "step_time_s": 0.0})
                continue
            if before_step is not None:
                before_step(step)
            for observer in observers:
                observer.before_step(step)
            # Drawn before the step, so that a re-run of the step (the guard's safety
            # net) sees the same data and produces bitwise the same gradients.
            batches = draw_step()
            start_s = time.perf_counter()
            out = engine.step(batches)
            step_time_s = time.perf_counter() - start_s
            tokens = engine.tokens_per_step(
                len(batches) * train_cfg.batch_size * (seq_len + family.token_offset))
            record = {"step": step, **out, "tokens": tokens, "step_time_s": step_time_s,
                      "tokens_per_s": tokens / step_time_s}
            if step == 1 and val_loss_init is not None:
                record["val_loss_init"] = val_loss_init
            if step % train_cfg.eval_every == 0 or step == train_cfg.steps:
                record["val_loss"] = engine.evaluate(val_batches)
            for guard in engine.guards[:1]:
                # The loop's own keys win a name clash: "step" must stay the loop's count.
                for key, value in dict(guard.history[-1]).items() if guard.history else ():
                    record.setdefault(key, value)
            for observer in observers:
                observer.after_step(step, record)
            record.update(engine.summarize(record, step))
            finish(record)
    return records


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
