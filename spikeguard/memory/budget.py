"""Byte sizes as people write them ("24GiB", "500MB", 1048576) and back."""

from __future__ import annotations

import math
import re

from spikeguard.errors import UsageError

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_PATTERN = re.compile(r"^\s*([-+]?[0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")
# Beyond any device (an exbibyte): a figure above this is a typo, and float arithmetic on
# it would overflow or lose the bytes (a budget of 400 nines).
MAX_BYTES = 2**60


def parse_bytes(value: int | float | str, what: str = "budget") -> int:
    """Bytes from an int or a string with an optional unit; positive, finite and at most
    MAX_BYTES, or UsageError (`what` names the setting in the message)."""
    if isinstance(value, bool):
        raise UsageError(f"{what} must be a byte count, got {value!r}")
    if isinstance(value, (int, float)):
        amount: float | int = value
    elif isinstance(value, str):
        match = _PATTERN.match(value)
        if not match or match.group(2).lower() not in _UNITS:
            raise UsageError(f"cannot read {what} {value!r} as a byte size "
                             f"(e.g. 24GiB, 500MB, 1048576)")
        number, unit = match.group(1), _UNITS[match.group(2).lower()]
        try:   # an integer stays exact; a float of 400 digits is inf
            amount = int(number) * unit
        except ValueError:
            amount = float(number) * unit
    else:
        raise UsageError(f"{what} must be an int or a string like '24GiB', "
                         f"got {type(value).__name__}")
    if isinstance(amount, float) and not math.isfinite(amount):
        raise UsageError(f"{what} must be a finite byte size, got {value!r}")
    if amount <= 0:
        raise UsageError(f"{what} must be positive, got {value!r}")
    if amount > MAX_BYTES:
        shown = repr(value) if len(repr(value)) <= 40 else f"{repr(value)[:24]}... ({len(str(value))} characters)"
        raise UsageError(f"{what} {shown} is beyond any device (more than 2**60 bytes, "
                         f"1 EiB)")
    num_bytes = int(amount)
    if num_bytes <= 0:
        raise UsageError(f"{what} must be at least one byte, got {value!r}")
    return num_bytes


_BINARY_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def byte_unit(num_bytes: float) -> str:
    """The largest binary unit in which `num_bytes` is at least 1."""
    index = 0
    while index + 1 < len(_BINARY_UNITS) and abs(num_bytes) >= 1024 ** (index + 1):
        index += 1
    return _BINARY_UNITS[index]


def format_bytes(num_bytes: float, round_up: bool = False, unit: str | None = None) -> str:
    """Binary units with three significant figures: 1.82 GiB, 512 KiB.

    `round_up` for figures that are lower bounds ("a budget of at least ..."): the printed
    value, read back, is then never below `num_bytes`. `unit` prints in that unit with two
    decimals, so that two figures side by side (peak / budget) share one."""
    if unit is not None:
        return f"{num_bytes / 1024 ** _BINARY_UNITS.index(unit):.2f} {unit}"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(num_bytes) >= size:
            value = num_bytes / size
            if round_up:
                scale = 10 ** (2 - int(math.floor(math.log10(value))))
                return f"{math.ceil(value * scale) / scale:g} {unit}"
            text = f"{value:.3g}"
            # 1023.9 KiB is "1024 KiB", not "1.02e+03 KiB"
            return f"{text if 'e' not in text else f'{value:.0f}'} {unit}"
    return f"{int(math.ceil(num_bytes)) if round_up else int(num_bytes)} B"
