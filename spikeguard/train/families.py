"""The model families of `spikeguard train`: for each kind of model, how a run builds it,
lays it out on the ranks, measures `--budget auto` for it, describes it, and how a
micro-batch is fed and scored. `train/run.py` holds no branch on the kind: a new family
is one class here (or, with a library of its own, one module like titan_family.py).

    family = family_for(cfg)                        # BuiltinFamily, HFFamily, TitanFamily
    model = family.build()                          # family.seq_len is the run's T
    engine = family.engine(model, groups)           # the loop's seam to the layout
    budget, line = family.auto_budget(engine, batches, groups)

A micro-batch is drawn by `draw`, scored by `losses` (objective, cross-entropy, aux) and
`eval_loss`. The engines (spikeguard.train.engines) read only that class-level part
(with `name`, `token_offset`, `own_parallelism`), so the class itself serves where no
run is built (`train.loop.train`).
"""

from __future__ import annotations

import gc

import torch
import torch.distributed as dist
from torch import nn

from spikeguard.errors import UsageError
from spikeguard.memory.budget import format_bytes

HF_AUTO_FRACTION = 0.85  # --hf without a budget: this much of the unguarded step's peak


def family_class(name: str) -> type:
    """The class of the family called `name` (spikeguard.train.config.ModelChoice.family).
    The configuration asks it for the model's sizes and what the family cannot run, so
    this module never imports the configuration (which imports it)."""
    if name == "titan":   # its module imports torchtitan's models: only when asked for
        from spikeguard.train.titan_family import TitanFamily
        return TitanFamily
    return {"builtin": BuiltinFamily, "hf": HFFamily}[name]


def family_for(cfg):
    """The family of `cfg`'s model (a spikeguard.train.config.RunConfig), ready to build it."""
    return family_class(cfg.model.family)(cfg)


class BuiltinFamily:
    """spikeguard's own MoE transformer: a micro-batch is (idx_BT, targets_BT). Every
    layout: the engine shards its experts (EP) and reduces its gradients, or a pipeline
    holds its stages."""

    name = "builtin"
    token_offset = 0          # tokens counted per sequence: T
    own_parallelism = False   # the engine shards its experts and reduces its gradients
    budget_by_default = False  # no guard unless a budget or a policy is asked for

    def __init__(self, cfg):
        self.cfg = cfg
        self.seq_len = cfg.model.builtin.seq_len

    # ---- what the configuration asks before any run ------------------------------------
    @staticmethod
    def sizes_of(choice):
        """The model's sizes from a spikeguard.train.config.ModelChoice: its preset's."""
        return choice.builtin

    @staticmethod
    def check_run(cfg, layout) -> None:
        """What this family cannot run (one UsageError): it runs every layout."""

    @staticmethod
    def moe_blocks(model: nn.Module) -> list:
        """The MoE blocks whose routed counts a step line reports (the built-in model's)."""
        return list(model.moe_blocks())

    # ---- feeding and scoring (the engines' calls) -------------------------------------
    @staticmethod
    def draw(corpus, split: str, batch_size: int, seq_len: int, gen) -> tuple:
        return corpus.get_batch(split, batch_size, seq_len, gen)

    @staticmethod
    def losses(model: nn.Module, batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        out = model(*batch)
        return out.loss, out.ce_loss, out.aux_loss

    @staticmethod
    def eval_loss(model: nn.Module, batch) -> torch.Tensor:
        return model(*batch).ce_loss

    # ---- the run's model --------------------------------------------------------------
    def build(self) -> nn.Module:
        from spikeguard.model.transformer import build_model
        return build_model(self.cfg.model.builtin, seed=self.cfg.train.seed)

    def engine(self, model: nn.Module, groups):
        from spikeguard.train.engines import LocalEngine, PipelineEngine

        cfg = self.cfg
        if cfg.layout.pp == 1:
            target = None
            if cfg.skew_config is not None:
                from spikeguard.routing.skew import SkewSchedule
                target = SkewSchedule(cfg.skew_config, cfg.layout.ep).draw
            return LocalEngine(model, self, groups, grad_clip=cfg.train.grad_clip,
                               skew_target=target)
        from spikeguard.parallel.pipeline_training import PipelineRank

        prank = PipelineRank(model, groups, micro_batches=cfg.train.micro_batches,
                             batch_size=cfg.train.batch_size, schedule=cfg.parallel.schedule)
        return PipelineEngine(prank, self, grad_clip=cfg.train.grad_clip)

    def auto_budget(self, engine, batches: list, groups, held: str = "") -> tuple[int, str]:
        """A calm step's true peak with everything saved (worst rank) plus the margin;
        under a pipeline, on a probe pipeline built for it alone (the run's schedule is
        built once, with its guards)."""
        from spikeguard.train.auto_budget import auto_budget, auto_budget_line, calm_peak_bytes

        if self.cfg.layout.pp > 1:
            peak, static = self._pipeline_probe(groups, batches)
        else:
            peak, static = calm_peak_bytes(engine, batches, group=_world(groups))
        budget = auto_budget(peak, static)
        return budget, auto_budget_line(peak, static, budget, held)

    def _pipeline_probe(self, groups, batches) -> tuple[int, int]:
        from spikeguard.train.auto_budget import calm_peak_bytes
        from spikeguard.train.train_config import make_optimizer

        probe = self.engine(self.build(), groups)   # same seed: the same weights
        try:
            probe.build_optimizers(lambda m: make_optimizer(m, self.cfg.train))
            return calm_peak_bytes(probe, batches, group=dist.group.WORLD)
        finally:
            probe.prank.guards = []   # the probe's guards, detached by calm_peak_bytes
            probe.close()
            del probe
            gc.collect()

    # ---- what the run prints ----------------------------------------------------------
    def describe(self, engine) -> str:
        m = self.cfg.model.builtin
        return (f"model {self.cfg.model.preset}: {m.num_layers} layers, {m.num_experts} "
                f"experts top-{m.top_k}")

    def layout_line(self) -> str:
        cfg, L = self.cfg, self.cfg.layout
        if L.pp > 1:
            return (f"pipeline: {L.nproc} ranks = pp {L.pp} x dp {L.dp} x ep {L.ep} (gloo, "
                    f"{cfg.parallel.schedule}), {cfg.train.micro_batches} micro-batches of "
                    f"{cfg.train.batch_size} x {self.seq_len} tokens per shard; step lines "
                    f"are rank 0's, loss the last stage's, peak and spike the cluster's")
        if L.nproc == 1:
            return ""
        return (f"expert parallel: {L.ep} ranks (gloo)"
                + (f" x data parallel {L.dp}" if L.dp > 1 else "")
                + f", {cfg.model.shape.num_experts // L.ep} experts each; skew "
                f"{cfg.skew.pattern or 'none'}; step lines are rank 0's, rank-imb and "
                f"peak are the cluster's")

    @staticmethod
    def guard_line(guard) -> str:
        return ""


class HFFamily:
    """A transformers causal LM: a micro-batch is one window w_BT of T+1 tokens, fed as
    input and labels (transformers shifts them); the loss is transformers' own
    (cross-entropy plus the router's load-balancing term). Under a process group its
    layout is transformers' own (EP and FSDP2, spikeguard.integrations.hf_models), which
    reduces the gradients itself: FSDP2 averages them over the ranks. Without a budget
    a run is guarded at HF_AUTO_FRACTION of its unguarded peak, so that a newcomer's
    first run shows the guard at work."""

    name = "hf"
    token_offset = 1
    own_parallelism = True
    budget_by_default = True

    def __init__(self, cfg):
        self.cfg = cfg
        self.sizes = cfg.model.shape
        self.seq_len = self.sizes.seq_len

    @staticmethod
    def sizes_of(choice):
        """HFSizes from the overrides given (transformers' config is built from them)."""
        from spikeguard.integrations.hf_models import HFSizes
        return HFSizes(**choice.overrides)

    @staticmethod
    def check_run(cfg, layout) -> None:
        """What --hf runs: one process, or transformers' own EP with FSDP2 over all ranks."""
        for what, refused in (("--skew", cfg.skew.pattern is not None),
                              ("--trace", cfg.files.trace is not None),
                              ("--record-trace", cfg.files.record_trace is not None)):
            if refused:
                raise UsageError(f"{what} is not available with --hf: a Hugging Face model's "
                                 f"routing is transformers' own (no skew or trace hooks)")
        if layout.pp > 1:
            raise UsageError("--pp is not available with --hf (transformers' own expert "
                             "parallelism runs without a pipeline here)")
        if layout.nproc > 1 and layout.ep != layout.nproc:
            raise UsageError(f"with --hf, --ep must be the number of processes {layout.nproc} "
                             f"(transformers' EP with FSDP2 over all of them; experts replicated"
                             f" over data-parallel ranks are not supported), got --ep {layout.ep}")
        if layout.nproc > 1 and cfg.files.checkpoint_dir is not None:
            raise UsageError("--checkpoint-dir is not available with --hf and --nproc "
                             "(sharded transformers checkpoints are not written yet)")

    @staticmethod
    def moe_blocks(model: nn.Module) -> list:
        return []   # transformers' routed counts are read by the guard, not the step line

    @staticmethod
    def draw(corpus, split: str, batch_size: int, seq_len: int, gen) -> tuple:
        idx_BT, targets_BT = corpus.get_batch(split, batch_size, seq_len, gen)
        return (torch.cat([idx_BT, targets_BT[:, -1:]], dim=1),)

    @staticmethod
    def losses(model: nn.Module, batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        loss = model(input_ids=batch[0], labels=batch[0]).loss
        return loss, loss, torch.zeros(())

    @staticmethod
    def eval_loss(model: nn.Module, batch) -> torch.Tensor:
        return model(input_ids=batch[0], labels=batch[0]).loss

    def build(self) -> nn.Module:
        from spikeguard.integrations.hf_models import build_hf_model, distribute_hf_model

        cfg = self.cfg
        model = build_hf_model(cfg.model.hf, self.sizes, seed=cfg.train.seed)
        if cfg.parallel.distributed:   # transformers' own EP, FSDP2 over every rank
            model = distribute_hf_model(model, cfg.layout.nproc, cfg.layout.ep)
        return model

    def engine(self, model: nn.Module, groups):
        from spikeguard.train.engines import LocalEngine
        return LocalEngine(model, self, groups, grad_clip=self.cfg.train.grad_clip)

    def auto_budget(self, engine, batches: list, groups, held: str = "") -> tuple[int, str]:
        """HF_AUTO_FRACTION of the calm step's peak with nothing guarded (the worst rank's
        under transformers' EP): the one probe of every family."""
        from spikeguard.train.auto_budget import calm_peak_bytes

        peak, _ = calm_peak_bytes(engine, batches, group=_world(groups))
        worst = " (worst rank)" if groups is not None else ""
        budget = int(HF_AUTO_FRACTION * peak)
        return budget, (f"memory: budget {format_bytes(budget)} = {HF_AUTO_FRACTION} x the "
                        f"unguarded peak {format_bytes(peak)}{worst} (emulated device)")

    def describe(self, engine) -> str:
        s, kind = self.sizes, engine.model.config.model_type
        return (f"model {self.cfg.model.hf} ({kind}, transformers, random weights): "
                f"{s.num_layers} layers, {s.num_experts} experts top-{s.top_k}")

    def layout_line(self) -> str:
        L = self.cfg.layout
        if L.nproc == 1:
            return ""
        return (f"expert parallel: transformers' own, ep {L.ep} x FSDP2 over {L.nproc} "
                f"ranks (gloo), {self.sizes.num_experts // L.ep} experts each; step "
                f"lines are rank 0's, peak the cluster's")

    @staticmethod
    def guard_line(guard) -> str:
        return (f"guard: {len(guard.moe_blocks)} MoE blocks "
                f"({type(guard.moe_blocks[0]).__name__}), experts call planned as one "
                f"region; bytes per routed copy {guard.shape.source}: keep "
                f"{guard.shape.save_per_token} B, recompute keeps "
                f"{guard.shape.recompute_per_token} B")


def _world(groups):
    """The group a probe's peak is the worst over: every rank's, or None alone."""
    return dist.group.WORLD if groups is not None else None


__all__ = ["BuiltinFamily", "HFFamily", "HF_AUTO_FRACTION", "family_class", "family_for"]
