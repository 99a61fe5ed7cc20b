"""load_balancing_loss on hand-computed cases, and what the TopKRouter feeds it.

T = tokens, E = experts, K = top-k.

    .venv/bin/python -m pytest tests/model/test_model_router.py -q
"""

from __future__ import annotations

import pytest
import torch

from spikeguard.model import TopKRouter, load_balancing_loss


def test_load_balancing_loss_hand_case_k1():
    # T=4, E=2, K=1. Tokens 0, 1, 3 go to expert 0, token 2 to expert 1.
    scores_TE = torch.tensor([[0.9, 0.1],
                              [0.6, 0.4],
                              [0.3, 0.7],
                              [0.8, 0.2]], requires_grad=True)
    topk_idx_TK = torch.tensor([[0], [0], [1], [0]])
    # f = [3/4, 1/4]; P = [(0.9+0.6+0.3+0.8)/4, (0.1+0.4+0.7+0.2)/4] = [0.65, 0.35]
    # E * sum f*P = 2 * (0.75*0.65 + 0.25*0.35) = 2 * 0.575 = 1.15
    loss = load_balancing_loss(scores_TE, topk_idx_TK)
    assert loss.item() == pytest.approx(1.15, abs=1e-6)
    # f is a constant: d loss / d scores[t, e] = E * f_e / T = [0.375, 0.125] on every row
    loss.backward()
    assert torch.allclose(scores_TE.grad, torch.tensor([[0.375, 0.125]]).expand(4, 2))


def test_load_balancing_loss_hand_case_k2_divides_by_copies():
    # T=2, E=3, K=2: 4 routed copies, expert 1 gets two of them.
    scores_TE = torch.tensor([[0.5, 0.3, 0.2],
                              [0.1, 0.6, 0.3]])
    topk_idx_TK = torch.tensor([[0, 1], [1, 2]])
    # f = [1/4, 2/4, 1/4]; P = [0.3, 0.45, 0.25]
    # 3 * (0.25*0.3 + 0.5*0.45 + 0.25*0.25) = 3 * 0.3625 = 1.0875
    loss = load_balancing_loss(scores_TE, topk_idx_TK)
    assert loss.item() == pytest.approx(1.0875, abs=1e-6)


def test_load_balancing_loss_is_one_when_uniform_and_balanced():
    num_tokens, num_experts = 8, 4   # top-2: two copies per token
    scores_TE = torch.full((num_tokens, num_experts), 1.0 / num_experts)
    topk_idx_TK = torch.tensor([[t % 4, (t + 1) % 4] for t in range(num_tokens)])
    assert torch.bincount(topk_idx_TK.flatten()).tolist() == [4, 4, 4, 4]
    assert load_balancing_loss(scores_TE, topk_idx_TK).item() == pytest.approx(1.0, abs=1e-6)
    # routing collapsed onto experts 0 and 1 with scores that agree: f = [.5, .5, 0, 0],
    # P = [.7, .1, .1, .1] -> 4 * (0.5*0.7 + 0.5*0.1) = 1.6
    collapsed_TK = torch.tensor([[0, 1]] * num_tokens)
    skewed_TE = torch.tensor([[0.7, 0.1, 0.1, 0.1]] * num_tokens)
    assert load_balancing_loss(skewed_TE, collapsed_TK).item() == pytest.approx(1.6, abs=1e-6)


def test_router_bias_changes_selection_not_weights():
    torch.manual_seed(0)
    router = TopKRouter(8, 4, 2, use_bias=True)
    x_TD = torch.randn(16, 8)
    plain = router(x_TD)
    router.expert_bias_E.copy_(torch.tensor([0.0, 0.0, 0.0, 5.0]))
    biased = router(x_TD)

    torch.testing.assert_close(biased.scores_TE, plain.scores_TE, rtol=0, atol=0)
    assert (biased.topk_idx_TK == 3).any(dim=-1).all()       # every token now picks expert 3
    picked_TK = plain.scores_TE.gather(-1, biased.topk_idx_TK)
    torch.testing.assert_close(biased.topk_weight_TK, picked_TK / picked_TK.sum(-1, keepdim=True))
    assert torch.allclose(biased.topk_weight_TK.sum(-1), torch.ones(16))
    # the aux loss sees the biased selection
    torch.testing.assert_close(biased.aux_loss,
                               load_balancing_loss(plain.scores_TE, biased.topk_idx_TK))
    assert not torch.allclose(biased.aux_loss, plain.aux_loss)


def test_router_bias_is_saved_only_with_the_flag():
    assert "expert_bias_E" in TopKRouter(8, 4, 2, use_bias=True).state_dict()
    assert "expert_bias_E" not in TopKRouter(8, 4, 2, use_bias=False).state_dict()
