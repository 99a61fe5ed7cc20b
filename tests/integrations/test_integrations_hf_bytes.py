"""The byte model of an HF experts call: derived from attributes, or learned by a probe.

N = routed token copies, D = model width, F = expert width, E = experts, K = top-k.

Derived (transformers' grouped_mm kernel) and probed (any other kernel, or a block the
adapter has never seen) byte models must both predict, within 10%, the bytes the ledger
measures for the experts call in a real forward. The probe must say in the log that it
learned by measurement. A toy MoE model written here, with its own names and a GELU
expert, stands for "a model it has never seen": found by structure, planned, bitwise.

    .venv/bin/python -m pytest tests/integrations/test_integrations_hf_bytes.py -q
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import spikeguard

from hf_helpers import ARCHITECTURES, HUGE, assert_bitwise, build, windows

pytestmark = pytest.mark.timeout(120)

BATCHES = windows(seed=3)


def _measured_vs_predicted(model, w_BT) -> tuple[list[int], list[int], object]:
    """Per layer: the experts call's bytes in the ledger, and the byte model's figure."""
    guard = spikeguard.attach(model, budget=HUGE, policy="none")
    routed = {}
    decide = guard.decide

    def spy(layer, num_routed):
        routed[layer] = num_routed
        return decide(layer, num_routed)

    guard.decide = spy
    try:
        with guard.step():
            out = model(input_ids=w_BT, labels=w_BT) if not isinstance(model, ToyLM) \
                else model(w_BT)
            layers = sorted(routed)
            measured = [guard.ledger.bytes_by(0, layer, "experts") for layer in layers]
            out.loss.backward()
    finally:
        guard.detach()
    predicted = [sum(guard.shape.predict(routed[layer]).values()) for layer in layers]
    return measured, predicted, guard.shape


def _within(measured, predicted, tolerance=0.10) -> None:
    assert measured and all(m > 0 for m in measured)
    for m, p in zip(measured, predicted):
        assert abs(p - m) <= tolerance * m, f"predicted {p} B, measured {m} B"


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_derived_bytes_match_measurement(name, caplog):
    model = build(name)
    assert model.config._experts_implementation == "grouped_mm"
    with caplog.at_level(logging.INFO, logger="spikeguard"):
        measured, predicted, shape = _measured_vs_predicted(model, BATCHES[0])
    assert shape.source == "derived"
    assert "learned by measurement" not in caplog.text
    _within(measured, predicted, tolerance=0.01)


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_probe_bytes_match_measurement(name, caplog):
    """The model's own per-expert loop ("eager"): not derivable, so probed."""
    model = build(name)
    model.config._experts_implementation = "eager"
    with caplog.at_level(logging.INFO, logger="spikeguard"):
        measured, predicted, shape = _measured_vs_predicted(model, BATCHES[0])
    assert shape.source == "measured"
    assert "learned by measurement" in caplog.text
    _within(measured, predicted)


# ---- a model the adapter has never seen ---------------------------------------------
class Scorer(nn.Module):
    """A top-k router under another name, returning (weights, indices, logits)."""

    def __init__(self, d: int, e: int, k: int):
        super().__init__()
        self.top_k = k
        self.proj = nn.Linear(d, e, bias=False)

    def forward(self, x_TD):
        logits_TE = self.proj(x_TD)
        w_TK, idx_TK = logits_TE.softmax(-1).topk(self.top_k, dim=-1)
        return w_TK, idx_TK, logits_TE


class GeluBank(nn.Module):
    """E GELU experts with separate in/out weights and a per-expert bias."""

    def __init__(self, e: int, d: int, f: int):
        super().__init__()
        gen = torch.Generator().manual_seed(5)
        self.w_in = nn.Parameter(torch.randn(e, d, f, generator=gen) / d ** 0.5)
        self.b_in = nn.Parameter(torch.zeros(e, f))
        self.w_out = nn.Parameter(torch.randn(e, f, d, generator=gen) / f ** 0.5)

    def forward(self, hidden_states, routed_idx, routed_weight):
        out = torch.zeros_like(hidden_states)
        for e in range(self.w_in.shape[0]):
            rows, slot = (routed_idx == e).nonzero(as_tuple=True)
            h = F.gelu(hidden_states[rows] @ self.w_in[e] + self.b_in[e])
            out = out.index_add(0, rows, (h @ self.w_out[e]) * routed_weight[rows, slot, None])
        return out


class ToyBlock(nn.Module):
    def __init__(self, d=32, e=4, k=2, f=48):
        super().__init__()
        self.scorer = Scorer(d, e, k)
        self.experts = GeluBank(e, d, f)

    def forward(self, x_BTD):
        x_TD = x_BTD.reshape(-1, x_BTD.shape[-1])
        w_TK, idx_TK, _ = self.scorer(x_TD)
        # Keyword arguments with its own names: the window reads them by name.
        return self.experts(x_TD, routed_weight=w_TK, routed_idx=idx_TK).reshape(x_BTD.shape)


class ToyLayer(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.ffn = ToyBlock(d)

    def forward(self, x_BTD):
        return x_BTD + self.ffn(self.norm(x_BTD))


class ToyLM(nn.Module):
    def __init__(self, d=32, layers=2):
        super().__init__()
        self.emb = nn.Embedding(256, d)
        self.layers = nn.ModuleList(ToyLayer(d) for _ in range(layers))
        self.head = nn.Linear(d, 256)

    def forward(self, w_BT):
        x = self.emb(w_BT[:, :-1])
        for layer in self.layers:
            x = layer(x)
        logits = self.head(x)
        loss = F.cross_entropy(logits.reshape(-1, 256), w_BT[:, 1:].reshape(-1))
        # Not `type("Out", (), {...})()`: a class is a reference cycle, so its dict would
        # keep the logits on the device until the collector runs, past the next forward.
        return SimpleNamespace(loss=loss, logits=logits)


def _toy() -> ToyLM:
    torch.manual_seed(0)
    return ToyLM()


def _toy_step(model, guard=None):
    for p in model.parameters():
        p.grad = None
    import contextlib
    with guard.step() if guard is not None else contextlib.nullcontext():
        for w_BT in BATCHES:
            model(w_BT).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.slow
def test_unseen_block_is_found_and_probed(caplog):
    model = _toy()
    with caplog.at_level(logging.INFO, logger="spikeguard"):
        measured, predicted, shape = _measured_vs_predicted(model, BATCHES[0])
    assert shape.source == "measured" and "GeluBank" in caplog.text
    assert "learned by measurement" in caplog.text
    _within(measured, predicted)


@pytest.mark.parametrize("policy", ["adaptive", "none", "full", "experts", "offload"])
def test_unseen_block_bitwise(policy):
    model = _toy()
    reference = _toy_step(model)
    budget = HUGE
    if policy == "adaptive":
        guard = spikeguard.attach(model, budget=HUGE, policy="none")
        _toy_step(model, guard)
        budget = int(0.85 * guard.history[-1]["peak_bytes"])
        guard.detach()
    guard = spikeguard.attach(model, budget=budget, policy=policy)
    try:
        actual = _toy_step(model, guard)
        record = guard.history[-1]
    finally:
        guard.detach()
    assert_bitwise(reference, actual)
    assert record["peak_bytes"] <= budget
    assert sum(record["decisions"].values()) == 2 * len(BATCHES)
