"""docs/gpu.md quotes the GPU check's runs: every quoted output line is, word for word, a
line of a stored log (docs/gpu/*.log), so no figure on that page is typed.

    .venv/bin/python -m pytest tests/test_gpu_record.py -q
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "gpu.md"
LOG = ROOT / "docs" / "gpu" / "gpu_check_h200_2026-12-04.log"


def quoted_lines(text: str) -> list[str]:
    """The page's indented block lines, the command lines (they run nothing) left out."""
    return [line[4:] for line in text.splitlines()
            if line.startswith("    ") and not line.lstrip().startswith("PYTHONPATH=")]


def test_every_quoted_line_is_in_the_stored_log():
    log_lines = {line.strip() for log in LOG.parent.glob("*.log")
                 for line in log.read_text().splitlines()}
    quoted = quoted_lines(PAGE.read_text())
    assert len(quoted) >= 9, quoted
    missing = [line for line in quoted if line.strip() not in log_lines]
    assert not missing, missing


def test_the_stored_run_passed_and_the_readme_cites_it():
    assert LOG.read_text().rstrip().splitlines()[-1] == "gpu_check: PASS"
    readme = (ROOT / "README.md").read_text()
    assert "docs/gpu.md" in readme and "has **not been run on a GPU**" not in readme
