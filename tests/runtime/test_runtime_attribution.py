"""Predicted bytes per operator (the catalogue) against what the ledger measures in a forward.

T = tokens of a micro-batch, E = experts, K = top-k, N = T*K routed copies. Both
micro-batches' forwards run before either backward, so both are alive in the ledger at
once and a byte attributed to the wrong micro-batch or layer shows. Routing is as the
tiny model initialises it ("balanced": no expert gets every token; the untrained router is
uneven, up to ~1.9x) or skewed (+5 router bias on one expert per layer: it gets every token).

    .venv/bin/python -m pytest tests/runtime/test_runtime_attribution.py -q
"""

from __future__ import annotations

import pytest
import torch

import spikeguard
from spikeguard.model import build_model, model_config

pytestmark = pytest.mark.timeout(120)

CFG = model_config("tiny")
EXPERT_OPS = ("dispatch", "gate_up", "silu", "act", "down", "combine")
TOLERANCE = 0.05


def _batches(sizes, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, CFG.vocab_size, (b, CFG.seq_len + 1), generator=gen) for b in sizes]


def _measure(skewed: bool) -> dict:
    model = build_model(CFG, seed=0)
    if skewed:
        for layer, block in enumerate(model.moe_blocks()):
            bias_E = torch.zeros(CFG.num_experts)
            bias_E[(layer + 1) % CFG.num_experts] = 5.0
            block.router.expert_bias_E.copy_(bias_E)
    guard = spikeguard.attach(model, budget="1GiB", policy="none")
    counts = {}

    def record_counts(block, args, output):
        counts[(guard.ctx.micro_batch, block.layer_idx)] = list(block.last_tokens_per_expert)

    for block in model.moe_blocks():
        block.register_forward_hook(record_counts)
    ledger = guard.ledger
    with guard.step():
        outs = [model(t[:, :-1], t[:, 1:]) for t in _batches((4, 8), seed=23)]
        measured = {(mb, layer, op): ledger.bytes_by(mb, layer, op)
                    for mb in range(2) for layer in (None, *range(CFG.num_layers)) for op in EXPERT_OPS}
        for out in outs:
            out.loss.backward()
    return {"counts": counts, "measured": measured, "shape": guard.shape,
            "imbalance": guard.history[-1]["max_imbalance"]}


@pytest.fixture(scope="module", params=["balanced", "skewed"])
def measured(request) -> dict:
    return _measure(skewed=request.param == "skewed") | {"mode": request.param}


def test_routing_is_as_intended(measured):
    expected_tokens = {0: 4 * CFG.seq_len, 1: 8 * CFG.seq_len}
    for (mb, layer), counts in measured["counts"].items():
        assert sum(counts) == expected_tokens[mb] * CFG.top_k
        if measured["mode"] == "skewed":
            # The biased expert is picked by every token: E/K times its even share.
            assert counts[(layer + 1) % CFG.num_experts] == expected_tokens[mb]
        else:
            assert max(counts) < expected_tokens[mb]
    if measured["mode"] == "skewed":
        assert measured["imbalance"] == CFG.num_experts / CFG.top_k


def _check(measured: dict, op: str) -> None:
    by = measured["measured"]
    for (mb, layer), counts in measured["counts"].items():
        predicted = measured["shape"].predict(sum(counts))[op]
        got = by[(mb, layer, op)]
        assert abs(got - predicted) <= TOLERANCE * predicted, (
            f"{measured['mode']} micro-batch {mb} layer {layer} {op}: "
            f"measured {got} B, predicted {predicted} B")
    for mb in range(2):
        per_mb = sum(measured["shape"].predict(sum(c))[op]
                     for (m, _), c in measured["counts"].items() if m == mb)
        assert abs(by[(mb, None, op)] - per_mb) <= TOLERANCE * per_mb


@pytest.mark.parametrize("op", EXPERT_OPS)
def test_expert_path_bytes_match_the_prediction_per_micro_batch_and_layer(measured, op):
    _check(measured, op)


def test_expert_bytes_are_attributed_to_their_own_micro_batch(measured):
    # Micro-batch 1 has twice the tokens of micro-batch 0: its bytes are exactly double.
    by = measured["measured"]
    for op in EXPERT_OPS:
        assert by[(1, None, op)] == 2 * by[(0, None, op)] > 0
        for layer in range(CFG.num_layers):
            assert by[(0, layer, op)] > 0


def test_is_parameter_answers_as_isinstance_does():
    """The pack hook's parameter test (runtime/hooks.py `is_parameter`, a fast path past
    Parameter's metaclass) against `isinstance` itself: plain tensors, parameters, views
    of each, a plain tensor flagged `_is_param` (the metaclass honours the flag) and a
    view of it, a DTensor parameter and a DTensor (FSDP2 and expert parallelism hold those)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    from spikeguard.runtime.hooks import is_parameter

    p = torch.nn.Parameter(torch.randn(4, 4))
    flagged = torch.randn(4, 4)
    flagged._is_param = True
    cases = [torch.randn(3), torch.randn(3, 3).t(), p, p.t(), p.detach(), flagged, flagged.t(),
             torch.randn(3, requires_grad=True) * 2]
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0,
                                         world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        cases += [torch.nn.Parameter(distribute_tensor(torch.randn(4, 4), mesh)),
                  distribute_tensor(torch.randn(4, 4), mesh)]
        want = [isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter)
                for t in cases]
        got = [is_parameter(t) for t in cases]
    finally:
        torch.distributed.destroy_process_group()
    assert got == want
    assert want == [False, False, True, True, False, True, True, False, True, False]
