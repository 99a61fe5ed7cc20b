"""Shared helpers of the Hugging Face integration tests: tiny configs, steps, gradients.

B = sequences per micro-batch, T = tokens per sequence. Models are built offline with
random weights (spikeguard.integrations.hf_models); every test module that imports this
one is skipped where transformers is not installed (CI installs it: the `dev` extra).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

pytest.importorskip("transformers")

from spikeguard.integrations.hf_models import HFSizes, build_hf_model  # noqa: E402

ARCHITECTURES = ("mixtral", "qwen3_moe", "olmoe")
SIZES = HFSizes(d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, num_experts=4,
                top_k=2, d_expert=64, seq_len=32)
HUGE = 1 << 40


def windows(seed: int = 1, sizes=(4, 4)) -> list[torch.Tensor]:
    """Token windows (B, T+1): transformers shifts the labels inside its loss."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (b, SIZES.seq_len + 1), generator=gen) for b in sizes]


def build(name: str, **kwargs):
    return build_hf_model(name, SIZES, seed=0, **kwargs)


def step(model, batches, guard=None) -> dict[str, torch.Tensor]:
    """One step of gradient accumulation over `batches`; the gradients it left."""
    for p in model.parameters():
        p.grad = None
    with guard.step() if guard is not None else contextlib.nullcontext():
        for w_BT in batches:
            model(input_ids=w_BT, labels=w_BT).loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def assert_bitwise(expected: dict, actual: dict) -> None:
    assert expected.keys() == actual.keys()
    differ = [name for name in expected if not torch.equal(expected[name], actual[name])]
    assert not differ, f"gradients differ from the unguarded model's: {differ}"


def tiny_qwen3_moe(**config):
    """The tiny Qwen3-MoE the Trainer tests train (seed 0), built from transformers' own
    config, as a Trainer user builds one (`config`: more of its settings)."""
    import transformers
    torch.manual_seed(0)
    cfg = transformers.AutoConfig.for_model(
        "qwen3_moe", hidden_size=32, intermediate_size=64, moe_intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        num_experts=4, num_experts_per_tok=2, vocab_size=256, **config)
    return transformers.AutoModelForCausalLM.from_config(cfg)
