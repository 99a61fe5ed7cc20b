"""The built-in decoder-only MoE transformer: embedding, RMSNorm, causal attention, MoE.

B = batch, T = sequence length, D = model width, V = vocabulary. Single-device code:
memory management and parallelism are applied to a finished model from outside.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from spikeguard.model.config import ModelConfig
from spikeguard.model.moe import MoEBlock


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention on `scaled_dot_product_attention`."""

    def __init__(self, d_model: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.proj = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        B, T, D = x_BTD.shape
        q, k, v = self.qkv(x_BTD).view(B, T, 3, self.num_heads, D // self.num_heads).unbind(2)
        out_BHTd = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.proj(out_BHTd.transpose(1, 2).reshape(B, T, D))


class TransformerBlock(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + moe(norm(x))."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.attn_norm = nn.RMSNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg.d_model, cfg.num_heads)
        self.moe_norm = nn.RMSNorm(cfg.d_model)
        self.moe = MoEBlock(cfg.d_model, cfg.num_experts, cfg.top_k, cfg.d_expert,
                            cfg.num_shared_experts, cfg.router_bias, layer_idx)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        x_BTD = x_BTD + self.attn(self.attn_norm(x_BTD))
        return x_BTD + self.moe(self.moe_norm(x_BTD))


@dataclass
class ModelOutput:
    logits_BTV: torch.Tensor
    loss: Optional[torch.Tensor]       # cross-entropy + aux_loss_coef * aux_loss
    ce_loss: Optional[torch.Tensor]
    aux_loss: torch.Tensor             # mean over MoE layers


class MoETransformer(nn.Module):
    """Token + learned position embedding, N blocks, final RMSNorm, untied LM head."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(TransformerBlock(cfg, i) for i in range(cfg.num_layers))
        self.norm = nn.RMSNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        nn.init.normal_(self.tok_emb.weight, std=0.02)
        nn.init.normal_(self.pos_emb.weight, std=0.02)

    def moe_blocks(self) -> list[MoEBlock]:
        return [b.moe for b in self.blocks]

    def forward(self, idx_BT: torch.Tensor, targets_BT: Optional[torch.Tensor] = None) -> ModelOutput:
        T = idx_BT.shape[1]
        if T > self.cfg.seq_len:
            raise ValueError(f"sequence of {T} tokens exceeds seq_len {self.cfg.seq_len}")
        pos_T = torch.arange(T, device=idx_BT.device)
        x_BTD = self.tok_emb(idx_BT) + self.pos_emb(pos_T)
        aux_losses = []
        for block in self.blocks:
            x_BTD = block(x_BTD)
            aux_losses.append(block.moe.last_aux_loss)
        logits_BTV = self.lm_head(self.norm(x_BTD))
        aux_loss = torch.stack(aux_losses).mean()
        if targets_BT is None:
            return ModelOutput(logits_BTV, None, None, aux_loss)
        ce = F.cross_entropy(logits_BTV.reshape(-1, logits_BTV.shape[-1]), targets_BT.reshape(-1))
        return ModelOutput(logits_BTV, ce + self.cfg.aux_loss_coef * aux_loss, ce, aux_loss)


def build_model(cfg: ModelConfig, seed: int = 0) -> MoETransformer:
    """A model with deterministic initial weights for `seed`."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return MoETransformer(cfg)
