"""The ledger: bytes by storage (views count once), attribution, peak, the emulated budget.

    .venv/bin/python -m pytest tests/memory/test_memory_ledger.py -q
"""

from __future__ import annotations

import re

import pytest
import torch

from spikeguard.errors import DeviceOutOfMemory
from spikeguard.memory.ledger import Ledger, storage_bytes, storage_key

pytestmark = pytest.mark.timeout(120)

WHERE = (0, 1, "gate_up")


def _hold(ledger: Ledger, t: torch.Tensor, where=WHERE, check: bool = True) -> None:
    ledger.acquire(storage_key(t), storage_bytes(t), where, check=check)


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


def test_budget_is_enforced_on_static_plus_activation_bytes():
    ledger = Ledger(budget_bytes=1000)
    ledger.set_static(600)
    a = torch.zeros(100)                 # 400 bytes: exactly fills the budget
    _hold(ledger, a)
    assert ledger.in_use() == 1000
    b = torch.zeros(1)
    with pytest.raises(DeviceOutOfMemory) as info:
        _hold(ledger, b, (3, 2, "act"))
    err = info.value
    assert err.needed_bytes == 1004 and err.budget_bytes == 1000
    assert "micro-batch 3, layer 2, op act" in str(err)
    assert re.search(r"\d+ B", str(err))
    # The refused storage left no trace.
    assert ledger.activation_bytes == 400 and not ledger.holds(storage_key(b))
    # check=False (a reload in backward) and enforce=False are not refused.
    _hold(ledger, b, check=False)
    assert ledger.in_use() == 1004
    loose = Ledger(budget_bytes=10, enforce=False)
    _hold(loose, a)
    assert loose.activation_bytes == 400


def test_peak_is_the_maximum_in_use_and_reset_starts_from_now():
    ledger = Ledger(budget_bytes=10**6)
    ledger.set_static(100)
    a, b = torch.zeros(50), torch.zeros(25)
    _hold(ledger, a)
    _hold(ledger, b)
    assert ledger.peak_bytes == 100 + 300
    ledger.release(storage_key(a))
    assert ledger.in_use() == 200 and ledger.peak_bytes == 400
    ledger.reset_peak()
    assert ledger.peak_bytes == 200
