"""`spikeguard train`, every layout: check, relaunch under torchrun, build this rank, train.

    code = run_training(RunConfig.from_dict({...}))

Outside torchrun with nproc > 1 the configuration is checked (every mistake is exit 2
before any process starts) and the command runs again under torchrun, one process per
rank. Inside, each rank builds what it holds (spikeguard.train.engines: the whole model,
its experts sharded under EP, or its pipeline stages) and runs the one loop
(spikeguard.train.loop.run_loop) with every feature of the run: guards (with `--budget
auto` measured on a calm step first), skew, traces recorded and replayed, checkpoints and
resume, skipped steps, per-rank logs (`run.jsonl` for rank 0, `run.rank{r}.jsonl`), the
cluster summary in each record. Rank 0 prints.
"""

from __future__ import annotations

import gc
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from rich.console import Console

from spikeguard.train.checks import check_files, checkpoint_identity, load_trace, rank_log
from spikeguard.train.config import RunConfig
from spikeguard.train.families import family_for

AUTO_PROBE_SEED = 7919   # the budget probe's micro-batches are drawn apart from the training data


def run_training(cfg: RunConfig) -> int:
    """The whole `train` command for `cfg`; returns the exit code."""
    from spikeguard.parallel.launch import launch_job, under_torchrun

    check_files(cfg)
    if cfg.parallel.distributed and not under_torchrun():
        from spikeguard.train.config import check_inputs
        check_inputs(cfg)   # once here, not once per rank
        return launch_job(cfg.parallel.nproc, list(cfg.argv))
    threads_before = torch.get_num_threads()
    if cfg.files.threads is not None:
        torch.set_num_threads(cfg.files.threads)
    try:
        return _run_rank(cfg)
    finally:
        # The command may run inside a longer-lived process (tests): leave it as found.
        torch.set_num_threads(threads_before)


def _run_rank(cfg: RunConfig) -> int:
    from spikeguard.parallel.launch import init_worker

    worker = init_worker() if cfg.parallel.distributed else None
    if worker is not None and worker.world_size != cfg.parallel.nproc:
        # Started by torchrun by hand (several nodes): the world is torchrun's.
        cfg = cfg.with_world(worker.world_size)
    run = RankRun(cfg, worker.rank if worker is not None else 0,
                  shared_groups=worker is not None and not worker.owned)
    try:
        code = run.train()
    except BaseException:
        # Nothing that talks to the peers, which may be blocked in a collective; torchrun
        # stops them once this rank exits with its error.
        run.close(clean=False)
        raise
    run.close(clean=True)
    del run
    if worker is not None:
        # The group's threads end only once nothing refers to it (models do through
        # their dispatchers): drop, destroy, collect while the interpreter is whole. A
        # group this run only joined (the bench's worker) lives on for the next run.
        dist.barrier()
        if worker.owned:
            dist.destroy_process_group()
        gc.collect()
    return code


class RankRun:
    """Everything one rank holds for the run."""

    def __init__(self, cfg: RunConfig, rank: int, shared_groups: bool = False):
        from spikeguard.data.corpus import load_corpus

        self.cfg, self.rank = cfg, rank
        self.shared_groups = shared_groups   # the process group outlives this run
        self.console = Console(quiet=rank != 0)
        self.corpus = load_corpus(cfg.files.data)
        self.groups = self._groups()
        self.family = family_for(cfg)
        self.seq_len = self.family.seq_len
        self.corpus.check_seq_len(self.seq_len)
        model = self.family.build()
        self.num_params = sum(p.numel() for p in model.parameters())   # global shapes
        self.engine = self.family.engine(model, self.groups)
        self.injector = self._injector()
        self.observers: list = []
        self.metrics: list = []

    # ---- building ---------------------------------------------------------------------
    def _groups(self):
        if not self.cfg.parallel.distributed:
            return None
        from spikeguard.parallel.mesh import MeshGroups
        return MeshGroups.build(self.cfg.layout, shared=self.shared_groups)

    def _injector(self):
        skew = self.cfg.skew_config
        if skew is None:
            return None
        from spikeguard.routing.skew import SkewInjector, SkewSchedule

        ep = self.cfg.layout.ep
        injector = SkewInjector(SkewSchedule(skew, ep), ep,
                                self.cfg.skew.spike_from_layer).attach(self.engine.modules)
        injector.set_step(0)  # the evaluation before the first step
        return injector

    def _trace_observers(self) -> list:
        from spikeguard.routing.trace import TraceRecorder, TraceReplayer, TraceWriter, make_header

        cfg, files = self.cfg, self.cfg.files
        modules = self.engine.modules
        ep_rank = self.groups.ep_rank if self.groups is not None else 0
        observers = []
        if files.trace is not None:
            observers.append(TraceReplayer(modules, load_trace(cfg), rank=ep_rank))
        if files.record_trace is not None:
            model_cfg = cfg.model.builtin
            writer = None
            if self.rank == 0:
                skew = cfg.skew_config.to_dict() if cfg.skew_config is not None else None
                writer = TraceWriter(files.record_trace, make_header(
                    num_layers=model_cfg.num_layers, num_experts=model_cfg.num_experts,
                    top_k=model_cfg.top_k, ep=cfg.layout.ep,
                    micro_batches=cfg.train.micro_batches,
                    tokens_per_micro_batch=cfg.tokens_per_micro_batch,
                    preset=cfg.model.preset, seed=cfg.train.seed, skew=skew),
                    overwrite=files.overwrite)
            # One data-parallel replica's routing (dp 0) is the trace; the whole job sums.
            dp0 = self.groups is None or self.groups.dp_rank == 0
            observers.append(TraceRecorder(
                modules, cfg.train.micro_batches, writer,
                group=dist.group.WORLD if self.groups is not None else None,
                num_layers=model_cfg.num_layers, contributes=dp0))
        return observers

    def _checkpointer(self):
        files = self.cfg.files
        if files.checkpoint_dir is None:
            return None
        from spikeguard.train.checkpoint import Checkpointer
        layout, model = checkpoint_identity(self.cfg)
        return Checkpointer(files.checkpoint_dir, files.checkpoint_every, rank=self.rank,
                            resume=files.resume, nproc=self.cfg.parallel.nproc, layout=layout,
                            model=model,
                            group=dist.group.WORLD if self.groups is not None else None,
                            shard=self.groups.data_shard if self.groups is not None else 0)

    # ---- the guard ----------------------------------------------------------------------
    def _guard_maker(self):
        guard_cfg = self.cfg.guard
        if self.family.budget_by_default and guard_cfg.budget is None:
            guard_cfg = replace(guard_cfg, budget="auto", policy=guard_cfg.policy or "adaptive")
        if not guard_cfg.enabled:
            return None
        import spikeguard
        from spikeguard.memory.budget import format_bytes

        budget = [guard_cfg.budget_bytes]
        per_module = len(self.engine.modules)
        rates = None
        if guard_cfg.cost_rates is not None:
            from spikeguard.plan.cost_rates import load_rates, use_rates
            rates = load_rates(guard_cfg.cost_rates)

        def make(module, optimizer):
            if guard_cfg.auto and budget[0] is None:
                budget[0] = self._auto_budget()
            kwargs: dict[str, Any] = {"optimizer": optimizer,
                                      "shared_policy": guard_cfg.shared_policy,
                                      "memory_snapshot": self.cfg.files.memory_snapshot}
            if budget[0] is not None:
                # Interleaved: one guard per model chunk (no shared per-rank ledger), so
                # the rank's budget is split evenly between its chunks.
                kwargs["budget"] = budget[0] // per_module
            if guard_cfg.policy is not None:
                kwargs["policy"] = guard_cfg.policy
            guard = spikeguard.attach(module, **kwargs)
            if rates is not None:
                use_rates(guard.cost, rates)
            self._say(self.family.guard_line(guard))
            return guard

        self._say("memory: CPU run, peak / budget are the emulated device's (every live "
                  "storage, as an allocator counts)" + (
                      f"; budget {format_bytes(budget[0])}" if budget[0] is not None else "")
                  + ("; interleaved: each of a rank's 2 chunks has its own guard and half "
                     "the budget, peak is the larger chunk's" if per_module > 1 else ""))
        return make

    def _auto_budget(self) -> int:
        """The family's `--budget auto`, measured on micro-batches drawn apart from the
        training data, with the routing skew (if any) held at its calm maximum."""
        cfg = self.cfg
        gen = torch.Generator().manual_seed(cfg.train.seed + AUTO_PROBE_SEED + self.rank)
        batches = [self.family.draw(self.corpus, "train", cfg.train.batch_size, self.seq_len, gen)
                   for _ in range(cfg.train.micro_batches)]
        held = ""
        if self.injector is not None:
            calm = self.injector.schedule.config.calm_max_ratio
            self.injector.hold(calm)
            held = f", routing held at the calm maximum {calm:g}x on rank 0"
        budget, line = self.family.auto_budget(self.engine, batches, self.groups, held=held)
        self._say(line)
        return budget

    # ---- training -----------------------------------------------------------------------
    def train(self) -> int:
        from spikeguard.train.log import memory_summary
        from spikeguard.train.loop import run_loop, summarize

        cfg = self.cfg
        self._say_model()
        self.observers = self._trace_observers()
        self.metrics = self._metrics()
        records = run_loop(
            self.engine, cfg.train, self.corpus, seq_len=self.seq_len,
            guard_maker=self._guard_maker(), log_path=rank_log(cfg.files.log, self.rank),
            console=self.console, observers=self.observers, checkpoint=self._checkpointer(),
            skip_steps=cfg.files.skip_steps, log_mode=self._log_mode(),
            shard=self.groups.data_shard if self.groups is not None else 0,
            quiet=self.rank != 0, metrics=self.metrics,
            before_step=self.injector.set_step if self.injector is not None else None)
        if self.engine.guards:
            self._say(memory_summary(records))
        self._say_done(summarize(records), records)
        return 0

    def _metrics(self) -> list:
        """Rank 0's metrics sinks (the rank that prints; each rank's JSONL log keeps its
        own figures). Each joins self.metrics as it opens: one that fails to open leaves
        those before it to close()."""
        from spikeguard.train.metrics import TensorBoardSink, WandbSink

        files = self.cfg.files
        for sink, where in ((TensorBoardSink, files.tensorboard), (WandbSink, files.wandb)):
            if self.rank == 0 and where is not None:
                self.metrics.append(sink(where))
        return self.metrics

    def _log_mode(self) -> str:
        files = self.cfg.files
        return "append" if files.resume else "overwrite" if files.overwrite else "new"

    def _say_model(self) -> None:
        train_cfg = self.cfg.train
        tokens = (train_cfg.micro_batches * train_cfg.batch_size
                  * (self.seq_len + self.family.token_offset))
        self._say(f"{self.family.describe(self.engine)}, {self.num_params / 1e6:.2f}M params | "
                  f"{train_cfg.steps} steps x {tokens} tokens | CPU threads "
                  f"{torch.get_num_threads()}")
        self._say(f"data: {self.corpus.source}")
        self._say(self.family.layout_line())

    def _say_done(self, s: dict, records: list) -> None:
        from spikeguard.train.log import format_rate

        if not s:
            self._say(f"done: no step trained ({len(records)} dropped or resumed past)")
            return
        seconds = s["train_time_s"]

        def pair(first, last) -> str:
            return f"{'-' if first is None else f'{first:.3f}'} -> {'-' if last is None else f'{last:.3f}'}"

        self._say(f"done: {s['steps']} steps in {seconds:.{1 if seconds >= 10 else 2}f} s "
                  f"(training only) | train loss {pair(s['loss_first'], s['loss_last'])} | "
                  f"val loss {pair(s['val_loss_init'], s['val_loss_final'])} | "
                  f"{format_rate(s['tokens_per_s'])} tok/s")

    def _say(self, text: str) -> None:
        if text:
            self.console.print(text, soft_wrap=True, markup=False, highlight=False)

    def close(self, clean: bool) -> None:
        for observer in self.observers:
            writer = getattr(observer, "writer", None)
            if not clean and writer is not None:
                writer.abort()   # a failed run replaces no --record-trace (files.py)
            observer.detach()
        for sink in self.metrics:
            sink.close()
        if self.injector is not None:
            self.injector.detach()
        self.engine.close()
        self.observers, self.injector, self.engine, self.metrics = [], None, None, []

