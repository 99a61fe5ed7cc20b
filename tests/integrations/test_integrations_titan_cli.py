"""`spikeguard train --titan NAME`, real subprocesses: one process and EP=2 under torchrun
(torchtitan's own expert parallelism, gloo) train and finish; refused configurations are
one line and exit 2, never a traceback (an unknown model, --titan with --hf, layouts and
features torchtitan runs do not have, torchtitan missing: in test_integrations_core.py).

    .venv/bin/python -m pytest tests/integrations/test_integrations_titan_cli.py -q
"""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("torchtitan")

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]

SMALL = ["--seq-len", "32", "--batch-size", "2", "--eval-batches", "1"]


def _train(*args, timeout=200):
    return subprocess.run([sys.executable, "-m", "spikeguard", "train", "--titan", *args],
                          capture_output=True, text=True, timeout=timeout)


def test_trains_in_one_process(capsys):
    from spikeguard.cli import main
    assert main(["train", "--titan", "deepseek_v3", "--steps", "2", "--budget", "auto",
                 *SMALL]) == 0
    out = capsys.readouterr().out
    assert "torchtitan 0.3.0" in out and "done: 2 steps" in out


def test_trains_under_torchrun_with_torchtitans_ep():
    done = _train("deepseek_v3", "--steps", "2", "--budget", "auto", *SMALL,
                  "--nproc", "2", "--ep", "2")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "4 experts per rank (torchtitan's EP)" in done.stdout
    assert "done: 2 steps" in done.stdout and "Traceback" not in done.stderr


@pytest.mark.parametrize("layout", [[], ["--nproc", "2", "--ep", "2"]], ids=["one", "ep2"])
def test_the_readme_command_with_no_budget_or_policy_trains(layout):
    # No guard: the step line's imbalance is torchtitan's own routing count (it was read
    # only from the built-in blocks or a guard's record: KeyError 'imbalance').
    done = subprocess.run([sys.executable, "-m", "spikeguard", "train", "--titan", "deepseek_v3",
                           *layout, "--steps", "2"], capture_output=True, text=True, timeout=200)
    assert done.returncode == 0, done.stderr[-3000:]
    steps = [l for l in done.stdout.splitlines() if l.startswith("step ")]
    assert len(steps) == 2 and all(" | imb " in l and "peak" not in l for l in steps), done.stdout
    assert "done: 2 steps" in done.stdout and "Traceback" not in done.stderr


@pytest.mark.parametrize("args, says", [
    (["nope"], "unknown torchtitan model 'nope'"),
    (["deepseek_v3", "--hf", "mixtral"], "--titan and --hf"),
    (["deepseek_v3", "--nproc", "2", "--ep", "1"], "not available with --titan"),
    (["deepseek_v3", "--nproc", "2", "--skew", "one-hot-rank"], "not available with --titan"),
    (["qwen3", "--d-model", "33"], "model.d_model 33 must divide into 2 heads"),
])
def test_refused_in_one_line(args, says):
    done = _train(*args, "--steps", "1", timeout=60)
    assert done.returncode == 2, (done.stdout, done.stderr[-2000:])
    lines = [l for l in done.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and says in lines[0], done.stderr
