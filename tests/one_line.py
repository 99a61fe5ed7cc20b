"""The one-line contract of bad input, as the table-driven CLI tests check it: exit code
2, exactly one line on stderr, `spikeguard: error: ...` naming what was wrong, no
traceback; and the files it was given, byte for byte, afterwards.

    from one_line import check_one_line, digests   # tests/ is on sys.path (conftest)
"""

from __future__ import annotations

import hashlib
from pathlib import Path


def digests(paths: list[Path]) -> dict:
    """Each file's sha256: equal before and after means nothing was touched."""
    return {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in paths}


def check_one_line(code: int, err: str, fragment: str) -> None:
    assert code == 2, err
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("spikeguard: error: "), err
    assert fragment in lines[0], err
