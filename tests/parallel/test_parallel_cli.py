"""`spikeguard train --nproc N --ep E`: layout errors before any process starts, and real
2-rank runs under torchrun (gloo): a forced spike kills `none` on a rank with a message
naming it, while `adaptive` finishes every step."""

import subprocess
import sys

import pytest

from spikeguard import cli

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

TINY8 = ["train", "--preset", "tiny", "--num-experts", "8", "--steps", "3", "--batch-size", "8",
         "--threads", "1"]
SPIKE = ["--nproc", "2", "--skew", "one-hot-rank", "--spike-prob", "1", "--spike-max", "2",
         "--budget", "auto"]   # a fixed figure would be this machine's, not the model's


@pytest.mark.parametrize("extra,match", [
    (["--nproc", "3"], "divide the number of experts"),
    (["--nproc", "4", "--ep", "3"], "divide the number of processes"),
    (["--nproc", "0"], "positive"),
    (["--skew", "production"], "expert parallelism"),
    (["--nproc", "2", "--skew", "production", "--spike-max", "3"], "spike"),
])
def test_bad_layouts_exit_2_before_any_process_starts(extra, match, capsys):
    assert cli.main(TINY8 + extra) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and match in err[0], err


def _run(args):
    return subprocess.run([sys.executable, "-m", "spikeguard", *args], capture_output=True,
                          text=True, timeout=240)


def test_none_dies_on_the_spiked_rank_with_a_clear_message():
    proc = _run(TINY8 + SPIKE + ["--policy", "none"])
    assert proc.returncode == 3
    assert "spikeguard: out of memory on rank" in proc.stderr
    # where it died: a layer, or the head (the spike's rows reach it through combine)
    assert ("layer" in proc.stderr or "output head" in proc.stderr) and "MiB" in proc.stderr
    # the other rank's broken collective (when it sees it before torchrun stops it) and
    # torchrun's own report are one line each
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]


def test_adaptive_finishes_every_step_under_the_same_spikes(tmp_path):
    import json

    log = tmp_path / "run.jsonl"
    proc = _run(TINY8 + SPIKE + ["--policy", "adaptive", "--log", str(log)])
    assert proc.returncode == 0, proc.stderr[-2000:]
    # The cluster summary carries every rank's evictions and bytes brought back, rank 0's
    # as its own guard counted them.
    for record in map(json.loads, log.read_text().splitlines()):
        for field in ("evicted_bytes", "prefetched_bytes"):
            assert len(record[f"rank_{field}"]) == 2 and \
                record[f"rank_{field}"][0] == record[field], record
    steps = [line for line in proc.stdout.splitlines() if line.startswith("step")]
    assert len(steps) == 3
    assert all("rank-imb" in line and "peak" in line for line in steps)
    # Prevention, not the net: every spike planned for, no safety-net re-run.
    assert "0 steps over | 0 safety-net re-runs" in proc.stdout, proc.stdout[-2000:]


AUTO = ["--nproc", "2", "--skew", "one-hot-rank", "--spike-prob", "1", "--spike-max", "2",
        "--budget", "auto"]


def test_auto_budget_fits_calm_steps_and_not_a_2x_spike():
    """--budget auto measures a calm step (routing held at 1.2x) with everything saved and
    adds 10% of its activations: `none` dies on the 2x spike, `adaptive` stays under."""
    died = _run(TINY8 + AUTO + ["--policy", "none"])
    assert died.returncode == 3, died.stdout[-2000:] + died.stderr[-2000:]
    assert "memory: budget auto = " in died.stdout
    assert "spikeguard: out of memory on rank 0" in died.stderr
    lived = _run(TINY8 + AUTO + ["--policy", "adaptive"])
    assert lived.returncode == 0, lived.stderr[-2000:]
    summary = [line for line in lived.stdout.splitlines() if line.startswith("memory: peak")]
    assert summary and "| 0 steps over |" in summary[0], lived.stdout[-2000:]
    assert "3 spike steps" in summary[0]


def _children(pid: int) -> list[int]:
    """Child processes of `pid`, from /proc (Linux)."""
    import os

    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                kids.append(int(entry))
    return kids


def test_a_rank_that_dies_stops_the_job_with_a_clear_message(tmp_path):
    """SIGKILL one rank mid-run: torchrun stops the other, the command exits non-zero
    with one clear line, well within the group timeout (no hang)."""
    import os
    import signal
    import time

    log = tmp_path / "run.jsonl"
    argv = ["train", "--preset", "tiny", "--num-experts", "8", "--batch-size", "8",
            "--steps", "100000", "--threads", "1", "--nproc", "2", "--log", str(log)]
    proc = subprocess.Popen([sys.executable, "-m", "spikeguard", *argv],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (log.exists() and log.read_text().count("\n") >= 2):
            assert proc.poll() is None and time.monotonic() < deadline, "the job never trained"
            time.sleep(0.2)
        workers = [w for t in _children(proc.pid) for w in _children(t)]
        assert len(workers) == 2, workers
        killed_at = time.monotonic()
        os.kill(workers[-1], signal.SIGKILL)
        out, err = proc.communicate(timeout=90)
        took = time.monotonic() - killed_at
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1
    assert err.splitlines()[-1] == "spikeguard: rank 1 was killed by SIGKILL; the job stopped", err
    assert took < 60, f"the job took {took:.0f} s to stop after a rank died"


def test_torchrun_by_hand_with_the_arguments_in_the_environment():
    """The README's several-machines form, on one node: torchrun started by hand, the
    arguments in SPIKEGUARD_ARGV, no --nproc: the world size is torchrun's."""
    import json
    import os

    argv = ["train", "--preset", "tiny", "--num-experts", "8", "--ep", "2", "--steps", "2",
            "--batch-size", "8", "--threads", "1"]
    env = dict(os.environ, SPIKEGUARD_ARGV=json.dumps(argv), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "2", "-m", "spikeguard"],
                          capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "expert parallel: 2 ranks" in proc.stdout and "done: 2 steps" in proc.stdout
