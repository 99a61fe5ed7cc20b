"""The `spikeguard` command: exit codes, one-line errors, a short real run, the log.

    .venv/bin/python -m pytest tests/test_cli.py -q
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from spikeguard import cli
from spikeguard.errors import DeviceOutOfMemory, UsageError

pytestmark = pytest.mark.multiprocess

TINY = ["train", "--preset", "tiny", "--steps", "1", "--batch-size", "2"]


# "{tmp}" stands for the test's tmp_path, where _make_data_files puts the data files.
BAD_ARGS = {
    "unknown preset": ["train", "--preset", "huge"],
    "top-k > experts": TINY + ["--num-experts", "4", "--top-k", "5"],
    "missing data": TINY + ["--data", "{tmp}/missing.txt"],
    "empty data file": TINY + ["--data", "{tmp}/empty.txt"],
    "empty data folder": TINY + ["--data", "{tmp}/empty_dir"],
    "too little data": TINY + ["--data", "{tmp}/short.txt"],
    "zero steps": TINY + ["--steps", "0"],
    "zero batch size": TINY + ["--batch-size", "0"],
    "negative micro-batches": TINY + ["--micro-batches", "-1"],
    "zero seq len": TINY + ["--seq-len", "0"],
    "zero lr": TINY + ["--lr", "0"],
    "negative lr": TINY + ["--lr", "-0.001"],
    "zero eval-every": TINY + ["--eval-every", "0"],
    "zero experts": TINY + ["--num-experts", "0"],
    "not an int": TINY + ["--steps", "ten"],
    "unknown flag": TINY + ["--bogus"],
    "unknown policy": TINY + ["--policy", "sometimes"],
    "no command": [],
    "unknown command": ["fly"],
    "log folder missing": TINY + ["--log", "{tmp}/nowhere/run.jsonl"],
    "demo zero steps": ["demo", "--steps", "0"],
    "demo zero processes": ["demo", "--nproc", "0"],
    "zero threads": TINY + ["--threads", "0"],
}


def _make_data_files(tmp_path) -> None:
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "empty_dir").mkdir()
    (tmp_path / "short.txt").write_bytes(b"print('hi')\n" * 3)


@pytest.mark.parametrize("case", BAD_ARGS)
def test_bad_input_is_exit_2_with_one_line(case, tmp_path, capsys):
    _make_data_files(tmp_path)
    argv = [arg.replace("{tmp}", str(tmp_path)) for arg in BAD_ARGS[case]]
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("spikeguard: error: ")
    assert captured.out == ""               # failed before any work was reported


def test_no_traceback_through_the_real_interpreter(tmp_path):
    for argv in (["train", "--preset", "huge"],
                 TINY + ["--data", str(tmp_path / "missing.txt")]):
        proc = subprocess.run([sys.executable, "-m", "spikeguard", *argv], capture_output=True,
                              text=True, timeout=60)
        assert proc.returncode == 2
        assert len(proc.stderr.splitlines()) == 1, proc.stderr
        assert proc.stderr.startswith("spikeguard: error: ")
        assert "Traceback" not in proc.stderr


def test_help_is_exit_0(capsys):
    assert cli.main(["train", "--help"]) == 0
    assert "--micro-batches" in capsys.readouterr().out


def test_train_runs_and_logs(tmp_path, capsys):
    log = tmp_path / "run.jsonl"
    argv = ["train", "--preset", "tiny", "--steps", "4", "--batch-size", "4",
            "--micro-batches", "2", "--eval-every", "2", "--log", str(log)]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split("|")[0].split() for line in out if line.startswith("step")] == \
        [["step", str(i)] for i in range(1, 5)]
    assert out[-1].startswith("done: 4 steps")
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]


def test_train_with_data_folder(tmp_path, capsys):
    folder = tmp_path / "texts"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 40)
    (folder / "sub" / "b.txt").write_text("pack my box with five dozen liquor jugs\n" * 40)
    assert cli.main(TINY + ["--data", str(folder)]) == 0
    assert "2 files" in capsys.readouterr().out


def test_single_process_demo_runs(capsys):
    assert cli.main(["demo", "--nproc", "1", "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "model small" in out and "done: 2 steps" in out


def test_default_demo_is_two_expert_parallel_ranks_with_an_auto_budget():
    """The README's `make demo`, shortened: torchrun, 2 ranks, skew, budget picked and said."""
    proc = subprocess.run([sys.executable, "-m", "spikeguard", "demo", "--steps", "2",
                           "--threads", "1"], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert "expert parallel: 2 ranks" in out and "skew rotating" in out
    assert "memory: budget auto = " in out and "calm step with everything saved" in out
    steps = [line for line in out.splitlines() if line.startswith("step")]
    assert len(steps) == 2 and all("save " in line and "+" in line for line in steps)
    assert "0 steps over" in out and "done: 2 steps" in out


@pytest.mark.parametrize("error,code,prefix", [
    (DeviceOutOfMemory("needed 2.6 GiB, budget 2.0 GiB\nat layer 3"), 3,
     "spikeguard: out of memory: needed 2.6 GiB"),
    (KeyboardInterrupt(), 130, "spikeguard: interrupted"),
    (UsageError("bad\nthing"), 2, "spikeguard: error: bad thing"),
])
def test_errors_during_training(error, code, prefix, monkeypatch, capsys):
    def fail(*args, **kwargs):
        raise error

    monkeypatch.setattr("spikeguard.train.loop.run_loop", fail)
    assert cli.main(TINY) == code
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(prefix)


def test_one_process_out_of_memory_where_even_full_recompute_fails_says_the_budget():
    """Issue 22, item 9: one process, adaptive, a budget under full recompute's peak: the
    run's one line, exit 3, names the budget to try, as a group's does; the re-runs that
    failed too say nothing of their own (a re-run's warning is said once it succeeded)."""
    proc = subprocess.run([sys.executable, "-m", "spikeguard", "train", "--preset", "tiny",
                           "--steps", "2", "--budget", "1MiB", "--policy", "adaptive"],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.splitlines()
    ours = [line for line in lines if line.startswith("spikeguard:")]
    assert ours == lines[-1:], lines
    assert "even full recompute does not fit" in ours[0], ours
    assert "; try a budget of at least " in ours[0], ours
    assert len(lines) == 1, lines
