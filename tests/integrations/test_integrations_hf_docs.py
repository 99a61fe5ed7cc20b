"""The 10-line example of docs/hf.md runs as written, and does what the page says.

    .venv/bin/python -m pytest tests/integrations/test_integrations_hf_docs.py -q
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]

PAGE = Path(__file__).resolve().parents[2] / "docs" / "hf.md"
BUDGET_BYTES = 12 << 20


def _example() -> str:
    blocks = re.findall(r"```python\n(.*?)```", PAGE.read_text(encoding="utf-8"), re.S)
    assert blocks, "docs/hf.md has no python example"
    return blocks[0]


def test_example_is_ten_lines():
    assert len(_example().strip().splitlines()) == 10


def test_example_runs_as_written_and_stays_under_budget():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", _example()], capture_output=True, text=True,
                          timeout=100, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 3
    for line in lines:
        peak, rest = line.split(" ", 1)
        decisions, evicted = rest.rsplit(" ", 1)
        decisions = ast.literal_eval(decisions)
        assert 0 < int(peak) <= BUDGET_BYTES
        # Every step acts: recompute, offload, or earlier layers' tensors evicted to host.
        assert sum(decisions.values()) == 2 and (decisions["save"] < 2 or int(evicted) > 0)
