"""MoEBlock against a naive per-token reference, its per-expert counts, and the expert-runner seam.

T = tokens, D = model width, E = experts, K = top-k, F = expert hidden width, H = shared
hidden width, N = routed token copies (T*K).

    .venv/bin/python -m pytest tests/model/test_model_moe.py -q
"""

from __future__ import annotations

import pytest
import torch

from spikeguard.model import LocalDispatcher, MoEBlock

D, F = 16, 24

# float32: the block multiplies whole expert slices (x_ND @ w13[e]) and sums copies with
# index_add, the reference takes per-token vector products and adds experts in top-k
# order. Same math, different summation order: the differences are float32 rounding over
# D=16 / F=24 / T=12 terms, measured <= 3e-6 absolute on values up to ~13 (the gate
# gradient), i.e. ~2e-7 relative. rtol=atol=1e-5 leaves margin, while a real error (a
# weight from the biased scores, a missed renormalisation, swapped W1/W3) is >= 1e-2.
RTOL, ATOL = 1e-5, 1e-5


def _silu(z: torch.Tensor) -> torch.Tensor:
    return z * torch.sigmoid(z)


def reference_moe_TD(block: MoEBlock, x_TD: torch.Tensor) -> tuple[torch.Tensor, list[list[int]]]:
    """Token by token: softmax, top-k by (scores + bias), weights from the unbiased scores."""
    gate_ED = block.router.gate.weight
    bias_E = block.router.expert_bias_E
    w13_ED2F = block.experts.w13_ED2F
    w2_EFD = block.experts.w2_EFD
    num_experts, d_expert, top_k = w13_ED2F.shape[0], block.experts.d_expert, block.router.top_k
    rows, chosen_TK = [], []
    for t in range(x_TD.shape[0]):
        x_D = x_TD[t]
        logits_E = gate_ED @ x_D
        exp_E = torch.exp(logits_E - logits_E.max())
        scores_E = exp_E / exp_E.sum()
        chosen = sorted(range(num_experts), key=lambda e: float(scores_E[e].detach() + bias_E[e]),
                        reverse=True)[:top_k]
        chosen_TK.append(chosen)
        total = sum(scores_E[e] for e in chosen)
        y_D = torch.zeros_like(x_D)
        for e in chosen:
            w1_DF, w3_DF = w13_ED2F[e][:, :d_expert], w13_ED2F[e][:, d_expert:]
            a_F = _silu(x_D @ w1_DF) * (x_D @ w3_DF)
            y_D = y_D + (scores_E[e] / total) * (a_F @ w2_EFD[e])
        if block.shared is not None:
            w13_HD = block.shared.w13.weight       # nn.Linear stores (out, in)
            hidden = w13_HD.shape[0] // 2
            w1_HD, w3_HD = w13_HD[:hidden], w13_HD[hidden:]
            a_H = _silu(w1_HD @ x_D) * (w3_HD @ x_D)
            y_D = y_D + block.shared.w2.weight @ a_H
        rows.append(y_D)
    return torch.stack(rows), chosen_TK


def _params(block: MoEBlock) -> dict[str, torch.Tensor]:
    named = {"router.gate": block.router.gate.weight, "w13_ED2F": block.experts.w13_ED2F,
             "w2_EFD": block.experts.w2_EFD}
    if block.shared is not None:
        named["shared.w13"] = block.shared.w13.weight
        named["shared.w2"] = block.shared.w2.weight
    return named


def _make_block(num_experts=4, top_k=2, num_shared_experts=0, router_bias=False, seed=0):
    torch.manual_seed(seed)
    return MoEBlock(D, num_experts, top_k, F, num_shared_experts=num_shared_experts,
                    router_bias=router_bias)


# bias vectors large next to softmax scores (~1/E): they change many selections, and the
# -10 keeps the last expert empty so the zero-token slice path runs too.
BIAS_CASES = {
    "no_bias": (False, None),
    "flag_and_bias": (True, [0.3, 0.0, -0.2, -10.0]),
    "bias_without_flag": (False, [-0.3, 0.25, 0.0, 0.1]),
}


@pytest.mark.parametrize("num_shared_experts", [0, 1, 2])
@pytest.mark.parametrize("bias_case", list(BIAS_CASES))
def test_block_output_and_grads_match_naive_reference(num_shared_experts, bias_case):
    router_bias, bias = BIAS_CASES[bias_case]
    block = _make_block(num_shared_experts=num_shared_experts, router_bias=router_bias)
    if num_shared_experts:   # shared experts fuse into one SwiGLU of width F * count
        assert block.shared.w2.weight.shape == (D, F * num_shared_experts)
    else:
        assert block.shared is None
    if bias is not None:
        block.router.expert_bias_E.copy_(torch.tensor(bias))
    torch.manual_seed(1)
    x_BTD = torch.randn(2, 6, D)
    g_BTD = torch.randn(2, 6, D)

    x_block = x_BTD.clone().requires_grad_(True)
    out_BTD = block(x_block)
    names = list(_params(block))
    grads_block = torch.autograd.grad((out_BTD * g_BTD).sum(),
                                      [x_block, *_params(block).values()])

    x_ref = x_BTD.clone().requires_grad_(True)
    ref_TD, chosen_TK = reference_moe_TD(block, x_ref.reshape(-1, D))
    grads_ref = torch.autograd.grad((ref_TD * g_BTD.reshape(-1, D)).sum(),
                                    [x_ref, *_params(block).values()], allow_unused=True)
    grads_ref = [torch.zeros_like(p) if g is None else g
                 for g, p in zip(grads_ref, [x_ref, *_params(block).values()])]

    topk_idx_TK = block.route(x_BTD.reshape(-1, D)).topk_idx_TK
    assert [sorted(r) for r in topk_idx_TK.tolist()] == [sorted(r) for r in chosen_TK]
    if bias is not None:   # the bias must actually have changed some selection
        unbiased_TK = torch.topk(block.route(x_BTD.reshape(-1, D)).scores_TE, 2, dim=-1).indices
        assert [sorted(r) for r in unbiased_TK.tolist()] != [sorted(r) for r in chosen_TK]

    torch.testing.assert_close(out_BTD, ref_TD.reshape(x_BTD.shape), rtol=RTOL, atol=ATOL)
    if bias_case == "flag_and_bias":
        assert block.last_tokens_per_expert[3] == 0
    for name, g_block, g_ref in zip(["x", *names], grads_block, grads_ref):
        assert g_block.abs().sum() > 0, name
        torch.testing.assert_close(g_block, g_ref, rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("num_experts,top_k", [(4, 1), (8, 3), (4, 4)])
def test_block_matches_reference_for_other_k(num_experts, top_k):
    block = _make_block(num_experts=num_experts, top_k=top_k, num_shared_experts=1, seed=3)
    x_TD = torch.randn(10, D)
    ref_TD, _ = reference_moe_TD(block, x_TD)
    torch.testing.assert_close(block(x_TD), ref_TD, rtol=RTOL, atol=ATOL)


def test_counts_are_host_ints_equal_to_bincount_and_rows_grouped_by_expert():
    block = _make_block(num_experts=8, top_k=3, seed=5)
    x_TD = torch.randn(20, D)
    block(x_TD)
    routing = block.route(x_TD)
    expected = torch.bincount(routing.topk_idx_TK.flatten(), minlength=8).tolist()

    dispatched = LocalDispatcher().dispatch(x_TD, routing)
    for counts in (block.last_tokens_per_expert, dispatched.tokens_per_expert):
        assert counts == expected
        assert all(type(c) is int for c in counts)
    assert sum(expected) == 20 * 3

    starts = [0]
    for c in expected:
        starts.append(starts[-1] + c)
    for e in range(8):
        tokens_e = [t for t, row in enumerate(routing.topk_idx_TK.tolist()) if e in row]
        rows_e = dispatched.x_ND[starts[e]:starts[e + 1]]
        assert torch.equal(rows_e, x_TD[tokens_e])
        assert dispatched.token_idx_N[starts[e]:starts[e + 1]].tolist() == tokens_e


def _staged_runner(block, dispatched):
    counts = dispatched.tokens_per_expert
    experts = block.experts
    return experts.down(experts.act(experts.gate_up(dispatched.x_ND, counts)), counts)


@pytest.mark.parametrize("num_shared_experts", [0, 1])
def test_expert_runner_seam(num_shared_experts):
    block = _make_block(num_shared_experts=num_shared_experts, seed=7)
    x_TD = torch.randn(12, D, requires_grad=True)
    default_TD = block(x_TD)
    default_grads = torch.autograd.grad(default_TD.sum(), [x_TD, *_params(block).values()])

    calls = []

    def recording_runner(b, dispatched):
        calls.append((b, list(dispatched.tokens_per_expert)))
        return _staged_runner(b, dispatched)

    block.expert_runner = recording_runner
    staged_TD = block(x_TD)
    assert len(calls) == 1
    assert calls[0][0] is block and calls[0][1] == block.last_tokens_per_expert
    assert torch.equal(staged_TD, default_TD)
    staged_grads = torch.autograd.grad(staged_TD.sum(), [x_TD, *_params(block).values()])
    for g_default, g_staged in zip(default_grads, staged_grads):
        assert torch.equal(g_default, g_staged)

    block.expert_runner = lambda b, d: torch.zeros_like(d.x_ND)
    zeros_TD = block(x_TD)
    assert not torch.allclose(zeros_TD, default_TD)
    expected_TD = torch.zeros_like(x_TD) if block.shared is None else block.shared(x_TD)
    assert torch.equal(zeros_TD, expected_TD)

    block.expert_runner = None
    assert torch.equal(block(x_TD), default_TD)
