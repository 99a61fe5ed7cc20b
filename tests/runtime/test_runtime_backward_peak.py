"""The budget holds in backward too: offloaded tensors come back while others are alive.

A model whose expert path dominates its memory (wide experts, so the output head is
small beside it) under 0.8x its unconstrained peak: adaptive offloads, and the ledger's
peak over the whole step (forward, and backward with reloads and prefetch) stays under
the budget.
"""

import pytest
import torch

import spikeguard
from spikeguard.model import build_model, model_config

pytestmark = pytest.mark.timeout(120)

CFG = model_config("tiny", d_expert=256, num_layers=3)
BATCHES = [torch.randint(0, 256, (8, 33), generator=torch.Generator().manual_seed(s))
           for s in (1, 2)]


def _step(model, guard):
    with guard.step():
        for tokens_BT in BATCHES:
            model(tokens_BT[:, :-1], tokens_BT[:, 1:]).loss.backward()
    return guard.history[-1]


@pytest.mark.parametrize("fraction", [0.9, 0.8, 0.7])
def test_peak_stays_under_the_budget_through_backward(fraction):
    probe = build_model(CFG, seed=0)
    peak = _step(probe, spikeguard.attach(probe, budget="1GiB", policy="none"))["peak_bytes"]
    model = build_model(CFG, seed=0)
    guard = spikeguard.attach(model, budget=int(fraction * peak), policy="adaptive")
    for _ in range(2):
        record = _step(model, guard)
        model.zero_grad(set_to_none=True)
        assert record["decisions"]["offload"] + record["decisions"]["recompute"] \
            + record["evicted_bytes"] > 0
        assert record["peak_bytes"] <= record["budget_bytes"]
        assert record["safety_net_reruns"] == 0, record   # prevention, not the net


def test_prefetch_path_keeps_gradients_bitwise_and_the_budget():
    """Prefetch is off on CPU (a blocking copy gains nothing); turned on, it must reload
    the layer below early, give the same gradients and still respect the budget."""
    plain = build_model(CFG, seed=0)
    for tokens_BT in BATCHES:
        plain(tokens_BT[:, :-1], tokens_BT[:, 1:]).loss.backward()
    probe = build_model(CFG, seed=0)
    peak = _step(probe, spikeguard.attach(probe, budget="1GiB", policy="none"))["peak_bytes"]
    model = build_model(CFG, seed=0)
    guard = spikeguard.attach(model, budget=int(0.8 * peak), policy="adaptive")
    guard.engine.prefetch_enabled = True
    prefetched = []
    original = guard.engine.prefetch_layer
    guard.engine.prefetch_layer = lambda mb, layer: (prefetched.append((mb, layer)),
                                                     original(mb, layer))
    record = _step(model, guard)
    assert sorted(set(prefetched)) == [(mb, layer) for mb in (0, 1)
                                       for layer in range(CFG.num_layers - 1)]
    assert record["decisions"]["offload"] + record["evicted_bytes"] > 0
    assert record["peak_bytes"] <= record["budget_bytes"]
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(plain.parameters(), model.parameters()))
