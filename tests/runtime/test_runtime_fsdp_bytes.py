"""FSDP2's units as the byte model reads them (spikeguard/runtime/fsdp.py) and what the
arithmetic (spikeguard/plan/fsdp_bytes.py) makes of them, against the emulated device.

One process, a gloo group of one; 4 blocks of one Linear each, each block its own
`fully_shard` unit, the root one too.

    .venv/bin/python -m pytest tests/runtime/test_runtime_fsdp_bytes.py -q
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from spikeguard.memory.device import EmulatedDevice
from spikeguard.plan.fsdp_bytes import FsdpBytes, FsdpUnit
from spikeguard.runtime.device_state import move_state_to_device
from spikeguard.runtime.fsdp import fsdp_units, reset_after_failed_attempt

pytestmark = pytest.mark.timeout(120)

D = 64
W = D * D * 4   # one block's weight, float32


def _model(param_dtype=None, head_kept: bool = False) -> nn.Module:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(D, D, bias=False), nn.ReLU())
                            for _ in range(4)])
    policy = MixedPrecisionPolicy(param_dtype=param_dtype)
    for i, block in enumerate(model):   # `head_kept`: the last stays gathered after forward
        fully_shard(block, mp_policy=policy, reshard_after_forward=not (head_kept and i == 3))
    fully_shard(model, mp_policy=policy)
    return model


def _layer_of(model):
    return lambda m: next((i for i, b in enumerate(model) if b is m), None)


def test_units_are_read_from_the_param_groups_in_forward_order(one_rank):
    model = _model()
    units = fsdp_units(model, _layer_of(model))
    assert [u.layer for u in units] == [0, 1, 2, 3, None]          # the root last
    assert [u.unsharded_bytes for u in units] == [W] * 4 + [0]
    assert all(u.reduce_input_bytes == W and u.reduce_output_bytes == W for u in units[:4])
    assert [u.reshard_after_forward for u in units[:4]] == [True] * 4   # (the root: no group)


def test_a_compute_dtype_halves_the_gathered_bytes(one_rank):
    model = _model(param_dtype=torch.bfloat16)
    units = fsdp_units(model, _layer_of(model))
    assert [u.unsharded_bytes for u in units[:4]] == [W // 2] * 4
    assert units[0].reduce_input_bytes == W // 2   # reduce dtype defaults to the compute one


def test_the_arithmetic_of_a_units_backward_and_the_forward_to_come():
    u = FsdpUnit(layer=None, unsharded_bytes=100, reduce_input_bytes=100,
                 reduce_output_bytes=50)
    head = FsdpUnit(layer=None, unsharded_bytes=30, reduce_input_bytes=30,
                    reduce_output_bytes=15, reshard_after_forward=False)
    fsdp = FsdpBytes((u, FsdpUnit(0, 100, 100, 50), FsdpUnit(1, 100, 100, 50), head))
    # layer 0's backward: unit 0 prefetched, its own gradients, unit 2's input kept
    assert fsdp.layer_backward(0) == (100 + 100 + 100, 100 + 100 + 100 + 50 - 100)
    # the head's: the last layer prefetched, its gradients, nothing reduced before it
    assert fsdp.head_backward() == 100 + 30
    # at layer 1's decision: the head stays gathered, its backward, layer 1's freed
    assert fsdp.forward_to_come(1) == 30 + 130 - 100
    assert FsdpBytes().layer_backward(0) == (0, 0) and not FsdpBytes().active


def test_the_heads_fsdp_phase_counts_only_beyond_its_loss_phase():
    """The head's backward peaks in its loss phase (the head's reserve, two logits) or in
    its FSDP2 phase (one logit's gradient + prefetch and gradients), never both at once:
    FSDP2 adds only the second's excess (plan/fsdp_bytes.py; it was added whole)."""
    head = FsdpUnit(layer=None, unsharded_bytes=30, reduce_input_bytes=30,
                    reduce_output_bytes=15, reshard_after_forward=False)
    fsdp = FsdpBytes((FsdpUnit(0, 100, 100, 50), FsdpUnit(1, 100, 100, 50), head))
    # no reserve: the FSDP2 phase whole (the head gathered, layer 1 prefetched and the
    # head's gradients, layer 0's parameters freed)
    assert fsdp.forward_to_come(0) == 30 + 130 - 100 + 0
    # the loss phase (reserve 400) covers the FSDP2 phase (a logit's gradient 200 + 130):
    # nothing of FSDP2's beyond the head's gathered parameters, which layer 0's freeing covers
    assert fsdp.forward_to_come(0, head_reserve_bytes=400, logit_grad_bytes=200) == 0
    # a smaller reserve: only the FSDP2 phase's excess over it
    assert fsdp.forward_to_come(0, head_reserve_bytes=250, logit_grad_bytes=200) == (
        30 + (200 + 130 - 250) - 100)


def test_the_backward_of_a_unit_stays_within_what_the_model_says(one_rank):
    """The step's backward peak on the device, gradients already there (the second step),
    above the in-use when block 3's backward starts, is covered by block 3's term plus
    its activations' gradients (a few rows)."""
    model = _model()
    meter = EmulatedDevice(1 << 30)
    try:
        move_state_to_device(model, (), meter)
        fsdp = FsdpBytes(tuple(fsdp_units(model, _layer_of(model))))
        x = torch.randn(8, D)
        starts = []
        model[3].register_full_backward_pre_hook(lambda *a: starts.append(meter.allocated()))
        for _ in range(2):
            with meter.active():
                starts.clear()
                y = model(x).sum()
                meter.reset_peak()
                y.backward()
        compute, reduce = fsdp.layer_backward(3)
        activations = 4 * 8 * D * 4
        # block 3's parameters are gathered again in its backward: + W above the start
        assert meter.peak() - starts[0] <= W + max(compute, reduce) + activations
    finally:
        meter.close()


def test_reset_after_failed_attempt_frees_what_a_failed_attempt_left(one_rank):
    model = _model(head_kept=True)
    meter = EmulatedDevice(1 << 30)
    try:
        move_state_to_device(model, (), meter)
        with meter.active():
            before = meter.allocated()
            y = model(torch.randn(8, D)).sum()
            del y   # abandoned before backward: the last block stays gathered
            assert meter.allocated() - before == W
            reset_after_failed_attempt(model)
            assert meter.allocated() == before
    finally:
        meter.close()
