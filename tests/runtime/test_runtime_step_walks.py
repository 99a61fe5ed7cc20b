"""What the guard reads at every step and micro-batch without walking the model again:
the static bytes and the parameters' storage keys (memory/static.py StaticWalk), the
gradients to come per layer (runtime/grads.py), the ledger's sums per micro-batch and
layer (memory/ledger.py). Each is held against the walk it replaced, after the changes
that must invalidate it.

    .venv/bin/python -m pytest tests/runtime/test_runtime_step_walks.py -q
"""

from __future__ import annotations

import random

import pytest
import torch

import spikeguard
from spikeguard.memory.ledger import Ledger, storage_key
from spikeguard.model import build_model, model_config

pytestmark = pytest.mark.timeout(120)

CFG = model_config("tiny")


def _step(model, guard, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    t = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len + 1), generator=gen)
    model.zero_grad(set_to_none=True)
    guard.run_step(lambda: model(t[:, :-1], t[:, 1:]).loss.backward())


def _walked(model, optimizer=None) -> int:
    """The static bytes walked from scratch: parameters, their gradients, AdamW's moments."""
    params = list(model.parameters())
    own = sum(p.numel() * p.element_size() for p in params)
    grads = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
    return own + grads + (2 * grads if optimizer is not None else 0)


def test_static_bytes_and_keys_follow_the_parameters_between_steps():
    model = build_model(CFG, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = spikeguard.attach(model, budget="1GiB", policy="adaptive", optimizer=optimizer)
    _step(model, guard, 1)
    assert guard.history[-1]["static_bytes"] == _walked(model, optimizer)
    optimizer.step()   # the moments exist now: measured, the same bytes
    _step(model, guard, 2)
    assert guard.history[-1]["static_bytes"] == _walked(model, optimizer)
    # A parameter frozen: its gradient is no longer static bytes (AdamW's moments of it
    # are still held: measured from the state).
    head = model.lm_head.weight if hasattr(model, "lm_head") else next(model.parameters())
    head.requires_grad_(False)
    _step(model, guard, 3)
    assert guard.history[-1]["static_bytes"] \
        == _walked(model, optimizer) + 2 * head.numel() * head.element_size()
    head.requires_grad_(True)
    # A parameter's storage replaced: the tracker's keys follow (a saved alias of the new
    # storage is a weight, never an activation).
    old = storage_key(head)
    head.data = head.data.clone()
    _step(model, guard, 4)
    assert storage_key(head) in guard.tracker.static_keys and old not in guard.tracker.static_keys
    assert guard.history[-1]["static_bytes"] == _walked(model, optimizer)


def test_gradients_to_come_are_the_walk_for_any_set_of_existing_gradients():
    model = build_model(CFG, seed=0)
    guard = spikeguard.attach(model, budget="1GiB", policy="none")
    grads = guard.grads
    rng = random.Random(0)
    for trial in range(12):
        for p in grads.trained:
            p.grad = torch.zeros_like(p) if rng.random() < 0.5 else None
        want: dict[int, int] = {}
        for p, layer in zip(grads.trained, grads.layers):
            if p.grad is None:
                want[layer] = want.get(layer, 0) + p.numel() * p.element_size()
        total, walked = 0, {}
        for layer in sorted(want, reverse=True):
            total += want[layer]
            walked[layer] = total
        for idx in range(CFG.num_layers):   # a layer with none to come: the layers' above
            walked.setdefault(idx, next((walked[k] for k in sorted(walked) if k > idx), 0))
        got = grads.by_layer()
        assert got == walked, trial
        got[0] = -1   # the caller's copy: the next answer is not changed by it
        assert grads.by_layer() == walked


def test_the_ledger_sums_are_its_attribution_summed():
    ledger = Ledger(budget_bytes=1 << 30)
    rng = random.Random(1)
    keys: list = []
    for i in range(400):
        r = rng.random()
        if r < 0.45 or not keys:
            key = ("t", i)
            ledger.acquire(key, rng.randrange(1, 5000),
                           (rng.randrange(3), rng.randrange(4), rng.choice(["attn", "down"])))
            keys.append(key)
        elif r < 0.6:
            ledger.acquire(rng.choice(keys), 7, (0, 0, "attn"))   # another holder: no bytes
        elif r < 0.75:
            keys.extend(ledger.acquire_modelled(rng.randrange(3), rng.randrange(4),
                                                {"gate_up": rng.randrange(0, 900), "act": 5}))
        elif r < 0.9:
            ledger.release_all([rng.choice(keys), ("never", i)])
        else:
            ledger.drop(rng.choice(keys))
        where = ledger.attribution()
        for mb in range(3):
            assert ledger.bytes_by(mb) == sum(n for w, n in where.items() if w[0] == mb)
            for layer in range(4):
                assert ledger.bytes_by(mb, layer) == sum(
                    n for w, n in where.items() if w[:2] == (mb, layer))
        assert ledger.activation_bytes == sum(where.values())
