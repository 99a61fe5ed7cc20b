"""MoETransformer forward, loss composition, seq_len guard, and build_model determinism.

B = batch, T = sequence length, V = vocabulary.

    .venv/bin/python -m pytest tests/model/test_model_transformer.py -q
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from spikeguard.model import build_model, model_config


@pytest.fixture
def cfg():
    # a large coefficient so that a dropped or mis-scaled aux term is visible
    return model_config("tiny", aux_loss_coef=0.5)


def test_forward_shapes_without_targets(cfg):
    model = build_model(cfg, seed=0)
    idx_BT = torch.randint(0, cfg.vocab_size, (3, 10))
    out = model(idx_BT)
    assert out.logits_BTV.shape == (3, 10, cfg.vocab_size)
    assert out.loss is None and out.ce_loss is None
    assert out.aux_loss.shape == ()


def test_loss_is_ce_plus_coef_times_mean_aux(cfg):
    model = build_model(cfg, seed=0)
    idx_BT = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
    targets_BT = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
    out = model(idx_BT, targets_BT)

    ce = F.cross_entropy(out.logits_BTV.reshape(-1, cfg.vocab_size), targets_BT.reshape(-1))
    aux = torch.stack([b.last_aux_loss for b in model.moe_blocks()]).mean()
    assert len(model.moe_blocks()) == cfg.num_layers
    assert torch.equal(out.ce_loss, ce)
    assert torch.equal(out.aux_loss, aux)
    assert torch.equal(out.loss, ce + 0.5 * aux)
    assert out.aux_loss.item() > 0
    assert out.loss.item() > out.ce_loss.item()


def test_sequence_longer_than_seq_len_raises(cfg):
    model = build_model(cfg, seed=0)
    model(torch.zeros(1, cfg.seq_len, dtype=torch.long))
    with pytest.raises(ValueError, match="seq_len"):
        model(torch.zeros(1, cfg.seq_len + 1, dtype=torch.long))


def test_build_model_is_deterministic_and_leaves_global_rng_alone(cfg):
    torch.manual_seed(123)
    state_before = torch.get_rng_state()
    a = build_model(cfg, seed=7)
    assert torch.equal(torch.get_rng_state(), state_before)
    torch.manual_seed(999)
    b = build_model(cfg, seed=7)
    c = build_model(cfg, seed=8)

    sd_a, sd_b, sd_c = a.state_dict(), b.state_dict(), c.state_dict()
    assert list(sd_a) == list(sd_b)
    for name in sd_a:
        assert torch.equal(sd_a[name], sd_b[name]), name
    assert not torch.equal(sd_a["tok_emb.weight"], sd_c["tok_emb.weight"])
    assert not torch.equal(sd_a["blocks.0.moe.experts.w13_ED2F"],
                           sd_c["blocks.0.moe.experts.w13_ED2F"])
