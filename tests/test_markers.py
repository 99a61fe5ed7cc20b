"""tests/conftest.py's process check: a test that starts a process without the
`multiprocess` mark fails, and one with the mark passes. Run on a scratch test in its own
pytest, with this suite's conftest.

    .venv/bin/python -m pytest tests/test_markers.py -q
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]

SCRATCH = '''
import subprocess, sys
import pytest

def test_unmarked_run():
    subprocess.run([sys.executable, "-c", "pass"], check=True)

@pytest.mark.multiprocess
def test_marked_run():
    subprocess.run([sys.executable, "-c", "pass"], check=True)

def test_no_process():
    assert 1 + 1 == 2
'''


def test_an_unmarked_test_that_starts_a_process_fails(tmp_path):
    shutil.copy(Path(__file__).with_name("conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    multiprocess: x\n")
    (tmp_path / "test_scratch.py").write_text(SCRATCH)
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rA",
                           "test_scratch.py"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=100)
    out = done.stdout
    assert "ERROR test_scratch.py::test_unmarked_run" in out, out
    assert "mark it `multiprocess`" in out, out
    assert "PASSED test_scratch.py::test_marked_run" in out, out
    assert "PASSED test_scratch.py::test_no_process" in out, out
