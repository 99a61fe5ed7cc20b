"""Nothing already written is lost (issue 15, part 1), through the real command line: an
existing output is refused without --overwrite, an output equal to an input is refused
before anything runs, a full disk is one line; each case checks the exit code, exactly
one stderr line, no traceback, and every file there byte-identical afterwards. Then
spikeguard.files' own promises: a failed write leaves the previous file whole.

    .venv/bin/python -m pytest tests/test_files.py -q
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from spikeguard.errors import OutputError, UsageError
from spikeguard.files import LineFile, atomic_write, check_outputs

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]
TINY = ["train", "--preset", "tiny", "--batch-size", "2", "--threads", "1",
        "--eval-every", "100", "--eval-batches", "1"]
SIM = ["simulate", "--preset", "188b", "--steps", "5", "--devices", "128"]


def spikeguard(*argv, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "spikeguard", *map(str, argv)], cwd=cwd,
                          capture_output=True, text=True, timeout=240,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))


def snapshot(folder: Path) -> dict:
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file()}


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """An existing log, a recorded trace, a checkpoint, a simulate config and its outputs."""
    d = tmp_path_factory.mktemp("files")
    proc = spikeguard(*TINY, "--steps", "2", "--log", "old.jsonl", "--record-trace", "t.jsonl",
                      "--checkpoint-dir", "ck", "--checkpoint-every", "2", cwd=d)
    assert proc.returncode == 0, proc.stderr
    (d / "sim.toml").write_text("[workload]\nsteps = 5\n")
    (d / "img").mkdir()
    (d / "img" / "sim_peaks.png").write_bytes(b"a tracked image")
    (d / "sim.json").write_text('{"an": "earlier result"}\n')
    return d


CASES = {
    "log exists": (TINY + ["--steps", "2", "--log", "old.jsonl"], "exists; pass --overwrite"),
    "record-trace exists": (TINY + ["--steps", "2", "--record-trace", "t.jsonl"],
                            "exists; pass --overwrite"),
    "log is the trace replayed": (TINY + ["--steps", "2", "--trace", "t.jsonl", "--log",
                                          "t.jsonl", "--overwrite"], "would overwrite the --trace"),
    "record-trace is the log": (TINY + ["--steps", "2", "--record-trace", "new.jsonl", "--log",
                                        "new.jsonl"], "are the same file"),
    "log is a checkpoint file": (TINY + ["--steps", "2", "--log", "ck/manifest.json",
                                         "--checkpoint-dir", "ck", "--overwrite"],
                                 "would overwrite ck/manifest.json"),
    "checkpoint without --resume": (TINY + ["--steps", "2", "--checkpoint-dir", "ck"],
                                    "holds a checkpoint; pass --resume"),
    "log on a full disk": (TINY + ["--steps", "2", "--log", "/dev/full"],
                           "No space left on device"),
    "simulate json is its config": (SIM + ["--config", "sim.toml", "--json", "sim.toml"],
                                    "would overwrite the --config"),
    "simulate json exists": (SIM + ["--json", "sim.json"], "exists; pass --overwrite"),
    "simulate plots exist": (SIM + ["--plots", "img"], "img/sim_peaks.png exists"),
}


@pytest.mark.parametrize("name", CASES)
def test_data_loss_case_is_one_line_and_keeps_every_file(work, name):
    argv, match = CASES[name]
    before = snapshot(work)
    proc = spikeguard(*argv, cwd=work)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert len(err) == 1 and match in err[0] and "Traceback" not in proc.stderr, proc.stderr
    assert snapshot(work) == before
    assert not [p for p in work.rglob(".*tmp-*")]


def test_overwrite_replaces_and_resume_appends(tmp_path):
    assert spikeguard(*TINY, "--steps", "2", "--log", "a.jsonl", "--checkpoint-dir", "ck",
                      "--checkpoint-every", "1", cwd=tmp_path).returncode == 0
    first = (tmp_path / "a.jsonl").read_bytes()
    proc = spikeguard(*TINY, "--steps", "3", "--log", "a.jsonl", "--checkpoint-dir", "ck",
                      "--resume", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    appended = (tmp_path / "a.jsonl").read_bytes()
    assert appended.startswith(first)
    assert [json.loads(l)["step"] for l in appended.splitlines()] == [1, 2, 3]
    proc = spikeguard(*TINY, "--steps", "1", "--log", "a.jsonl", "--overwrite", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert [json.loads(l)["step"] for l in (tmp_path / "a.jsonl").read_text().splitlines()] == [1]
    assert not list(tmp_path.glob(".*tmp-*"))


def test_refusals_in_the_library(tmp_path):
    (tmp_path / "in.txt").write_text("x")
    with pytest.raises(UsageError, match="same file"):
        check_outputs({"--a": tmp_path / "o", "--b": tmp_path / "o"})
    with pytest.raises(UsageError, match="would overwrite"):
        check_outputs({"--a": tmp_path / "in.txt"}, inputs={"--in": tmp_path / "in.txt"},
                      overwrite=True)
    with pytest.raises(UsageError, match="folder .* does not exist"):
        check_outputs({"--a": tmp_path / "no" / "o"})
    with pytest.raises(UsageError, match="exists"):
        atomic_write(tmp_path / "in.txt", "y", overwrite=False)
    assert (tmp_path / "in.txt").read_text() == "x"


def _failing_write(monkeypatch, after: int):
    """os.write fails with ENOSPC from its `after`-th call on (a disk filling up)."""
    real, calls = os.write, [0]

    def write(fd, data):
        calls[0] += 1
        if calls[0] > after:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data)
    monkeypatch.setattr(os, "write", write)


def test_full_disk_mid_run_keeps_the_previous_file(tmp_path, monkeypatch):
    old = tmp_path / "log.jsonl"
    old.write_text('{"step": 1}\n{"step": 2}\n')
    log = LineFile(old, mode="overwrite")
    log.write_line('{"step": 1}')
    _failing_write(monkeypatch, after=0)
    with pytest.raises(OutputError, match="disk full"):
        log.write_line('{"step": 2}')
    log.close()
    assert old.read_text() == '{"step": 1}\n{"step": 2}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["log.jsonl"]
    monkeypatch.undo()
    log = LineFile(old, mode="append")   # appending: the failed line is cut off, no half line
    _failing_write(monkeypatch, after=0)
    with pytest.raises(OutputError):
        log.write_line('{"step": 3}')
    assert old.read_text() == '{"step": 1}\n{"step": 2}\n'


def test_atomic_write_failure_keeps_the_previous_file(tmp_path):
    target = tmp_path / "sim.json"
    target.write_text("old")

    def writer(tmp):
        Path(tmp).write_text("half")
        raise OSError(errno.ENOSPC, "No space left on device")
    with pytest.raises(OutputError, match="previous file is unchanged"):
        atomic_write(target, overwrite=True, writer=writer)
    assert target.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sim.json"]
    atomic_write(target, "new", overwrite=True)
    assert target.read_text() == "new"


# ---- issue 22: --overwrite keeps the old file whole until the run ends normally --------
OLD_LOG = '{"step": 1, "an": "earlier run"}\n{"step": 2}\n'


@pytest.mark.parametrize("lines", [0, 1])
def test_an_overwrite_that_fails_or_is_interrupted_leaves_the_old_file_whole(tmp_path, lines):
    from spikeguard.errors import Interrupted

    old = tmp_path / "log.jsonl"
    for stop in (Interrupted(2), RuntimeError("out of memory")):
        old.write_text(OLD_LOG)
        with pytest.raises(type(stop)):
            with LineFile(old, mode="overwrite") as log:
                for i in range(lines):
                    log.write_line(f'{{"step": {i + 1}}}')
                raise stop
        assert old.read_text() == OLD_LOG
        assert sorted(p.name for p in tmp_path.iterdir()) == ["log.jsonl"]


def test_an_overwrite_lands_at_a_normal_end_having_written(tmp_path):
    old = tmp_path / "log.jsonl"
    old.write_text(OLD_LOG)
    with LineFile(old, mode="overwrite"):
        pass   # nothing to write: nothing replaced
    assert old.read_text() == OLD_LOG
    with LineFile(old, mode="overwrite") as log:
        assert not list(tmp_path.glob(".*tmp-*"))   # created with the first line
        log.write_line('{"step": 1}')
        assert old.read_text() == OLD_LOG
    assert old.read_text() == '{"step": 1}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["log.jsonl"]


@pytest.mark.parametrize("where", ["before the first step", "after the first step"])
def test_a_train_overwrite_that_dies_keeps_the_old_log(tmp_path, capsys, monkeypatch, where):
    """The run stops (Ctrl-C) before its first step (while its optimizer is built) or
    after its first line was logged: the old log and the old trace stay whole (they
    were replaced by an empty or a partial one)."""
    from spikeguard import cli
    from spikeguard.errors import Interrupted
    from spikeguard.train import loop

    old, trace = tmp_path / "old.jsonl", tmp_path / "t.jsonl"
    old.write_text(OLD_LOG)
    trace.write_text('{"an": "old trace"}\n')
    if where == "before the first step":
        def stop(*args, **kwargs):
            raise Interrupted(2)
        monkeypatch.setattr(loop, "make_optimizer", stop)
    else:
        real = loop.step_line

        def stop(record, num_steps):
            if record["step"] == 2:
                raise Interrupted(2)
            return real(record, num_steps)
        monkeypatch.setattr(loop, "step_line", stop)
    code = cli.main(TINY + ["--steps", "3", "--log", str(old), "--record-trace", str(trace),
                            "--overwrite"])
    assert code == 130, capsys.readouterr().err
    assert old.read_text() == OLD_LOG and trace.read_text() == '{"an": "old trace"}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.jsonl", "t.jsonl"]


def test_a_path_ending_in_a_slash_names_a_folder(tmp_path):
    with pytest.raises(UsageError, match="ends in '/'"):
        check_outputs({"--log": f"{tmp_path}/newdir/"})
    assert list(tmp_path.iterdir()) == []
