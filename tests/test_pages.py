"""The pages' generated blocks (scripts/pages.py) are their runs' rendering, and the quick
runs still give what the pages quote.

    .venv/bin/python -m pytest tests/test_pages.py -q -m "not examples_long"   # ~3 s
    .venv/bin/python -m pytest tests/test_pages.py -q     # + 4 re-runs: 5 min at load 11 here

`test_every_generated_block_is_its_runs_rendering` is the check mode: it fails on a page
whose block differs from what the generator would write from the stored record (a typed
or stale figure), on a marker with no binding and on a binding no page shows. The re-runs
run each re-runnable block's command again (a real subprocess) and compare what must
reproduce: losses and counts exactly, byte figures within the block's tolerance, timings
masked (scripts/page_blocks.py says which, per block).
"""

from __future__ import annotations

import functools
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import pages  # noqa: E402
from page_blocks import BLOCKS, Block  # noqa: E402


def test_every_generated_block_is_its_runs_rendering():
    problems = pages.stale()
    assert not problems, "\n".join(problems)


@pytest.mark.multiprocess
def test_the_check_mode_runs_from_the_command_line():
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "pages.py"), "check"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "generated blocks up to date" in done.stdout


def test_a_typed_figure_in_a_block_fails_the_check():
    readme = (ROOT / "README.md").read_text()
    name, begin, end = next(b for b in pages.blocks_of(readme) if b[0] == "bench")
    shown, before = pages.check_page("README.md", readme)
    assert "bench" in shown and not [p for p in before if ": bench " in p], before
    lines = readme.split("\n")
    row = next(i for i in range(begin, end) if lines[i].startswith("| adaptive"))
    lines[row] = lines[row].replace(" | ", " | 9", 1)   # a digit typed into its tok/s
    _, after = pages.check_page("README.md", "\n".join(lines))
    assert sorted(after) == sorted(before + [f"README.md:{begin + 1}: bench differs from the "
                                             f"rendering of docs/bench.json (scripts/pages.py "
                                             f"write)"])


def test_markers_without_a_binding_or_an_end_are_reported():
    _, problems = pages.check_page("p.md", "<!-- generated: nosuch -->\n\nx\n\n"
                                   "<!-- end: nosuch -->\n")
    assert problems == ["p.md:1: block 'nosuch' has no binding in scripts/page_blocks.py"]
    _, problems = pages.check_page("p.md", "<!-- generated: demo -->\n\nx\n")
    assert len(problems) == 1 and "has no <!-- end: demo -->" in problems[0]


def test_replace_writes_the_rendering_between_the_markers_only():
    text = "a\n<!-- generated: x -->\nold\n<!-- end: x -->\nb\n"
    assert pages.replace(text, "x", "new") == \
        "a\n<!-- generated: x -->\n\nnew\n\n<!-- end: x -->\nb\n"
    assert pages.content(pages.replace(text, "x", "new"), 1, 5) == "new"


def test_the_rerun_comparison_masks_timings_and_bounds_bytes_only():
    block = Block("t", "true", str, bytes_tol=0.02)
    stored = "step 3 | loss 5.551 |  9.19k tok/s | peak 3.01 MiB / 3.03 MiB | save 8 | in 5.9 s"
    timing = stored.replace("9.19k", "1.20k").replace("5.9 s", "20.3 s")
    assert pages.differences(stored, timing, block) == []
    assert pages.differences(stored, stored.replace("3.01 MiB", "3.05 MiB"), block) == []
    assert pages.differences(stored, stored.replace("3.01 MiB", "3.20 MiB"), block)
    assert pages.differences(stored, stored.replace("5.551", "5.552"), block)   # a loss
    assert pages.differences(stored, stored.replace("save 8", "save 9"), block)  # a count
    assert pages.differences(stored, stored.replace("save", "keep"), block)      # the text
    # stored on another processor: a loss within 0.5%, nothing else looser
    other = functools.partial(pages.differences, block=block, same_cpu=False)
    assert other(stored, stored.replace("5.551", "5.540")) == []
    assert other(stored, stored.replace("5.551", "5.521"))
    assert other(stored, stored.replace("3.01 MiB", "3.20 MiB"))
    assert other(stored, stored.replace("save", "keep"))


def test_run_refuses_to_replace_a_stored_record_without_overwrite(tmp_path, monkeypatch):
    monkeypatch.setattr(pages, "RUNS", tmp_path)
    pages.store("x", {"a": 1}, overwrite=False)
    with pytest.raises(SystemExit, match="--overwrite"):
        pages.store("x", {"a": 2}, overwrite=False)
    pages.store("x", {"a": 2}, overwrite=True)
    assert '"a": 2' in (tmp_path / "x.json").read_text()


def _reruns():
    return [pytest.param(name, marks=[pytest.mark.timeout(b.timeout_s + 60)]
                         + ([pytest.mark.examples_long] if b.long else []), id=name)
            for name, b in BLOCKS.items() if b.rerun]


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", _reruns())
def test_a_rerun_gives_what_the_page_quotes(name):
    problems = pages.rerun(name)
    assert not problems, "\n".join(problems)


def test_a_rerun_record_that_moved_fails_the_check_of_the_page(monkeypatch):
    """A stale page seen from the other side: the stored run changed (a new `run NAME`
    whose page was not written), so the page's figure is no longer its record's."""
    readme = (ROOT / "README.md").read_text()
    _, before = pages.check_page("README.md", readme)
    real = pages.load

    def moved(name):
        record = real(name)
        if name == "runtime-ratios":
            record = {**record, "output": {**record["output"], "gap_closed": 0.01}}
        return record

    monkeypatch.setattr(pages, "load", moved)
    _, after = pages.check_page("README.md", readme)
    assert [p for p in after if p not in before] == [
        p for p in after if ": runtime-ratios differs from the rendering of "
        "docs/generated/runtime-ratios.json" in p] != []


def test_every_marker_in_the_pages_has_a_binding_and_every_binding_a_page():
    """The two ends of a binding, over the real pages: an unbound marker (a block typed by
    hand between markers, or a binding renamed) and a binding no page shows both fail."""
    shown = set()
    for page in pages.pages():
        shown |= {name for name, _, _ in pages.blocks_of(page.read_text(encoding="utf-8"))}
    assert shown - set(BLOCKS) == set(), "markers without a binding"
    assert set(BLOCKS) - shown == set(), "bindings no page shows"


def test_the_runtime_ratios_cells_are_the_commands_own_formatting():
    """page_blocks renders the README's runtime_ratios table with the command's public
    formatter (no private names read across modules): decisions, then evictions."""
    from spikeguard.bench.runtime_ratios import decision_cells

    assert decision_cells({"decisions": {}}) == ("-", "-")
    assert decision_cells({"decisions": {"save": 40}, "evicted_bytes": 0}) == ("40 / 0 / 0", "0")
    cells = decision_cells({"decisions": {"save": 1, "recompute": 2, "offload": 3},
                            "evicted_bytes": 3 << 20, "prefetched_bytes": 3 << 20})
    assert cells == ("1 / 2 / 3", "3 MiB (3 MiB back)")
