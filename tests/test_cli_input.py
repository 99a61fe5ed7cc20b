"""Bad input, as a new user types it: one line `spikeguard: error: ...`, exit 2, no
traceback, input files untouched; under torchrun printed once. Issue 15, parts 4 and 5.

    .venv/bin/python -m pytest tests/test_cli_input.py -q

Most cases run `cli.main` in this process (each would otherwise pay an interpreter and
torch start-up); a representative handful, and the torchrun cases, run the real command.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from spikeguard import cli

from one_line import check_one_line, digests

pytestmark = pytest.mark.timeout(180)

NINES = "9" * 400
TINY = ["train", "--preset", "tiny", "--steps", "2", "--batch-size", "2"]

# (argv with "{tmp}" for the test's folder, a fragment of the one line). Each was a
# traceback, a wrong message, or silently accepted before issue 15.
CASES = {
    "budget of 400 nines": (TINY + ["--budget", NINES], "beyond any device"),
    "budget nan": (TINY + ["--budget", "nan"], "cannot read budget 'nan'"),
    "budget -1GiB as a flag": (TINY + ["--budget", "-1GiB"], "--flag=VALUE"),
    "budget=-1GiB": (TINY + ["--budget=-1GiB"], "budget must be positive"),
    "lr nan": (TINY + ["--lr", "nan"], "train.lr must be a positive number"),
    "grad-clip inf": (TINY + ["--grad-clip", "inf"], "train.grad_clip"),
    "steps of 40 digits": (TINY + ["--steps", "9" * 40], "train.steps must be at most"),
    "seed of 40 digits": (TINY + ["--seed", "9" * 40], "train.seed must be at most"),
    "threads 0": (TINY + ["--threads", "0"], "--threads must be a positive integer"),
    "threads 10**8 (segfaulted)": (TINY + ["--threads", "100000000"], "at most 4096"),
    "spike-prob 5": (TINY + ["--spike-prob", "5"], "--spike-prob is a probability"),
    "d-model 10000000": (TINY + ["--d-model", "10000000"], "parameters: training it needs"),
    "batch of 10**8 sequences": (TINY + ["--batch-size", "100000000"],
                                 "of one micro-batch's activations"),
    "skip-steps past steps": (TINY + ["--skip-steps", "1000"], "--skip-steps 1000: the run has 2"),
    "abbreviated --step": (["train", "--preset", "tiny", "--step", "2"],
                           "unrecognized arguments: --step"),
    "abbreviated simulate --cap": (["simulate", "--cap", "80GiB"], "unrecognized arguments"),
    "binary --trace": (TINY + ["--trace", "{tmp}/binary.dat"], "is not a trace file"),
    "text --trace": (TINY + ["--trace", "{tmp}/run.toml"], "is not a trace file"),
    "folder --trace": (TINY + ["--trace", "{tmp}/folder"], "is a folder, not a trace file"),
    "binary train --config": (["train", "--config", "{tmp}/binary.dat"], "is not a config file"),
    "toml with nan budget": (["train", "--config", "{tmp}/nan.toml"], "finite"),
    "simulate capacity of 400 nines": (["simulate", "--capacity", NINES], "--capacity '999"),
    "simulate capacity nan": (["simulate", "--capacity", "nan"], "--capacity 'nan'"),
    "simulate binary --config": (["simulate", "--config", "{tmp}/binary.dat"],
                                 "is not a config file"),
    "simulate folder --config": (["simulate", "--config", "{tmp}/folder"], "is a folder"),
    "simulate binary --trace": (["simulate", "--trace", "{tmp}/binary.dat"],
                                "is not a trace file"),
    "simulate efficiency nan": (["simulate", "--efficiency", "nan"], "device.efficiency"),
    "simulate restart-s inf": (["simulate", "--restart-s", "inf"], "run.restart_s"),
}

# Run through the real interpreter: the contract is about what a terminal shows.
SUBPROCESS_CASES = ("budget of 400 nines", "binary --trace", "simulate capacity of 400 nines")


def _inputs(tmp: Path) -> list[Path]:
    (tmp / "folder").mkdir(exist_ok=True)
    (tmp / "binary.dat").write_bytes(bytes(range(256)) * 16)   # 0x80.. are not UTF-8
    (tmp / "run.toml").write_text("[train]\nsteps = 2\n")
    (tmp / "nan.toml").write_text("[model]\npreset = 'tiny'\n[guard]\nbudget = nan\n")
    return [tmp / n for n in ("binary.dat", "run.toml", "nan.toml")]


def _argv(case: str, tmp: Path) -> list[str]:
    return [a.replace("{tmp}", str(tmp)) for a in CASES[case][0]]


@pytest.mark.parametrize("case", CASES)
def test_bad_input_is_one_line_and_exit_2(case, tmp_path, capsys):
    inputs = _inputs(tmp_path)
    before = digests(inputs)
    code = cli.main(_argv(case, tmp_path))
    check_one_line(code, capsys.readouterr().err, CASES[case][1])
    assert digests(inputs) == before


def test_bad_input_through_the_real_command(tmp_path):
    inputs = _inputs(tmp_path)
    before = digests(inputs)
    for case in SUBPROCESS_CASES:
        proc = subprocess.run([sys.executable, "-m", "spikeguard", *_argv(case, tmp_path)],
                              capture_output=True, text=True, timeout=120, cwd=tmp_path)
        check_one_line(proc.returncode, proc.stderr, CASES[case][1])
    assert digests(inputs) == before


def test_version_is_the_package_version():
    from importlib.metadata import version

    proc = subprocess.run([sys.executable, "-m", "spikeguard", "--version"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == f"spikeguard {version('spikeguard')}"


def test_every_command_refuses_abbreviations():
    parser = cli._build_parser()
    parsers = [parser] + [p for a in parser._actions if hasattr(a, "choices")
                          and isinstance(a.choices, dict) for p in a.choices.values()]
    assert len(parsers) > 5 and all(not p.allow_abbrev for p in parsers)


# ---- under torchrun: once, exit 2 ------------------------------------------------------
def test_rank_input_errors_are_found_before_torchrun(tmp_path):
    """What each rank would find (a corpus too short for --seq-len) is found by the
    launcher: one line, exit 2, and no torchrun started (fast)."""
    data = tmp_path / "short.txt"
    data.write_text("abc" * 20)
    proc = subprocess.run([sys.executable, "-m", "spikeguard", *TINY, "--nproc", "2",
                           "--data", str(data)], capture_output=True, text=True, timeout=120)
    check_one_line(proc.returncode, proc.stderr, "too little data")


@pytest.mark.timeout(300)
def test_a_usage_error_in_every_rank_is_printed_once_with_exit_2(tmp_path):
    """Past the launcher's checks (launch_job called directly), both ranks refuse their
    --data: the launcher prints the line once and exits 2 (it was once per rank, exit 3)."""
    argv = TINY + ["--nproc", "2", "--data", str(tmp_path / "missing.txt")]
    script = ("import sys; from spikeguard.parallel.launch import launch_job; "
              f"sys.exit(launch_job(2, {json.dumps(argv)}))")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=280)
    check_one_line(proc.returncode, proc.stderr, "data path does not exist")


def test_the_launcher_maps_a_rank_exit_2_to_2():
    from spikeguard.parallel.quiet_torchrun import usage_or_oom

    assert usage_or_oom({2, 1}) == 2 and usage_or_oom({2, -15}) == 2
    assert usage_or_oom({3, 1}) == 3 and usage_or_oom({1}) == 1


def test_an_error_line_is_one_write(monkeypatch):
    """Two ranks share a terminal: a line written in two parts (print's text, then its
    newline) lets another rank's line land between them."""
    writes = []

    class Stream:
        def write(self, text):
            writes.append(text)

        def flush(self):
            pass

    monkeypatch.setattr(sys, "stderr", Stream())
    cli._stderr_line("spikeguard: out of memory on rank 1: ...")
    assert writes == ["spikeguard: out of memory on rank 1: ...\n"]
