"""ModelConfig validation, model_config presets and overrides.

    .venv/bin/python -m pytest tests/model/test_model_config.py -q
"""

from __future__ import annotations

import pytest
import torch

from spikeguard.errors import UsageError
from spikeguard.model import PRESETS, ModelConfig, build_model, model_config


@pytest.mark.parametrize("kwargs", [
    {"num_experts": 4, "top_k": 5},
    {"d_model": 0},
    {"num_layers": -1},
    {"seq_len": 0},
    {"vocab_size": 0},
    {"num_heads": 0},
    {"num_experts": 0},
    {"top_k": 0},
    {"d_expert": -8},
    {"d_model": 64.0},
    {"num_layers": True},
    {"num_shared_experts": -1},
    {"aux_loss_coef": -0.1},
    {"d_model": 30, "num_heads": 4},
], ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_bad_config_raises_usage_error(kwargs):
    with pytest.raises(UsageError, match=f"model.{next(iter(kwargs))}"):
        ModelConfig(**kwargs)


def test_default_config_is_valid_and_serialisable():
    cfg = ModelConfig()
    assert cfg.to_dict()["num_experts"] == cfg.num_experts
    assert ModelConfig(**cfg.to_dict()) == cfg


def test_model_config_unknown_preset_and_override():
    with pytest.raises(UsageError, match="unknown preset"):
        model_config("huge")
    with pytest.raises(UsageError, match="d_modle"):
        model_config("tiny", d_modle=64)


def test_model_config_overrides_are_applied_and_validated():
    cfg = model_config("tiny", num_experts=8, top_k=None)
    assert cfg.num_experts == 8
    assert cfg.top_k == PRESETS["tiny"].top_k          # None means "keep the preset"
    assert PRESETS["tiny"].num_experts == 4             # the preset itself is not mutated
    with pytest.raises(UsageError, match="top_k .* cannot exceed model.num_experts"):
        model_config("tiny", top_k=PRESETS["tiny"].num_experts + 1)


@pytest.mark.parametrize("preset", ["tiny", "small", "medium"])
def test_presets_build_and_run_forward(preset):
    cfg = model_config(preset)
    model = build_model(cfg, seed=0)
    idx_BT = torch.randint(0, cfg.vocab_size, (1, 8))
    with torch.no_grad():
        out = model(idx_BT, idx_BT)
    assert out.logits_BTV.shape == (1, 8, cfg.vocab_size)
    assert torch.isfinite(out.loss)
    for block in model.moe_blocks():
        assert sum(block.last_tokens_per_expert) == 8 * cfg.top_k
        assert (block.shared is not None) == (cfg.num_shared_experts > 0)
