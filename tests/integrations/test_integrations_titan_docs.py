"""The 10-line example of docs/titan.md runs as written and stays under its budget.

    .venv/bin/python -m pytest tests/integrations/test_integrations_titan_docs.py -q
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torchtitan")

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]

PAGE = Path(__file__).resolve().parents[2] / "docs" / "titan.md"


def _example() -> str:
    blocks = re.findall(r"```python\n(.*?)```", PAGE.read_text(encoding="utf-8"), re.S)
    assert blocks, "docs/titan.md has no python example"
    return blocks[0]


def test_example_is_ten_lines_and_runs_under_its_budget():
    assert len(_example().strip().splitlines()) == 10
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", _example()],
                          capture_output=True, text=True, timeout=100, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1].startswith("True {"), done.stdout
