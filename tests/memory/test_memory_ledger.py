"""The ledger: bytes by storage (views count once), attribution, peak, the emulated budget.

    .venv/bin/python -m pytest tests/memory/test_memory_ledger.py -q
"""

from __future__ import annotations


import pytest
import torch

from spikeguard.memory.ledger import Ledger, storage_bytes, storage_key

pytestmark = pytest.mark.timeout(120)

WHERE = (0, 1, "gate_up")


def _hold(ledger: Ledger, t: torch.Tensor, where=WHERE) -> None:
    ledger.acquire(storage_key(t), storage_bytes(t), where)


def test_views_of_one_storage_share_a_key_and_count_whole_storage():
    x_ND = torch.zeros(8, 4)
    for view in (x_ND[2:5], x_ND.t(), x_ND.view(32)[3:9:2]):
        assert storage_key(view) == storage_key(x_ND)
        assert storage_bytes(view) == 8 * 4 * 4
    assert storage_key(x_ND.clone()) != storage_key(x_ND)


def test_two_holders_of_one_storage_count_once_until_both_release():
    ledger = Ledger(budget_bytes=10**6)
    x_ND = torch.zeros(8, 4)
    _hold(ledger, x_ND)
    _hold(ledger, x_ND[1:])
    assert ledger.activation_bytes == 128
    ledger.release(storage_key(x_ND))
    assert ledger.activation_bytes == 128 and ledger.holds(storage_key(x_ND))
    ledger.release(storage_key(x_ND))
    assert ledger.activation_bytes == 0 and not ledger.holds(storage_key(x_ND))
    ledger.release(storage_key(x_ND))   # a stray release is harmless
    assert ledger.activation_bytes == 0


def test_drop_forgets_a_storage_whatever_its_holders():
    ledger = Ledger(budget_bytes=10**6)
    x_ND = torch.zeros(8, 4)
    _hold(ledger, x_ND)
    _hold(ledger, x_ND)
    assert ledger.drop(storage_key(x_ND)) == 128
    assert ledger.activation_bytes == 0 and ledger.bytes_by() == 0
    assert ledger.drop(storage_key(x_ND)) == 0


def test_bytes_by_filters_on_every_given_field():
    ledger = Ledger(budget_bytes=10**6)
    sizes = {(0, 0, "attn"): 10, (0, 0, "gate_up"): 20, (0, 1, "gate_up"): 40, (1, 0, "gate_up"): 80}
    tensors = []
    for where, numel in sizes.items():
        t = torch.zeros(numel)           # float32: 4 bytes per element
        tensors.append(t)
        _hold(ledger, t, where)
    assert ledger.bytes_by() == 4 * 150
    assert ledger.bytes_by(micro_batch=0) == 4 * 70
    assert ledger.bytes_by(layer=0) == 4 * 110
    assert ledger.bytes_by(op="gate_up") == 4 * 140
    assert ledger.bytes_by(0, 0, "gate_up") == 4 * 20
    assert ledger.bytes_by(1, 1, "gate_up") == 0


def test_in_use_and_peak_are_the_devices_not_the_attribution():
    """The ledger's figure is the device's (every live storage while it is active); the
    attribution only explains it: attributing bytes adds nothing to in use."""
    ledger = Ledger(budget_bytes=10**6)
    with ledger.meter.active():
        ledger.reset_peak()
        a = torch.zeros(100)                          # 400 bytes on the device
        assert ledger.in_use() == 400
        _hold(ledger, a)
        assert ledger.in_use() == 400 and ledger.activation_bytes == 400
        b = torch.zeros(50)
        del b
        assert ledger.in_use() == 400 and ledger.peak_bytes == 600
        ledger.reset_peak()
        assert ledger.peak_bytes == 400
    ledger.meter.close()
