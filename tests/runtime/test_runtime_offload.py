"""Offload engine: host copies of saved tensors and their views, the reused host pool, eviction.

N = rows, D = width. On CPU an offload is a real copy into a separate host pool; the
values that come back must be the originals bit for bit, and views must come back with
their own size, stride and offset.

    .venv/bin/python -m pytest tests/runtime/test_runtime_offload.py -q
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import spikeguard
from spikeguard.memory.ledger import Ledger, storage_bytes
from spikeguard.model import build_model, model_config
from spikeguard.plan.catalogue import ALL_SAVE, Action
from spikeguard.plan.planner import Decision
from spikeguard.runtime.hooks import Context, Packed, SavedTensorTracker, unpack
from spikeguard.runtime.offload import HostPool, OffloadEngine

pytestmark = pytest.mark.timeout(120)

CFG = model_config("tiny")


def _tracker() -> SavedTensorTracker:
    ledger = Ledger(budget_bytes=10**9)
    ctx = Context(micro_batch=0, layer=0, op="act")
    return SavedTensorTracker(ledger, OffloadEngine(ledger, torch.device("cpu")), ctx)


def _views(x_ND: torch.Tensor) -> list[torch.Tensor]:
    return [x_ND, x_ND[2:5], x_ND.t(), x_ND[:, 3], x_ND.view(-1)[5:29:3], x_ND[1:, 2:].t()]


def test_a_tensor_and_its_views_come_back_bitwise_with_their_layout():
    tracker = _tracker()
    ledger, engine = tracker.ledger, tracker.engine
    x_ND = torch.randn(8, 8)   # 256 bytes: exactly one pool size class
    tracker.ctx.tag(x_ND, "act", Action.OFFLOAD)
    views = _views(x_ND)
    expected = [v.clone() for v in views]
    layouts = [(v.size(), v.stride(), v.storage_offset()) for v in views]
    packed = [tracker.pack(v) for v in views]
    assert all(isinstance(p, Packed) and p.tensor is None for p in packed)
    # One host copy for the storage, however many views were saved; nothing on the device.
    assert ledger.host_bytes == storage_bytes(x_ND) and ledger.activation_bytes == 0
    assert engine.pool.allocated_bytes == storage_bytes(x_ND)

    x_ND.zero_()   # what comes back must be the host copy, not the device tensor
    unpacked = [unpack(p) for p in packed]
    for got, want, layout in zip(unpacked, expected, layouts):
        assert (got.size(), got.stride(), got.storage_offset()) == layout
        assert torch.equal(got, want)
    # Reloaded once, into one storage that all the views share; counted once.
    assert len({t.untyped_storage().data_ptr() for t in unpacked}) == 1
    assert unpacked[0].untyped_storage().data_ptr() != x_ND.untyped_storage().data_ptr()
    assert ledger.activation_bytes == storage_bytes(x_ND)

    del packed, unpacked
    assert ledger.host_bytes == 0 and ledger.activation_bytes == 0
    # The host buffer went back to the pool, and is the one the next offload gets.
    y_ND = torch.randn(4, 16)
    tracker.ctx.tag(y_ND, "act", Action.OFFLOAD)
    again = tracker.pack(y_ND)
    assert engine.pool.allocated_bytes == storage_bytes(x_ND)
    assert torch.equal(unpack(again), y_ND)


def test_saved_views_offloaded_through_autograd_give_bitwise_gradients():
    def f(x_ND, tracker=None):
        h_ND = x_ND * 1.5
        if tracker is not None:
            tracker.ctx.tag(h_ND, "gate_up", Action.OFFLOAD)
        with tracker.hooks() if tracker is not None else contextlib.nullcontext():
            # Each product saves a differently strided view of h_ND's one storage.
            out = (h_ND.t() @ h_ND[:, :3]).sum() + (h_ND[2:] * h_ND[:-2]).sum() \
                + torch.sin(h_ND[:, 1]).sum()
        return out

    torch.manual_seed(0)
    x_ND = torch.randn(7, 5)
    grads = []
    for tracker in (None, _tracker()):
        x = x_ND.clone().requires_grad_(True)
        out = f(x, tracker)
        if tracker is not None:
            assert tracker.ledger.host_bytes == 7 * 5 * 4   # offloaded, once
        out.backward()
        grads.append((out.detach(), x.grad))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


def test_host_pool_size_classes_and_reuse():
    pool = HostPool(pin=False)
    a = pool.acquire(1000)
    assert a.numel() == 1024 and pool.allocated_bytes == 1024
    pool.give_back(a)
    b = pool.acquire(600)            # same class (1 KiB): the same buffer
    assert b.data_ptr() == a.data_ptr() and pool.allocated_bytes == 1024
    c = pool.acquire(1000)           # the class is empty again: a new buffer
    assert c.data_ptr() != b.data_ptr() and pool.allocated_bytes == 2048
    d = pool.acquire(1025)
    assert d.numel() == 2048 and pool.allocated_bytes == 4096


def _batches(sizes, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, CFG.vocab_size, (b, CFG.seq_len + 1), generator=gen) for b in sizes]


BATCHES = _batches((4, 4), seed=61)


def _step(model, guard=None):
    with guard.step() if guard is not None else contextlib.nullcontext():
        for tokens_BT in BATCHES:
            model(tokens_BT[:, :-1], tokens_BT[:, 1:]).loss.backward()


def test_host_pool_is_reused_across_identical_steps():
    model = build_model(CFG, seed=0)
    guard = spikeguard.attach(model, budget="1GiB", policy="offload")
    allocated = []
    for _ in range(3):
        _step(model, guard)
        model.zero_grad(set_to_none=True)
        allocated.append(guard.engine.pool.allocated_bytes)
        assert guard.ledger.host_bytes == 0          # every host copy was released
    assert allocated[0] > 0 and allocated == [allocated[0]] * 3
    offloaded = [r["offloaded_bytes"] for r in guard.history]
    assert offloaded[0] > 0 and offloaded == [offloaded[0]] * 3
    # Micro-batch 1 reused micro-batch 0's buffers: the pool holds about one micro-batch.
    assert allocated[0] < offloaded[0]


@pytest.fixture(scope="module")
def plain_grads() -> list[torch.Tensor]:
    model = build_model(CFG, seed=0)
    _step(model)
    return [p.grad.clone() for p in model.parameters()]


def test_evicting_earlier_layers_keeps_gradients_bitwise(plain_grads):
    model = build_model(CFG, seed=0)
    guard = spikeguard.attach(model, budget="1GiB", policy="adaptive")
    seen = []

    def earlier_bytes():   # the embedding (layer -1) and every layer before the last
        mb = guard.ctx.micro_batch
        return sum(guard.ledger.bytes_by(mb, layer) for layer in range(-1, CFG.num_layers - 1))

    def decide(num_routed, headroom_bytes, evictable_bytes=0, backward_room=None,
               deferrable_bytes=0):
        # Everything saved, and at the last layer: evict all that earlier layers can give.
        if guard.ctx.layer == CFG.num_layers - 1:
            seen.append((evictable_bytes, earlier_bytes()))
            return Decision(ALL_SAVE, 0, 0.0, evict_bytes=evictable_bytes)
        return Decision(ALL_SAVE, 0, 0.0)

    guard.planner.decide = decide
    # This decide evicts where the planner's own fit test says nothing needs to: the
    # hookless proof (runtime/hookless.py), which walks that test, would leave nothing
    # hooked to evict. The eviction path is what is under test here.
    guard.hookless.enabled = False
    earlier_after = []
    guard.moe_blocks[-1].register_forward_hook(lambda *_: earlier_after.append(earlier_bytes()))
    _step(model, guard)

    # Evictable: what earlier layers hold, less the small tensors not worth a host trip.
    assert len(seen) == 2 and all(0 < evictable <= held for evictable, held in seen)
    assert earlier_after == [held - evictable for evictable, held in seen]
    assert guard.history[-1]["evicted_bytes"] == sum(e for e, _ in seen)
    # Every evicted storage is read by backward, so all of it came back, counted at the copy.
    assert guard.history[-1]["prefetched_bytes"] == guard.history[-1]["evicted_bytes"]
    assert guard.ledger.host_bytes == 0
    grads = [p.grad for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(plain_grads, grads))
