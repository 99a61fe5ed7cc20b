"""Byte sizes as people write them: parse_bytes and format_bytes.

    .venv/bin/python -m pytest tests/memory/test_memory_budget.py -q
"""

from __future__ import annotations

import pytest

from spikeguard.errors import UsageError
from spikeguard.memory.budget import format_bytes, parse_bytes

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("text,num_bytes", [
    ("24GiB", 24 * 2**30),
    ("500MB", 500 * 10**6),
    ("2MiB", 2 * 2**20),
    ("512 kib", 512 * 2**10),        # units are case-insensitive, a space is allowed
    ("1.5GiB", 3 * 2**29),
    ("3gb", 3 * 10**9),
    ("1tib", 2**40),
    ("4096B", 4096),
    ("4096", 4096),
    (1048576, 1048576),
    (2.0**20, 2**20),
])
def test_parse_bytes_reads_binary_and_decimal_units(text, num_bytes):
    assert parse_bytes(text) == num_bytes


@pytest.mark.parametrize("bad", [
    "lots", "", "GiB", "12 parsecs", "1e3", "-5MB", "0", "0KiB", 0, -1, True, False, None, [1],
])
def test_parse_bytes_rejects_what_is_not_a_positive_size(bad):
    with pytest.raises(UsageError, match="^budget must|^cannot read budget"):
        parse_bytes(bad)


@pytest.mark.parametrize("num_bytes,text", [
    (512, "512 B"), (2**10, "1 KiB"), (1536, "1.5 KiB"), (2 * 2**20, "2 MiB"),
    (int(1.82 * 2**30), "1.82 GiB"), (int(1023.9 * 2**10), "1024 KiB"),
])
def test_format_bytes_uses_binary_units(num_bytes, text):
    assert format_bytes(num_bytes) == text
