"""Shared experts and dense layers: a static policy of their own, `shared_policy`.

Qwen2-MoE has a shared expert (and its sigmoid gate) beside the routed experts; DeepSeek-V3
has shared experts and dense first layers; the built-in `tiny` preset's blocks have a
shared SwiGLU. Under shared_policy="recompute" those run under a plain checkpoint: the
bytes kept for them drop, gradients stay bitwise equal, detach removes the wrappers.

    .venv/bin/python -m pytest tests/integrations/test_integrations_shared_policy.py -q
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import spikeguard
from spikeguard.model import build_model, model_config

pytestmark = pytest.mark.timeout(120)

HUGE = 1 << 40


def _hf(name: str):
    pytest.importorskip("transformers")
    from spikeguard.integrations.hf_models import HFSizes, build_hf_model

    sizes = HFSizes(d_model=32, num_layers=3, num_heads=4, num_kv_heads=2, num_experts=4,
                    top_k=2, d_expert=32, seq_len=32)
    return build_hf_model(name, sizes)


def _builtin():
    return build_model(model_config("tiny", num_shared_experts=1))


def _hf_loss(model, tokens):
    return model(input_ids=tokens, labels=tokens).loss


def _builtin_loss(model, tokens):
    return model(tokens[:, :-1], tokens[:, 1:]).loss


def _run(model, loss_of, batches, guard=None):
    """Gradients of one step, and per micro-batch the bytes kept outside the expert path
    (attention and shared modules) at the end of its forward."""
    for p in model.parameters():
        p.grad = None
    kept = []
    with guard.step() if guard is not None else contextlib.nullcontext():
        for tokens in batches:
            loss = loss_of(model, tokens)
            if guard is not None:
                kept.append(guard.ledger.bytes_by(op="shared") + guard.ledger.bytes_by(op="attn"))
            loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, kept


@pytest.mark.parametrize("which", ["builtin", "qwen2_moe", "deepseek_v3"])
@pytest.mark.parametrize("policy", ["adaptive", "none", "full", "experts"])
def test_recomputed_shared_modules_bitwise_and_smaller(which, policy):
    if which == "builtin":
        model, loss_of = _builtin(), _builtin_loss
    else:
        model, loss_of = _hf(which), _hf_loss
    gen = torch.Generator().manual_seed(2)
    batches = [torch.randint(0, 256, (2, 33), generator=gen) for _ in range(2)]
    reference, _ = _run(model, loss_of, batches)
    kept = {}
    for shared_policy in ("keep", "recompute"):
        guard = spikeguard.attach(model, budget=HUGE, policy=policy, shared_policy=shared_policy)
        wrapped = list(guard.recomputed_modules)
        try:
            grads, kept[shared_policy] = _run(model, loss_of, batches, guard)
        finally:
            guard.detach()
        differ = [n for n in reference if not torch.equal(reference[n], grads[n])]
        assert not differ, f"{shared_policy}: gradients differ: {differ}"
        assert all("forward" not in vars(m) for m in wrapped)
    assert bool(wrapped)
    if policy != "full":  # under full every layer keeps only its input either way
        assert kept["recompute"][0] < kept["keep"][0]


def test_dense_layers_are_found():
    model = _hf("deepseek_v3")
    guard = spikeguard.attach(model, budget=HUGE, shared_policy="recompute")
    try:
        dense = guard.adapter.dense_layers()
        assert [type(m).__name__ for m in dense] == ["DeepseekV3DecoderLayer"] * 2
        assert all(m in guard.recomputed_modules for m in dense)
    finally:
        guard.detach()


def test_bad_shared_policy_is_a_usage_error():
    with pytest.raises(spikeguard.UsageError, match="shared_policy"):
        spikeguard.attach(build_model(model_config("tiny")), budget=HUGE, shared_policy="drop")
