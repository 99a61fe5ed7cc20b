"""scripts/gpu_check.py: its CPU dry run passes, and a broken guard or a spent time limit
ends in `gpu_check: FAIL (...)` with exit code 1, never a traceback or a silent PASS.

    .venv/bin/python -m pytest tests/test_gpu_check.py -q
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch


pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.py"


def _load():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cpu_dry_run_passes_and_ends_in_the_one_line():
    done = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu"],
                          capture_output=True, text=True, timeout=240)
    lines = done.stdout.strip().splitlines()
    assert lines and lines[-1] == "gpu_check: PASS", done.stdout[-3000:] + done.stderr[-3000:]
    assert done.returncode == 0
    assert sum(line.startswith("gpu_check:") for line in lines) == 1
    for check in ("bitwise", "sizes", "none", "adaptive", "snapshot", "ep"):
        assert f"[{check}] PASS" in done.stdout
    assert "[throughput] REPORT" in done.stdout


def test_different_gradients_are_a_fail(monkeypatch, capsys):
    from spikeguard.integrations import builtin

    gpu_check = _load()
    run_window = builtin.run_window

    def off_by_a_bit(guard, block, dispatched):
        return run_window(guard, block, dispatched) * (1 + 2**-20)

    monkeypatch.setattr(builtin, "run_window", off_by_a_bit)
    assert gpu_check.main(["--device", "cpu", "--reps", "1"]) == 1
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("gpu_check: FAIL (bitwise: none: "), last


def test_spent_time_limit_skips_every_check_and_fails(capsys):
    gpu_check = _load()
    assert gpu_check.main(["--device", "cpu", "--time-limit", "0"]) == 1
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("gpu_check: FAIL (time limit 0 s: skipped bitwise;"), last
    assert "skipped sizes; none: not run, it needs the sizes check" in last


def test_a_bare_cuda_device_gets_the_current_index(monkeypatch):
    """set_per_process_memory_fraction refuses `cuda` without an index (seen on the H200)."""
    gpu_check = _load()
    monkeypatch.setattr(gpu_check.torch.cuda, "current_device", lambda: 3)
    assert gpu_check.indexed(torch.device("cuda")) == torch.device("cuda", 3)
    assert gpu_check.indexed(torch.device("cuda", 1)) == torch.device("cuda", 1)
    assert gpu_check.indexed(torch.device("cpu")) == torch.device("cpu")


def test_run_step_is_used_when_the_guard_has_it():
    gpu_check = _load()
    calls = []

    class WithRunStep:
        def run_step(self, fn):
            calls.append("run_step")
            fn()

    gpu_check.run_guarded(WithRunStep(), lambda: calls.append("fn"))
    assert calls == ["run_step", "fn"]


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="no CUDA device")
def test_on_cuda_passes():
    """The real thing, where a GPU is at hand: the script on CUDA ends in PASS."""
    done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True,
                          timeout=290)
    lines = done.stdout.strip().splitlines()
    assert lines and lines[-1] == "gpu_check: PASS", done.stdout[-3000:] + done.stderr[-3000:]
