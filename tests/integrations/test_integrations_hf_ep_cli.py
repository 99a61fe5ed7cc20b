"""`spikeguard train --hf NAME --nproc N --ep E`: transformers' own expert parallelism,
launched under torchrun (gloo, CPU), and what it refuses, each a real subprocess.

    .venv/bin/python -m pytest tests/integrations/test_integrations_hf_ep_cli.py -q
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from spikeguard.parallel.launch import GROUP_TIMEOUT_S

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]

TINY = ["--steps", "2", "--batch-size", "2", "--seq-len", "32", "--d-model", "32",
        "--eval-batches", "1", "--num-experts", "4", "--threads", "1"]
JOB_TIMEOUT_S = 150


def spikeguard(*argv: str, timeout_s: float = JOB_TIMEOUT_S) -> subprocess.CompletedProcess:
    try:
        return subprocess.run([sys.executable, "-m", "spikeguard", "train", *argv],
                              capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        pytest.fail(f"spikeguard train {' '.join(argv)} did not finish in {timeout_s} s")


def test_train_hf_under_transformers_ep_on_two_ranks(tmp_path):
    log = tmp_path / "run.jsonl"
    done = spikeguard("--hf", "qwen3_moe", "--nproc", "2", "--ep", "2", *TINY, "--log", str(log))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "expert parallel: transformers' own, ep 2 x FSDP2 over 2 ranks" in done.stdout
    assert "(worst rank) (emulated device)" in done.stdout
    for path in (log, tmp_path / "run.rank1.jsonl"):
        records = [json.loads(line) for line in path.read_text().splitlines()]
        assert [r["step"] for r in records] == [1, 2]
        for r in records:
            assert 0 < r["peak_bytes"] <= r["budget_bytes"]
            assert sum(r["decisions"].values()) == 2      # two MoE layers, one micro-batch
            assert len(r["received_per_layer"]) == 2      # rows this rank's experts got
    assert "Traceback" not in done.stderr


def test_out_of_memory_inside_transformers_combine_ends_the_job_in_one_line_exit_3():
    """The default sizes at 15.4 MiB under `none`: rank 0's device refuses inside
    transformers' combine of layer 1, after its all-to-all (this machine, CPU, emulated
    device). The journal once made that combine again with zeros, which its peer never
    joined: rank 1 waited out gloo's 120 s and printed a traceback, rank 0 died without
    a word, exit 1. Now every rank holds the agreed line at once: exit 3, the rank's line
    and the launcher's, no traceback; the subprocess's deadline is under the group's
    timeout, so a hang fails here."""
    done = spikeguard("--hf", "qwen3_moe", "--nproc", "2", "--ep", "2", "--steps", "3",
                      "--threads", "1", "--policy", "none", "--budget", "15.4MiB",
                      timeout_s=GROUP_TIMEOUT_S - 20)
    assert done.returncode == 3, done.stderr[-3000:]
    lines = done.stderr.splitlines()
    assert len(lines) == 2, done.stderr[-3000:]
    assert lines[0].startswith("spikeguard: out of memory on rank "), lines
    assert "ran out of memory (exit 3, its message is above)" in lines[1], lines


REFUSED = [
    (["--nproc", "2", "--ep", "1"], "--ep must be the number of processes 2"),
    (["--ep", "2"], "must divide the number of processes 1"),
    (["--nproc", "2", "--ep", "2", "--num-experts", "3"], "must divide the number of experts"),
    (["--nproc", "2", "--skew", "one-hot-rank"], "--skew is not available with --hf"),
    (["--nproc", "2", "--trace", "t.jsonl"], "--trace is not available with --hf"),
    (["--nproc", "2", "--pp", "2", "--ep", "1"], "--pp is not available with --hf"),
    (["--nproc", "2", "--checkpoint-dir", "ck"], "--checkpoint-dir is not available with --hf"),
]


@pytest.mark.parametrize("argv, message", REFUSED[:2])
def test_refused_layouts_are_one_line_and_exit_2_from_the_command(argv, message):
    done = spikeguard("--hf", "qwen3_moe", *argv)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr and done.stderr.count("\n") == 1, done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("argv, message", REFUSED[2:])
def test_refused_features_are_one_line_and_exit_2(argv, message, capsys):
    from spikeguard.cli import main
    assert main(["train", "--hf", "qwen3_moe", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err
