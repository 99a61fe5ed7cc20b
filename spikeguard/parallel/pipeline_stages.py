"""Pipeline stages cut from a finished MoETransformer, and the PipelineStage that runs them.

B = sequences per micro-batch, T = sequence length, D = model width, V = vocabulary.

    model = build_model(cfg)
    module = stage_module(model, stage=s, num_stages=p)          # layers [lo, hi) of p cuts
    stage = pipeline_stage(module, s, p, micro_batch_shape=(B, T), group=pp_group)
    schedule = Schedule1F1B(stage, n_microbatches=M, loss_fn=stage_loss)

The first stage holds the embeddings, the last the final norm and the head and returns
log-probabilities: the loss (`stage_loss`, a negative log-likelihood) is then the only
thing computed outside the stage module, and the log-softmax autograd keeps for backward
is saved inside the guarded forward where the ledger counts it. `nll_loss(log_softmax(x))`
is exactly what `cross_entropy(x)` computes (torch 2.13 implements it that way), so the
cross-entropy part is the same arithmetic as the single-process model's.

The load-balancing loss is a term of every layer, not of the last stage's output. Each
stage adds it where it arises with `AuxLossBackprop` (Megatron-Core's
MoEAuxLossAutoScaler idea): the hidden state passes through unchanged and the backward
gives the layer's aux term the gradient it has in the single-process loss,
coef / num_layers (the pipeline schedule divides every gradient by the number of
micro-batches afterwards, as it does the cross-entropy's).

Stage modules share their submodules with the model they were cut from (no copy). Their
MoE blocks are renumbered 0..n-1 (the guard indexes its layers that way); `first_layer`
maps them back to the model's layer numbers for the logs.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from spikeguard.errors import UsageError
from spikeguard.model.moe import MoEBlock


class AuxLossBackprop(torch.autograd.Function):
    """Identity on the hidden state; in backward, gradient 1 for the (scaled) aux loss."""

    @staticmethod
    def forward(ctx, x_BTD: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
        ctx.aux_shape = aux_loss.shape
        return x_BTD.view_as(x_BTD)

    @staticmethod
    def backward(ctx, grad_BTD: torch.Tensor):
        return grad_BTD, torch.ones(ctx.aux_shape, dtype=grad_BTD.dtype, device=grad_BTD.device)


def layer_split(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """[lo, hi) layers of each stage: equal cuts (the layout check demands divisibility)."""
    if num_stages < 1 or num_layers % num_stages:
        raise UsageError(f"{num_stages} pipeline stages must divide the {num_layers} layers")
    per = num_layers // num_stages
    return [(s * per, (s + 1) * per) for s in range(num_stages)]


class StageModule(nn.Module):
    """Layers [lo, hi) of a MoETransformer, with the embeddings first and the head last."""

    def __init__(self, model: nn.Module, lo: int, hi: int, is_first: bool, is_last: bool):
        super().__init__()
        self.cfg = model.cfg
        self.first_layer = lo
        self.is_first, self.is_last = is_first, is_last
        self.tok_emb = model.tok_emb if is_first else None
        self.pos_emb = model.pos_emb if is_first else None
        self.blocks = nn.ModuleList(model.blocks[lo:hi])
        self.norm = model.norm if is_last else None
        self.lm_head = model.lm_head if is_last else None
        self.aux_scale = model.cfg.aux_loss_coef / model.cfg.num_layers
        for local, block in enumerate(self.blocks):
            block.layer_idx = block.moe.layer_idx = local

    def moe_blocks(self) -> list[MoEBlock]:
        return [b.moe for b in self.blocks]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_first:
            T = x.shape[1]
            x = self.tok_emb(x) + self.pos_emb(torch.arange(T, device=x.device))
        for block in self.blocks:
            x = block(x)
            if self.aux_scale:
                x = AuxLossBackprop.apply(x, block.moe.last_aux_loss * self.aux_scale)
        if self.is_last:
            return F.log_softmax(self.lm_head(self.norm(x)), dim=-1)
        return x


def stage_module(model: nn.Module, stage: int, num_stages: int) -> StageModule:
    """Stage `stage` of `num_stages` equal cuts of `model` (shares its parameters)."""
    if not 0 <= stage < num_stages:
        raise UsageError(f"stage {stage} is not in 0..{num_stages - 1}")
    lo, hi = layer_split(model.cfg.num_layers, num_stages)[stage]
    return StageModule(model, lo, hi, stage == 0, stage == num_stages - 1)


def stage_loss(logp_BTV: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
    """The cross-entropy of the last stage's log-probabilities (mean over tokens)."""
    return F.nll_loss(logp_BTV.reshape(-1, logp_BTV.shape[-1]), targets_BT.reshape(-1))


def pipeline_stage(module: nn.Module, stage: int, num_stages: int, micro_batch_shape,
                   group=None, device: Optional[torch.device] = None):
    """A PipelineStage with all four shape metadata given (meta tensors), so the first
    `step()` runs no shape-inference forward: every forward the guard sees is a real
    micro-batch."""
    from torch.distributed.pipelining import PipelineStage

    cfg = module.cfg
    B, T = micro_batch_shape
    meta = torch.device("meta")
    if module.is_first:
        inputs = torch.empty(B, T, dtype=torch.long, device=meta)
        input_grads = (None,)
    else:
        # requires_grad: the stage builds its receive buffers from this metadata, and a
        # buffer that does not require grad sends no gradient back to the stage before.
        inputs = torch.empty(B, T, cfg.d_model, device=meta, requires_grad=True)
        input_grads = torch.empty(B, T, cfg.d_model, device=meta)
    width = cfg.vocab_size if module.is_last else cfg.d_model
    outputs = torch.empty(B, T, width, device=meta, requires_grad=True)
    output_grads = (None,) if module.is_last else torch.empty(B, T, width, device=meta)
    device = device or next(module.parameters()).device
    return PipelineStage(module, stage, num_stages, device, input_args=inputs,
                         output_args=outputs, input_grads=input_grads,
                         output_grads=output_grads, group=group)
