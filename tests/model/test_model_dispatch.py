"""LocalDispatcher on a hand-written routing: counts, grouping, combine.

T = tokens, D = model width, E = experts, K = top-k, N = routed token copies (T*K).

    .venv/bin/python -m pytest tests/model/test_model_dispatch.py -q
"""

from __future__ import annotations

import torch

from spikeguard.model import LocalDispatcher, Routing


def _routing(topk_idx_TK: torch.Tensor, topk_weight_TK: torch.Tensor, num_experts: int) -> Routing:
    num_tokens = topk_idx_TK.shape[0]
    scores_TE = torch.full((num_tokens, num_experts), 1.0 / num_experts)
    return Routing(topk_idx_TK, topk_weight_TK, scores_TE, torch.tensor(0.0))


def test_dispatch_hand_case_with_an_empty_expert():
    # T=4, E=4, K=2; expert 2 gets nothing.
    topk_idx_TK = torch.tensor([[3, 0], [0, 1], [1, 3], [0, 3]])
    topk_weight_TK = torch.tensor([[0.6, 0.4], [0.5, 0.5], [0.9, 0.1], [0.3, 0.7]])
    x_TD = torch.arange(4 * 3, dtype=torch.float32).reshape(4, 3)

    dispatched = LocalDispatcher().dispatch(x_TD, _routing(topk_idx_TK, topk_weight_TK, 4))

    assert dispatched.tokens_per_expert == [3, 2, 0, 3]
    assert dispatched.tokens_per_expert == torch.bincount(topk_idx_TK.flatten(), minlength=4).tolist()
    assert all(type(c) is int for c in dispatched.tokens_per_expert)
    # expert 0: tokens 0, 1, 3; expert 1: tokens 1, 2; expert 3: tokens 0, 2, 3
    assert dispatched.token_idx_N.tolist() == [0, 1, 3, 1, 2, 0, 2, 3]
    assert torch.equal(dispatched.x_ND, x_TD[[0, 1, 3, 1, 2, 0, 2, 3]])
    assert torch.equal(dispatched.weight_N,
                       torch.tensor([0.4, 0.5, 0.3, 0.5, 0.9, 0.6, 0.1, 0.7]))
    assert dispatched.num_tokens == 4


def test_combine_is_the_weighted_sum_per_token():
    topk_idx_TK = torch.tensor([[3, 0], [0, 1], [1, 3], [0, 3]])
    topk_weight_TK = torch.tensor([[0.75, 0.25], [0.5, 0.5], [1.0, 0.0], [0.25, 0.75]])
    x_TD = torch.randn(4, 3)
    dispatcher = LocalDispatcher()
    dispatched = dispatcher.dispatch(x_TD, _routing(topk_idx_TK, topk_weight_TK, 4))
    # expert e multiplies by (e + 1): the combined row is x_t * sum_k w_tk * (e_tk + 1)
    scale_N = (torch.tensor([0, 0, 0, 1, 1, 3, 3, 3]) + 1).float()
    out_TD = dispatcher.combine(dispatched.x_ND * scale_N.unsqueeze(-1), dispatched)
    factor_T = (topk_weight_TK * (topk_idx_TK + 1)).sum(-1)
    torch.testing.assert_close(out_TD, x_TD * factor_T.unsqueeze(-1))
