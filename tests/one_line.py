"""The one-line contract of bad input, as the table-driven CLI tests check it: exit code
2, exactly one line on stderr, `spikeguard: error: ...` naming what was wrong, no
traceback; and the files it was given, byte for byte, afterwards.

    from one_line import check_one_line, digests   # tests/ is on sys.path (conftest)
    with unwritable(folder): ...                    # chmod, or chattr +i under root
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import subprocess
from pathlib import Path

import pytest


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


def check_exit_3_line(code: int, err: str, fragment: str) -> None:
    """The same contract for a failure once the run started: exit 3, one line."""
    assert code == 3, err
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("spikeguard: "), err
    assert fragment in lines[0], err


def _chattr(flag: str, path: Path) -> bool:
    try:
        return subprocess.run(["chattr", flag, str(path)], capture_output=True,
                              timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


@contextlib.contextmanager
def immutable(path: Path):
    """`path` made immutable (chattr +i: nobody, root included, may write, rename over
    or delete it); the test is skipped where that is not allowed."""
    if not _chattr("+i", path):
        pytest.skip("chattr +i is not allowed here")
    try:
        yield path
    finally:
        _chattr("-i", path)


@contextlib.contextmanager
def unwritable(folder: Path):
    """`folder` made unwritable: chmod 555, or, where that does not stop this user
    (root), chattr +i; skipped where neither does."""
    mode = folder.stat().st_mode
    folder.chmod(0o555)
    try:
        if os.access(folder, os.W_OK):
            folder.chmod(mode)
            with immutable(folder):
                yield folder
        else:
            yield folder
    finally:
        folder.chmod(mode)
