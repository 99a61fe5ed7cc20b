"""Hookless ends (spikeguard/runtime/hookless_ends.py): once a forward of the same inputs'
shapes ran them hooked, a guarded forward's embedding and head run with no saved-tensor
hook, their bytes modelled as measured; everything else is as with the ends hooked (the
same guard with `hookless.ends.enabled = False`).

Against that reference: no tensor packed in the ends after the first forward of a shape,
the ledger's attribution of the ends exact when the window reads it, nothing left in the
ledger after backward, the same gradients (torch.equal, and the plain model's), the same
true peak (tests/meter.py); a layer that is not covered runs hooked after a hookless
embedding; a new shape is measured again. Under a pipeline's residency (a real one, on
one process) the head stays hooked where a forward of the stage comes before the
micro-batch's backward, under adaptive.

    .venv/bin/python -m pytest tests/runtime/test_runtime_hookless_ends.py -q
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from meter import LiveMeter, model_state_tensors

import spikeguard
from spikeguard.model import build_model, model_config

pytestmark = pytest.mark.timeout(300)

TINY = model_config("tiny")
ENDS = ("embed", "head")


def _batches(sizes, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, TINY.vocab_size, (b, TINY.seq_len + 1), generator=gen)
            for b in sizes]


class _Watched:
    """A guarded `tiny` whose tracker counts what it packs per (layer, op), and whose
    window notes the ends' attribution when it reads it (right after each forward)."""

    def __init__(self, policy: str, ends: bool, layers: bool = True):
        self.model = build_model(TINY, seed=0)
        self.guard = g = spikeguard.attach(self.model, budget="1GiB", policy=policy)
        g.hookless.ends.enabled = ends
        g.hookless.enabled = layers
        g.calm.enabled = False   # the hooked path's later forwards (else calm_forward.py's)
        self.packed: Counter = Counter()
        self.ends_read: list[tuple[int, int]] = []
        pack, observe = g.tracker.pack, g.window.observe_forward

        def counting_pack(t):
            self.packed[(g.ctx.layer, g.ctx.op)] += 1
            return pack(t)

        def reading_observe(mb, *args):
            self.ends_read.append((g.ledger.bytes_by(mb, -1, "embed"),
                                   g.ledger.bytes_by(mb, TINY.num_layers, "head")))
            return observe(mb, *args)

        g.tracker.pack = counting_pack   # read when the pair is put on autograd's stack
        g.window.observe_forward = reading_observe

    def step(self, batches) -> tuple[dict, int]:
        """One step (each micro-batch forward then backward): its gradients, and the
        independent meter's peak."""
        self.model.zero_grad(set_to_none=True)
        self.packed.clear()
        self.ends_read.clear()

        def body():
            for t in batches:
                self.model(t[:, :-1], t[:, 1:]).loss.backward()

        with LiveMeter(baseline_tensors=model_state_tensors(self.model, None)) as meter:
            self.guard.run_step(body)
        assert self.guard.ledger.activation_bytes == 0   # backward released every model
        return {n: p.grad.clone() for n, p in self.model.named_parameters()}, meter.peak_bytes

    def ends_packed(self) -> int:
        return sum(n for (_, op), n in self.packed.items() if op in ENDS)


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    assert [n for n in a if not torch.equal(a[n], b[n])] == []


@pytest.mark.parametrize("policy", ["adaptive", "none"])
def test_after_one_forward_of_a_shape_the_ends_run_without_the_hook(policy):
    batches = _batches((4, 4), seed=5)
    on, ref = _Watched(policy, ends=True), _Watched(policy, ends=False)
    plain = build_model(TINY, seed=0)
    for t in batches:
        plain(t[:, :-1], t[:, 1:]).loss.backward()
    for step in range(3):
        grads, peak = on.step(batches)
        ref_grads, ref_peak = ref.step(batches)
        _same(grads, ref_grads)
        _same(grads, {n: p.grad for n, p in plain.named_parameters()})
        assert peak == ref_peak
        # The window reads the ends' bytes exactly as the hook measured them.
        assert on.ends_read == ref.ends_read and all(e > 0 and h > 0 for e, h in on.ends_read)
        assert ref.ends_packed() > 0 and ref.guard.history[-1]["hookless_ends"] == 0
        if step == 0:   # the guard's first forward measures; the second has the same shapes
            assert on.packed[(-1, "embed")] > 0 and on.packed[(TINY.num_layers, "head")] > 0
            assert on.guard.history[-1]["hookless_ends"] == 2
        else:
            # every layer is covered too (the first step's first layer measured them):
            # nothing at all was packed
            assert sum(on.packed.values()) == 0, on.packed
            assert on.guard.history[-1]["hookless_ends"] == 2 * len(batches)


def test_a_new_shape_runs_its_ends_hooked_once():
    on = _Watched("adaptive", ends=True)
    on.step(_batches((4,), seed=5))
    on.step(_batches((4,), seed=6))
    assert on.ends_packed() == 0
    on.step(_batches((8,), seed=7))    # another batch size: other bytes, measured again
    assert on.ends_packed() > 0 and on.guard.history[-1]["hookless_ends"] == 0
    measured = on.ends_read[-1]
    on.step(_batches((8,), seed=8))
    assert on.ends_packed() == 0 and on.ends_read[-1] == measured


def test_a_layer_not_covered_runs_hooked_after_a_hookless_embedding():
    """With the layers' hookless cover off, the first layer starts right after a hookless
    embedding: the hook is back for it, and what it saves is attributed as measured."""
    batches = _batches((4,), seed=5)
    on = _Watched("adaptive", ends=True, layers=False)
    ref = _Watched("adaptive", ends=False, layers=False)
    for _ in range(2):
        grads, peak = on.step(batches)
        ref_grads, ref_peak = ref.step(batches)
    assert on.packed[(-1, "embed")] == 0 and ref.packed[(-1, "embed")] > 0
    layers = {k: n for k, n in on.packed.items() if k[1] not in ENDS}
    assert layers and layers == {k: n for k, n in ref.packed.items() if k[1] not in ENDS}
    assert on.packed[(0, "attn")] > 0
    _same(grads, ref_grads)
    assert peak == ref_peak


def _schedule(order: str) -> list:
    """A stage's action list in torch.distributed.pipelining's IR: "FFBB" = F0 F1 B0 B1."""
    from torch.distributed.pipelining.schedules import _Action, _ComputationType
    kinds = {"F": _ComputationType.FORWARD, "B": _ComputationType.FULL_BACKWARD}
    seen = {"F": 0, "B": 0}
    actions = []
    for kind in order:
        actions.append(_Action(0, kinds[kind], seen[kind]))
        seen[kind] += 1
    return actions


@pytest.mark.parametrize("order, head_hookless", [("FFBB", [False, True]),
                                                  ("FBFB", [True, True])])
def test_under_a_schedule_the_head_is_hookless_only_where_no_forward_comes_before_its_backward(
        order, head_hookless):
    """In a pipeline a stage's residency may evict an older micro-batch's saved tensors
    when a later forward asks for room: the head of a micro-batch with a forward of the
    stage before its backward (F0 of F0 F1 B0 B1) stays hooked under adaptive; one with
    none (F1 there, every micro-batch of F B F B) runs hookless once measured. The
    embedding (token ids, under the evictor's 16 KiB) runs hookless either way."""
    from spikeguard.plan.residency import Residency, positions
    batches = _batches((4, 4), seed=5)
    on = _Watched("adaptive", ends=True)
    g = on.guard
    g.forecast.residency = Residency(positions(_schedule(order), 0),
                                     micro_batch=lambda: g.ctx.micro_batch,
                                     host_bytes=g.engine.host_bytes_by_layer,
                                     device_bytes=lambda mb: g.ledger.bytes_by(micro_batch=mb))
    plain = build_model(TINY, seed=0)
    for t in batches:
        plain(t[:, :-1], t[:, 1:]).loss.backward()
    head = TINY.num_layers
    for _ in range(2):
        on.model.zero_grad(set_to_none=True)
        on.packed.clear()
        packed_head, losses, backwards = [], [], 0
        with g.step():
            g.forecast.residency.begin_step()
            for kind in order:
                if kind == "B":
                    losses[backwards].backward()
                    backwards += 1
                    continue
                before = on.packed[(head, "head")]
                t = batches[len(losses)]
                losses.append(on.model(t[:, :-1], t[:, 1:]).loss)
                packed_head.append(on.packed[(head, "head")] - before)
        assert g.ledger.activation_bytes == 0
    assert on.packed[(-1, "embed")] == 0   # the last step's embeddings: hookless
    assert [n == 0 for n in packed_head] == head_hookless, packed_head
    assert g.history[-1]["hookless_ends"] == len(batches) + sum(head_hookless)
    _same({n: p.grad for n, p in on.model.named_parameters()},
          {n: p.grad for n, p in plain.named_parameters()})
