"""`spikeguard train --nproc N --pp P [--ep E] [--schedule 1f1b|interleaved]`: the training
run of a pipeline x data x expert parallel job (data parallel = N / (P x E)).

    .venv/bin/spikeguard train --preset tiny --num-layers 4 --num-experts 8 --nproc 4 \\
        --pp 2 --ep 2 --micro-batches 4 --batch-size 2 --steps 4 --budget 2MiB

The layout is checked before any process starts (exit 2 on a mistake); then the command
runs again under torchrun, one process per rank. Each rank writes its own JSON log
(`--log run.jsonl` -> run.jsonl for rank 0, run.rank{r}.jsonl for the others) with its
guard's record and the cluster summary of the step; rank 0 prints one line per step:
the cluster's worst peak (which rank), and where the step's spike was: the rank, stage,
layer (the model's numbering) and micro-batch that received the most tokens relative to
its expert-parallel peers (without EP: the worst max/mean tokens per expert).
"""

from __future__ import annotations

import gc
import time
from typing import Any, Optional

import torch
import torch.distributed as dist

from spikeguard.errors import UsageError
from spikeguard.parallel.mesh import MeshGroups, ParallelLayout

# Train options this path does not wire (yet): refused before any process starts.
_NOT_WIRED = (("trace", "--trace"), ("record_trace", "--record-trace"),
              ("checkpoint_dir", "--checkpoint-dir"), ("skip_steps", "--skip-steps"))


def check_pipeline_args(args, model_cfg, train_cfg) -> ParallelLayout:
    """Every mistake of a pipeline run, as a UsageError, before any process group starts."""
    for attr, flag in _NOT_WIRED:
        if getattr(args, attr, None):
            raise UsageError(f"{flag} is not available with --pp yet")
    if args.budget == "auto":
        raise UsageError("--budget auto is not available with --pp yet: give a byte budget")
    ep = args.ep if args.ep is not None else 1
    per_rank = 2 if args.schedule == "interleaved" else 1
    layout = ParallelLayout(args.nproc, pp=args.pp, ep=ep)
    if args.pp < 2:
        raise UsageError(f"--pp must be 2 or more for a pipeline, got {args.pp}")
    layout.check(num_layers=model_cfg.num_layers, num_experts=model_cfg.num_experts,
                 micro_batches=train_cfg.micro_batches, stages_per_rank=per_rank)
    if args.skew is not None and ep < 2:
        raise UsageError("--skew needs expert parallelism: use --ep 2 or more")
    return layout


def run_pipeline_train(args, model_cfg, train_cfg) -> int:
    """Check, relaunch under torchrun (outside it), or train as one rank (inside)."""
    from spikeguard.parallel.launch import launch_job, under_torchrun

    layout = check_pipeline_args(args, model_cfg, train_cfg)
    skew_config = _skew_config(args, layout.ep)
    if not under_torchrun():
        return launch_job(args.nproc, args.argv)
    return _train_rank(args, layout, model_cfg, train_cfg, skew_config)


def _skew_config(args, ep: int):
    if args.skew is None:
        return None
    from spikeguard.routing.skew import SkewConfig, SkewSchedule

    spike_max = args.spike_max if args.spike_max is not None else min(2.6, float(ep))
    extra = {"spike_probability": args.spike_prob} if args.spike_prob is not None else {}
    config = SkewConfig(seed=args.skew_seed, pattern=args.skew, spike_max_ratio=spike_max,
                        spike_min_ratio=min(1.2, spike_max), **extra)
    SkewSchedule(config, ep)  # its checks fail here, before any process starts
    return config


def _train_rank(args, layout, model_cfg, train_cfg, skew_config) -> int:
    from spikeguard.parallel.launch import init_worker

    if args.threads is not None:
        if args.threads <= 0:
            raise UsageError(f"--threads must be a positive integer, got {args.threads}")
        torch.set_num_threads(args.threads)
    worker = init_worker()
    # On an error: nothing that talks to the peers, which may be blocked in a collective;
    # torchrun stops them once this rank exits with its error.
    run = _RankRun(args, layout, model_cfg, train_cfg, skew_config, worker.rank)
    run.train()
    # As ExpertParallelHooks.close: the group's threads end only once nothing refers to
    # it, so drop the models, destroy, and collect while the interpreter is whole.
    run.close()
    del run, worker
    dist.barrier()
    dist.destroy_process_group()
    gc.collect()
    return 0


class _RankRun:
    """Everything one rank holds for the run; `train` prints on rank 0 only."""

    def __init__(self, args, layout, model_cfg, train_cfg, skew_config, rank: int):
        from rich.console import Console

        from spikeguard.data.corpus import load_corpus
        from spikeguard.model.transformer import build_model
        from spikeguard.parallel.pipeline_training import PipelineRank
        from spikeguard.train.log import check_log_path
        from spikeguard.train.loop import make_optimizer

        self.args, self.layout, self.rank = args, layout, rank
        self.model_cfg, self.cfg = model_cfg, train_cfg
        self.console = Console(quiet=rank != 0)
        self.log_path = _rank_log(args.log, rank) if args.log else None
        if self.log_path is not None:
            check_log_path(self.log_path)
        self.corpus = load_corpus(args.data)
        self.corpus.check_seq_len(model_cfg.seq_len)
        self.groups = MeshGroups.build(layout)
        self.prank = PipelineRank(build_model(model_cfg, seed=train_cfg.seed), self.groups,
                                  micro_batches=train_cfg.micro_batches,
                                  batch_size=train_cfg.batch_size, schedule=args.schedule)
        self.injector = None
        if skew_config is not None:
            from spikeguard.routing.skew import SkewInjector, SkewSchedule

            self.injector = SkewInjector(SkewSchedule(skew_config, layout.ep), layout.ep)
            self.injector.attach(self.prank.modules)
            self.injector.set_step(0)
        # One optimizer per stage module: each guard counts its own module's state.
        self.optimizers = [make_optimizer(m, train_cfg) for m in self.prank.modules.stages]
        self.use_guard = args.budget is not None or args.policy is not None
        if self.use_guard:
            self._attach_guards()
        self.monitor = _RoutingMonitor(self.prank)

    def _attach_guards(self) -> None:
        from spikeguard import attach

        optimizer_of = {id(m): o for m, o in zip(self.prank.modules.stages, self.optimizers)}
        kwargs: dict[str, Any] = {}
        if self.args.budget_bytes is not None:
            # Interleaved: one guard per model chunk (no shared per-rank ledger yet), so the
            # rank's budget is split evenly between its chunks.
            kwargs["budget"] = self.args.budget_bytes // len(self.prank.modules.stages)
        if self.args.policy is not None:
            kwargs["policy"] = self.args.policy
        self.prank.attach_guards(lambda m: attach(m, optimizer=optimizer_of[id(m)], **kwargs))

    def train(self) -> None:
        from spikeguard.train.log import format_rate, open_log, write_record

        cfg, T = self.cfg, self.model_cfg.seq_len
        shard = self.groups.data_shard
        rows = cfg.micro_batches * cfg.batch_size
        gen = torch.Generator().manual_seed(cfg.seed + 1000 * shard)
        val_gen = torch.Generator().manual_seed(cfg.seed + 1_000_003 + 1000 * shard)
        val = [self.corpus.get_batch("val", rows, T, val_gen) for _ in range(cfg.eval_batches)]
        L = self.layout
        self._say(f"pipeline: {L.nproc} ranks = pp {L.pp} x dp {L.dp} x ep {L.ep} (gloo, "
                  f"{self.args.schedule}), {cfg.micro_batches} micro-batches of "
                  f"{cfg.batch_size} x {T} tokens per shard; step lines are rank 0's, loss the "
                  f"last stage's, peak and spike the cluster's"
                  + ("; memory: CPU run, peak / budget are the emulated device's (every live storage)"
                     if self.use_guard else "")
                  + ("; interleaved: each of a rank's 2 chunks has its own guard and half the "
                     "budget, peak is the larger chunk's" if len(self.prank.stage_ids) > 1
                     and self.use_guard else ""))
        val_init = self._evaluate(val)
        log_file = open_log(self.log_path) if self.log_path is not None else None
        records = []
        try:
            for step in range(1, cfg.steps + 1):
                record = self._step(step, gen)
                if step == 1:
                    record["val_loss_init"] = val_init
                if step % cfg.eval_every == 0 or step == cfg.steps:
                    record["val_loss"] = self._evaluate(val)
                records.append(record)
                if log_file is not None:
                    write_record(log_file, record)
                self._say(_step_line(record, cfg.steps))
        finally:
            if log_file is not None:
                log_file.close()
        total_s = sum(r["step_time_s"] for r in records)
        self._say(f"done: {len(records)} steps in {total_s:.2f} s (training only) | train loss "
                  f"{records[0]['loss']:.3f} -> {records[-1]['loss']:.3f} | val loss "
                  f"{val_init:.3f} -> {records[-1]['val_loss']:.3f} | "
                  f"{format_rate(sum(r['tokens'] for r in records) / total_s)} tok/s")

    def _step(self, step: int, gen: torch.Generator) -> dict:
        cfg = self.cfg
        if self.injector is not None:
            self.injector.set_step(step)
        idx_BT, targets_BT = self.corpus.get_batch(
            "train", cfg.micro_batches * cfg.batch_size, self.model_cfg.seq_len, gen)
        start = time.perf_counter()
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        self.monitor.begin_step()
        losses = self.prank.step(idx_BT, targets_BT)
        grad_norm = self.prank.clip_grad_norm_(cfg.grad_clip)
        for opt in self.optimizers:
            opt.step()
        step_time_s = time.perf_counter() - start
        tokens = (self.groups.num_shards * cfg.micro_batches * cfg.batch_size
                  * self.model_cfg.seq_len)
        mine = {
            "rank": self.rank, "stages": self.prank.stage_ids,
            "coords": {"pp": self.groups.pp_rank, "dp": self.groups.dp_rank,
                       "ep": self.groups.ep_rank},
            "loss": (sum(x.item() for x in losses) / len(losses)) if losses else None,
            "guards": [g.history[-1] for g in self.prank.guards],
            "residency": [r.log[0] if r.log else None for r in self.prank.residencies],
            "routing": self.monitor.routing,
        }
        everyone: list = [None] * self.layout.nproc
        dist.all_gather_object(everyone, mine)
        record = {"step": step, "step_time_s": step_time_s, "tokens": tokens,
                  "tokens_per_s": tokens / step_time_s, "grad_norm": grad_norm.item(), **mine}
        record.update(cluster_summary(everyone, self.layout))
        return record

    def _evaluate(self, batches) -> float:
        losses = []
        for idx_BT, targets_BT in batches:
            losses += [x.item() for x in self.prank.evaluate(idx_BT, targets_BT)]
        mine = sum(losses) / len(losses) if losses else None
        everyone: list = [None] * self.layout.nproc
        dist.all_gather_object(everyone, mine)
        values = [v for v in everyone if v is not None]
        return sum(values) / len(values)

    def _say(self, text: str) -> None:
        self.console.print(text, soft_wrap=True, markup=False, highlight=False)

    def close(self) -> None:
        if self.injector is not None:
            self.injector.detach()
        self.monitor.close()
        self.prank.close()
        self.prank = self.groups = self.optimizers = self.monitor = self.injector = None


class _RoutingMonitor:
    """Routed copies each MoE layer of this rank received, per micro-batch of the step,
    counted in forward only (a recompute in backward re-runs the layer, not the routing)."""

    def __init__(self, prank):
        from spikeguard.model.dispatch import expert_imbalance

        self._imbalance = expert_imbalance
        self.routing: list = []
        self._forward = {}
        self._handles = []
        for module in prank.modules.stages:
            state = {"mb": -1, "active": False}
            self._forward[id(module)] = state
            self._handles.append(module.register_forward_pre_hook(self._enter(state)))
            self._handles.append(module.register_forward_hook(self._leave(state)))
            for local, block in enumerate(module.moe_blocks()):
                self._handles.append(block.register_forward_hook(
                    self._record(state, module.first_layer + local)))

    def begin_step(self) -> None:
        self.routing = []
        for state in self._forward.values():
            state["mb"] = -1

    def _enter(self, state):
        def hook(module, args):
            if torch.is_grad_enabled():
                state["mb"] += 1
                state["active"] = True
        return hook

    def _leave(self, state):
        def hook(module, args, output):
            state["active"] = False
        return hook

    def _record(self, state, layer: int):
        def hook(block, args, output):
            if state["active"]:
                counts = block.last_tokens_per_expert
                self.routing.append({"layer": layer, "micro_batch": state["mb"],
                                     "received": int(sum(counts)),
                                     "imbalance": self._imbalance(counts)})
        return hook

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def cluster_summary(everyone: list, layout: ParallelLayout) -> dict:
    """The step as the cluster saw it, the same on every rank: the loss (last stages'
    mean), the worst peak and its rank and stage, each rank's decisions, and the spike:
    the (rank, stage, layer, micro-batch) that received the most routed copies relative
    to its expert-parallel peers (max / mean), or, without EP, the worst max/mean tokens
    per expert."""
    losses = [r["loss"] for r in everyone if r["loss"] is not None]
    out: dict[str, Any] = {"loss": sum(losses) / len(losses) if losses else float("nan")}
    peaks = [max((g["peak_bytes"] for g in r["guards"]), default=0) for r in everyone]
    if any(r["guards"] for r in everyone):
        peak_rank = max(range(len(peaks)), key=peaks.__getitem__)
        out.update(max_peak_bytes=peaks[peak_rank], peak_rank=peak_rank,
                   peak_stage=everyone[peak_rank]["stages"][0], rank_peak_bytes=peaks,
                   peak_bytes=peaks[peak_rank],
                   budget_bytes=everyone[peak_rank]["guards"][0]["budget_bytes"],
                   rank_decisions=[_sum_decisions(r["guards"]) for r in everyone])
    by_key: dict = {}
    for r in everyone:
        c = r["coords"]
        for e in r["routing"]:
            by_key.setdefault((c["pp"], c["dp"], e["layer"], e["micro_batch"]), []).append(
                (r["rank"], e))
    best: Optional[tuple] = None
    for (pp, _, layer, mb), peers in by_key.items():
        mean = sum(e["received"] for _, e in peers) / len(peers)
        for rank, e in peers:
            ratio = e["received"] / mean if layout.ep > 1 and mean else e["imbalance"]
            if best is None or ratio > best[0]:
                best = (ratio, rank, pp, layer, mb)
    imbalance = max((e["imbalance"] for r in everyone for e in r["routing"]), default=1.0)
    out["imbalance"] = imbalance
    if best is not None:
        ratio, rank, stage, layer, mb = best
        out["spike"] = {"ratio": ratio, "rank": rank, "stage": stage, "layer": layer,
                        "micro_batch": mb, "measure": "rank" if layout.ep > 1 else "expert"}
    return out


def _sum_decisions(guards: list) -> dict:
    total = {"save": 0, "recompute": 0, "offload": 0}
    for g in guards:
        for k in total:
            total[k] += g["decisions"].get(k, 0)
    return total


def _step_line(record: dict, num_steps: int) -> str:
    from spikeguard.train.log import step_line

    line = step_line(record, num_steps)
    spike = record.get("spike")
    if spike is not None:
        what = "rank" if spike["measure"] == "rank" else "expert"
        line += (f" | spike {spike['ratio']:.2f}x {what} r{spike['rank']} s{spike['stage']} "
                 f"L{spike['layer']} mb{spike['micro_batch']}")
    return line


def _rank_log(path: str, rank: int) -> str:
    if not rank:
        return path
    stem, dot, ext = path.rpartition(".")
    return f"{stem}.rank{rank}.{ext}" if dot else f"{path}.rank{rank}"
