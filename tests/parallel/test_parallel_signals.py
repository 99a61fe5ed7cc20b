"""Signals end the whole job, cleanly (real processes under torchrun, gloo, tiny preset).

SIGINT / SIGTERM to the launcher's PID (what a scheduler does) stop torchrun and every
rank: exit 130 / 143, one line, a log of whole records, and no process of the job alive
10 s after the signal (looked up with `ps`, by the launcher's PID in their environment).
SIGKILL of the launcher takes the job with it. A rank that dies is named in the final
line, and no other rank prints a traceback.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]

TINY = ["train", "--preset", "tiny", "--num-experts", "8", "--batch-size", "8", "--threads", "1",
        "--nproc", "2"]
LAYOUTS = {"ep": [], "pp": ["--pp", "2", "--num-layers", "4"]}


def _job_pids(launcher_pid: int) -> list[int]:
    """Processes whose environment names this launcher (`ps e` prints it after the args)."""
    out = subprocess.run(["ps", "e", "-eww", "-o", "pid=,args="], capture_output=True,
                         text=True, timeout=30).stdout
    marker = f"SPIKEGUARD_LAUNCHER_PID={launcher_pid}"
    return [int(line.split()[0]) for line in out.splitlines()
            if marker in line.split() and int(line.split()[0]) != launcher_pid]


def _start(tmp_path, extra):
    log = tmp_path / "run.jsonl"
    argv = TINY + ["--steps", "100000", "--log", str(log), *extra]
    err = open(tmp_path / "stderr", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "spikeguard", *argv], stdout=subprocess.DEVNULL,
                            stderr=err, text=True, start_new_session=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    deadline = time.monotonic() + 150
    while not (log.exists() and log.read_text().count("\n") >= 2):
        assert proc.poll() is None, (tmp_path / "stderr").read_text()[-2000:]
        assert time.monotonic() < deadline, "the job never trained"
        time.sleep(0.2)
    pids = _job_pids(proc.pid)
    assert len(pids) == 3, pids   # torchrun and its 2 ranks
    return proc, log, err


def _stop(proc):
    if proc.poll() is None:
        proc.kill()
        proc.wait(10)


def _records(log) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()]  # every line whole


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_to_the_launcher_stops_the_whole_job(tmp_path, layout, sig):
    proc, log, err = _start(tmp_path, LAYOUTS[layout])
    try:
        pids = _job_pids(proc.pid)
        sent = time.monotonic()
        os.kill(proc.pid, sig)
        code = proc.wait(timeout=30)
        took = time.monotonic() - sent
        time.sleep(max(0.0, 10 - (time.monotonic() - sent)))
        alive = _job_pids(proc.pid)
    finally:
        _stop(proc)
    err.seek(0)
    lines = err.read().splitlines()
    assert code == 128 + sig, lines[-20:]
    assert not alive, f"left running 10 s after {sig.name}: {alive} (of {pids})"
    assert len(lines) == 1 and lines[0].startswith(f"spikeguard: stopped by {sig.name}"), lines
    assert took < 10, f"the launcher took {took:.1f} s to stop"
    assert _records(log)


def test_a_sigkilled_launcher_takes_the_job_with_it(tmp_path):
    proc, log, err = _start(tmp_path, [])
    try:
        pids = _job_pids(proc.pid)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        deadline = time.monotonic() + 20   # torchrun's grace to its ranks is 4 s
        while _job_pids(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        alive = _job_pids(proc.pid)
    finally:
        for pid in _job_pids(proc.pid):
            os.kill(pid, signal.SIGKILL)
    assert not alive, f"the ranks trained on without their launcher: {alive} (of {pids})"


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_killed_rank_is_named_and_no_other_prints_a_traceback(tmp_path, layout):
    proc, log, err = _start(tmp_path, LAYOUTS[layout])
    try:
        ranks = sorted(_job_pids(proc.pid))[1:]   # torchrun started first
        os.kill(ranks[-1], signal.SIGKILL)
        code = proc.wait(timeout=60)
    finally:
        _stop(proc)
    err.seek(0)
    text = err.read()
    assert "Traceback" not in text, text[-3000:]
    assert code == 1
    # one line: the dead rank, named; no survivor's "rank N stopped" before it
    assert text.splitlines() == ["spikeguard: rank 1 was killed by SIGKILL; the job stopped"], text


def test_pipeline_out_of_memory_names_the_rank_without_a_traceback():
    """--policy none under a pipeline: a stage runs out of memory; the other stage's broken
    send/recv (torch wraps it: "[Stage 0] failed to run forward") is one line, not ~100."""
    proc = subprocess.run([sys.executable, "-m", "spikeguard", *TINY, *LAYOUTS["pp"], "--steps",
                           "3", "--budget", "3MiB", "--policy", "none"],
                          capture_output=True, text=True, timeout=200,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.returncode == 3, proc.stderr[-2000:]
    # the rank's own out-of-memory line, then the final line naming it: nothing else
    lines = proc.stderr.splitlines()
    assert len(lines) == 2 and lines[0].startswith("spikeguard: out of memory on rank "), lines
    last = lines[-1]
    assert last.startswith("spikeguard: rank ") and "ran out of memory (exit 3" in last, last
