"""Ctrl-C is never swallowed: SIGINT to a single-process guarded run exits 130 with one
line, also when it lands inside a finalizer (`__del__`), where Python drops it."""

import os
import signal
import subprocess
import sys
import time

import pytest

from spikeguard import cli

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]

GUARDED = ["train", "--preset", "tiny", "--steps", "100000", "--threads", "1",
           "--budget", "4MiB", "--policy", "adaptive"]


def test_sigint_to_a_guarded_run_exits_130_with_one_line(tmp_path):
    """Three runs at once, each interrupted at a different moment of its steps."""
    procs = []
    for k in range(3):
        log = tmp_path / f"run{k}.jsonl"
        procs.append((subprocess.Popen([sys.executable, "-m", "spikeguard", *GUARDED, "--log",
                                        str(log)], stdout=subprocess.DEVNULL,
                                       stderr=subprocess.PIPE, text=True,
                                       env=dict(os.environ, OMP_NUM_THREADS="1")), log, k))
    try:
        for proc, log, k in procs:
            deadline = time.monotonic() + 150
            while not (log.exists() and log.read_text().count("\n") >= 1 + k):
                assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
                time.sleep(0.05)
            time.sleep(0.05 * k)
            os.kill(proc.pid, signal.SIGINT)
        results = [(proc.wait(timeout=30), proc.stderr.read()) for proc, _, _ in procs]
    finally:
        for proc, _, _ in procs:
            if proc.poll() is None:
                proc.kill()
    for code, err in results:
        assert code == 130 and err.splitlines() == ["spikeguard: interrupted"], (code, err)


def test_an_interrupt_inside_a_finalizer_still_stops_the_run(monkeypatch, capsys):
    """The SIGINT arrives while a `__del__` runs (as it did in runtime/hooks.py's Packed):
    Python prints "Exception ignored" and goes on; the command must still stop."""
    class Finalized:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGINT)
            sum(range(1000))   # the handler runs here, inside __del__

    def train(*args, **kwargs):
        Finalized()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            sum(range(1000))
        return []

    monkeypatch.setattr("spikeguard.train.loop.run_loop", train)
    assert cli.main(["train", "--preset", "tiny", "--steps", "3"]) == 130
    err = capsys.readouterr().err
    assert err.splitlines() == ["spikeguard: interrupted"], err


def test_sigterm_to_a_single_process_run_exits_143(monkeypatch, capsys):
    def train(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(20)
        return []

    monkeypatch.setattr("spikeguard.train.loop.run_loop", train)
    assert cli.main(["train", "--preset", "tiny", "--steps", "3"]) == 143
    assert capsys.readouterr().err.splitlines() == ["spikeguard: interrupted by SIGTERM"]


@pytest.mark.parametrize("launched", [True, False])
def test_a_rank_whose_peer_died_leaves_the_final_line_to_the_launcher(monkeypatch, capsys,
                                                                      launched):
    """A surviving rank's collective breaks when its peer dies. Under spikeguard's launcher
    the survivor says nothing (the launcher's one final line names the dead rank); under a
    torchrun started by hand, where nobody speaks for the job, it says one line."""
    from spikeguard.errors import ArgumentParser
    from spikeguard.parallel.launch import LAUNCHER_ENV

    for name, value in (("RANK", "1"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "1")):
        monkeypatch.setenv(name, value)
    if launched:
        monkeypatch.setenv(LAUNCHER_ENV, str(os.getpid()))
    else:
        monkeypatch.delenv(LAUNCHER_ENV, raising=False)
    monkeypatch.setattr(cli, "PEER_STOP_WAIT_S", 0.05)

    def broken(args):
        raise RuntimeError("[Stage 0] failed to run forward: Connection closed by peer [::1]:1")

    parser = ArgumentParser(prog="spikeguard")
    parser.set_defaults(run=broken)
    monkeypatch.setattr(cli, "_build_parser", lambda: parser)
    assert cli._run([]) == 1
    err = capsys.readouterr().err.splitlines()
    if launched:
        assert err == []
    else:
        assert len(err) == 1 and err[0].startswith("spikeguard: rank 1 stopped: another rank"), err


def test_a_packed_tensor_half_built_by_an_interrupt_finalizes_quietly(monkeypatch):
    """SIGINT inside Packed.__init__ left its slots unset, and its __del__ printed
    "Exception ignored ... no attribute 'ledger'" after the interrupt's one line."""
    from spikeguard.runtime.hooks import Packed

    dropped = []
    monkeypatch.setattr(sys, "unraisablehook", dropped.append)
    half = Packed.__new__(Packed)   # __init__ never ran
    del half
    assert dropped == []
