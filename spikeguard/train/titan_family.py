"""`spikeguard train --titan NAME`: a tiny torchtitan MoE model in the one training loop.

    .venv/bin/spikeguard train --titan deepseek_v3 --steps 20 --budget auto
    .venv/bin/spikeguard train --titan deepseek_v3 --nproc 2 --ep 2 --steps 20 --budget auto

The family (how a micro-batch is fed and scored: `model(idx_BT)` gives logits, the loss
is next-byte cross-entropy), the engine under torchtitan's own expert parallelism
(`TitanEngine`: the experts are torchtitan's DTensors, sharded by its
`Module.parallelize`, not spikeguard's `parallelize_experts`), and the auto budget's
probe. Imports torchtitan only through spikeguard.integrations.titan_models.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch import nn

from spikeguard.errors import UsageError
from spikeguard.integrations.titan_models import TitanSizes, build_titan_model, lm_loss
from spikeguard.parallel.gradients import clip_grads_, sum_grads
from spikeguard.train.engines import LocalEngine

# torchtitan's router asks CPU autocast for float32, which CPU autocast does not do; the
# warning says so once per process and changes nothing (the gate runs in float32 anyway).
warnings.filterwarnings("ignore", message="In CPU autocast")


class TitanFamily:
    """A torchtitan decoder: a micro-batch is (idx_BT, targets_BT), its forward the logits.
    Under a process group the experts are sharded by torchtitan's own EP at build."""

    name = "titan"
    token_offset = 0
    own_parallelism = False   # TitanEngine reduces what torchtitan's EP does not
    budget_by_default = False

    def __init__(self, cfg):
        self.cfg = cfg
        self.sizes = cfg.model.shape
        self.seq_len = self.sizes.seq_len

    @staticmethod
    def sizes_of(choice):
        """TitanSizes from the overrides given."""
        return TitanSizes(**choice.overrides)

    @staticmethod
    def check_run(cfg, layout) -> None:
        """What --titan runs: one process, or torchtitan's own EP over all ranks."""
        for what, refused in (("--pp", layout.pp != 1), ("--ep below --nproc (data "
                              "parallel)", layout.ep != layout.nproc),
                              ("--skew", cfg.skew.pattern is not None),
                              ("--trace", cfg.files.trace is not None),
                              ("--record-trace", cfg.files.record_trace is not None),
                              ("--checkpoint-dir", cfg.files.checkpoint_dir is not None)):
            if refused:
                raise UsageError(f"{what} is not available with --titan: torchtitan models "
                                 f"train on one process or under torchtitan's own expert "
                                 f"parallelism (--nproc N --ep N), with its own routing")

    @staticmethod
    def moe_blocks(model: nn.Module) -> list:
        return []   # torchtitan's routed counts are read by the guard, not the step line

    @staticmethod
    def draw(corpus, split: str, batch_size: int, seq_len: int, gen) -> tuple:
        return corpus.get_batch(split, batch_size, seq_len, gen)

    @staticmethod
    def losses(model: nn.Module, batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        loss = lm_loss(model, *batch)
        return loss, loss, torch.zeros(())

    @staticmethod
    def eval_loss(model: nn.Module, batch) -> torch.Tensor:
        return lm_loss(model, *batch)

    def build(self) -> nn.Module:
        cfg = self.cfg
        return build_titan_model(cfg.model.titan, self.sizes, seed=cfg.train.seed,
                                 ep=cfg.layout.ep)

    def engine(self, model: nn.Module, groups) -> "TitanEngine":
        return TitanEngine(model, self, groups, grad_clip=self.cfg.train.grad_clip)

    def auto_budget(self, engine, batches: list, groups, held: str = "") -> tuple[int, str]:
        from spikeguard.train.auto_budget import auto_budget, auto_budget_line, calm_peak_bytes

        peak, static = calm_peak_bytes(engine, batches,
                                       group=dist.group.WORLD if groups is not None else None)
        budget = auto_budget(peak, static)
        return budget, auto_budget_line(peak, None, budget)

    def describe(self, engine) -> str:
        name, sizes, ep = self.cfg.model.titan, self.sizes, self.cfg.layout.ep
        per = f", {sizes.num_experts // ep} experts per rank (torchtitan's EP)" if ep > 1 else ""
        return (f"model {name} (torchtitan 0.3.0, random weights, SDPA attention): "
                f"{sizes.num_layers} layers (1 dense), {sizes.num_experts} experts "
                f"top-{sizes.top_k}{per}")

    def layout_line(self) -> str:
        L = self.cfg.layout
        if L.nproc == 1:
            return ""
        return (f"expert parallel: torchtitan's own, ep {L.ep} (gloo), "
                f"{self.sizes.num_experts // L.ep} experts each; step lines are rank 0's")

    @staticmethod
    def guard_line(guard) -> str:
        return ""


def is_sharded(p: torch.Tensor) -> bool:
    """A torchtitan expert weight under EP (a DTensor); the rest is replicated."""
    return type(p) is not torch.Tensor and type(p) is not nn.Parameter and hasattr(p, "to_local")


class TitanEngine(LocalEngine):
    """The local engine over a torchtitan model whose experts torchtitan sharded (EP =
    nproc, no data parallel): replicated gradients summed over the ranks; the experts'
    need none (the reverse all-to-all brought every rank's contribution to their owner);
    the clipped norm is the whole model's, the same on every rank."""

    def __init__(self, model: nn.Module, family, groups=None, *, grad_clip: float = 1.0):
        # Not LocalEngine's: its EP path shards spikeguard's own experts.
        super().__init__(model, family, None, grad_clip=grad_clip)
        self.groups = groups
        self.loss_scale = 1.0 / (groups.layout.nproc if groups is not None else 1)
        # The step line's imbalance, guard or not: torchtitan's MoE counts each training
        # forward's routing into its `tokens_per_expert_E` (its load-balancing buffer,
        # never reset here): a micro-batch's counts are the difference over its forward.
        self._blocks = [m for m in model.modules()
                        if torch.is_tensor(getattr(m, "tokens_per_expert_E", None))]
        self._counts_before: list = []

    def _before_micro_batch(self) -> None:
        self._counts_before = [b.tokens_per_expert_E.clone() for b in self._blocks]

    def _micro_batch_counts(self) -> list:
        return [(b.tokens_per_expert_E - before).tolist()
                for b, before in zip(self._blocks, self._counts_before)]

    def _reduce_grads(self) -> None:
        """The replicated parameters' gradients summed over the ranks, in place
        (spikeguard.parallel.gradients)."""
        sum_grads((p for p in self.model.parameters() if not is_sharded(p)), dist.group.WORLD)

    def _clip(self) -> float:
        if self.groups is None:
            return clip_grads_(self.model.parameters(), self.grad_clip).item()
        return clip_grads_(self.model.parameters(), self.grad_clip, sharded=is_sharded,
                           shard_group=dist.group.WORLD).item()

    def summarize(self, record: dict, step: int) -> dict:
        return {}


__all__ = ["TitanFamily", "TitanEngine"]
