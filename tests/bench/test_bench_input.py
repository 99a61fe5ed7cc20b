"""Bad input to the benches (`spikeguard bench`, `python -m spikeguard.bench.runtime_ratios`,
`... hf_bench`, `... bench_docs`): one line `spikeguard: error: ...`, exit 2, no traceback,
before any job runs, every input and earlier output byte-identical. Issue 15, parts 4 and 6.

    .venv/bin/python -m pytest tests/bench/test_bench_input.py -q

Most cases run the command's main in this process (each would otherwise pay an
interpreter and a torch start-up); a handful run the real command.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from spikeguard import cli
from spikeguard.bench import bench_docs, hf_bench, runtime_ratios

from one_line import check_one_line, digests

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]

NINES = "9" * 400
BENCH = ["bench", "--preset", "tiny", "--steps", "4", "--segments", "1"]
MAINS = {"bench": cli.main, "runtime_ratios": runtime_ratios.main, "hf_bench": hf_bench.main,
         "bench_docs": bench_docs.main}

# (command, argv with "{tmp}" for the test's folder, a fragment of the one line)
CASES = {
    "restart-cost nan": ("bench", BENCH + ["--restart-cost", "nan"], "--restart-cost must be a finite"),
    "restart-cost inf": ("bench", BENCH + ["--restart-cost", "inf"], "--restart-cost must be a finite"),
    "restart-cost -1": ("bench", BENCH + ["--restart-cost", "-1"], ">= 0"),
    "spike-prob nan": ("bench", BENCH + ["--spike-prob", "nan"], "--spike-prob must be a finite"),
    "spike-prob 5": ("bench", BENCH + ["--spike-prob", "5"], "--spike-prob is a probability"),
    "spike-max inf": ("bench", BENCH + ["--spike-max", "inf"], "--spike-max must be a finite"),
    "spike-from-layer past the layers": ("bench", BENCH + ["--spike-from-layer", "2"],
                                         "a layer of the model's 2 (0 to 1)"),
    "spike-from-layer on a --trace": ("bench", BENCH + ["--trace", "{tmp}/trace.jsonl",
                                                        "--spike-from-layer", "1"],
                                      "a --trace is replayed as it was recorded"),
    "budget nan": ("bench", BENCH + ["--budget", "nan"], "cannot read budget 'nan'"),
    "budget of 400 nines": ("bench", BENCH + ["--budget", NINES], "beyond any device"),
    "steps of 40 digits": ("bench", ["bench", "--steps", "9" * 40], "train.steps must be at most"),
    "binary --trace": ("bench", BENCH + ["--trace", "{tmp}/binary.dat"], "is not a trace file"),
    "text --trace": ("bench", BENCH + ["--trace", "{tmp}/notes.txt"], "is not a trace file"),
    "folder --trace": ("bench", BENCH + ["--trace", "{tmp}/folder"], "is a folder"),
    "abbreviated --step": ("bench", ["bench", "--step", "4"], "unrecognized arguments: --step"),
    "abbreviated --restart": ("bench", BENCH + ["--restart", "5"], "unrecognized arguments"),
    "existing --json": ("bench", BENCH + ["--json", "{tmp}/old.json"], "exists; pass --overwrite"),
    "existing --docs": ("bench", BENCH + ["--docs", "{tmp}/old.md"], "exists; pass --overwrite"),
    "existing plot": ("bench", BENCH + ["--plots", "{tmp}/plots"], "exists; pass --overwrite"),
    "--docs is the --trace": ("bench", BENCH + ["--trace", "{tmp}/trace.jsonl", "--docs",
                                                "{tmp}/trace.jsonl", "--overwrite"],
                              "would overwrite the --trace"),
    "--json is --docs": ("bench", BENCH + ["--json", "{tmp}/new.md", "--docs", "{tmp}/new.md"],
                         "are the same file"),
    "--json in no folder": ("bench", BENCH + ["--json", "{tmp}/no/x.json"], "does not exist"),
    "ratios fraction nan": ("runtime_ratios", ["--fraction", "nan"], "--fraction must be in (0, 1]"),
    "ratios reps nan": ("runtime_ratios", ["--reps", "nan"], "invalid int value"),
    "ratios abbreviated --rep": ("runtime_ratios", ["--rep", "3"], "unrecognized arguments"),
    "ratios threads 10**8": ("runtime_ratios", ["--threads", "100000000"], "[1, 4096]"),
    "ratios batch of 10**9": ("runtime_ratios", ["--batch-size", "1000000000"],
                              "of one micro-batch's activations"),
    "ratios unknown preset": ("runtime_ratios", ["--preset", "huge"], "unknown preset"),
    # the README's table is rendered from this file (scripts/pages.py): checked before the run
    "ratios existing --json": ("runtime_ratios", ["--json", "{tmp}/old.json"],
                               "exists; pass --overwrite"),
    "hf d-model 10000000": ("hf_bench", ["--d-model", "10000000"], "parameters: training it needs"),
    "hf fraction inf": ("hf_bench", ["--fraction", "inf"], "--fraction must be in (0, 1]"),
    "hf abbreviated --frac": ("hf_bench", ["--frac", "0.5"], "unrecognized arguments"),
    "docs binary report": ("bench_docs", ["{tmp}/binary.dat", "{tmp}/page.md"],
                           "is not a bench report"),
    "docs existing page": ("bench_docs", ["{tmp}/old.json", "{tmp}/old.md"], "exists"),
}

# Through the real interpreter: the contract is about what a terminal shows.
SUBPROCESS_CASES = ("restart-cost nan", "binary --trace", "existing --json", "ratios fraction nan")


def _inputs(tmp: Path) -> list[Path]:
    (tmp / "folder").mkdir(exist_ok=True)
    (tmp / "plots").mkdir(exist_ok=True)
    files = {"binary.dat": bytes(range(256)) * 16, "notes.txt": b"just some notes\n",
             "old.json": b'{"keep": "me"}\n', "old.md": b"# my page\n",
             "plots/throughput.png": b"\x89PNG\r\n\x1a\n an old plot",
             "trace.jsonl": b'{"format": "spikeguard-trace"}\n'}
    for name, data in files.items():
        (tmp / name).write_bytes(data)
    return [tmp / name for name in files]


def _argv(case: str, tmp: Path) -> list[str]:
    return [a.replace("{tmp}", str(tmp)) for a in CASES[case][1]]


@pytest.mark.parametrize("case", CASES)
def test_bad_input_is_one_line_and_exit_2(case, tmp_path, capsys):
    inputs = _inputs(tmp_path)
    before = digests(inputs)
    code = MAINS[CASES[case][0]](_argv(case, tmp_path))
    check_one_line(code, capsys.readouterr().err, CASES[case][2])
    assert digests(inputs) == before
    assert not (tmp_path / "new.md").exists() and not (tmp_path / "page.md").exists()


def _command(case: str, tmp: Path) -> list[str]:
    what = CASES[case][0]
    module = "spikeguard" if what == "bench" else f"spikeguard.bench.{what}"
    return [sys.executable, "-m", module, *_argv(case, tmp)]


def test_bad_input_through_the_real_command(tmp_path):
    inputs = _inputs(tmp_path)
    before = digests(inputs)
    scratch = tmp_path / "tmpdir"
    scratch.mkdir()
    for case in SUBPROCESS_CASES:
        proc = subprocess.run(_command(case, tmp_path), capture_output=True, text=True,
                              timeout=120, cwd=tmp_path, env=dict(os.environ, TMPDIR=str(scratch)))
        check_one_line(proc.returncode, proc.stderr, CASES[case][2])
    assert digests(inputs) == before
    assert list(scratch.iterdir()) == []   # no work folder made before the input was checked


def test_an_interrupted_bench_leaves_no_folder_and_no_process(tmp_path):
    """Ctrl-C while its worker runs: exit 130, one line, its temporary work folder removed
    (it was never named as a result), and no process of its worker left."""
    from spikeguard.parallel.launch import job_processes

    scratch = tmp_path / "tmpdir"
    scratch.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "spikeguard", *BENCH, "--policies", "ceiling"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, TMPDIR=str(scratch)))
    deadline = time.monotonic() + 120
    while not list(scratch.glob("spikeguard-bench-*/workers/worker01/ready.rank*")):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    err = proc.communicate(timeout=60)[1]
    assert proc.returncode == 130, err
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert not list(scratch.glob("spikeguard-bench-*"))
    assert job_processes(proc.pid) == []
