"""`spikeguard train --hf`: a tiny transformers MoE model trained under the guard.

    .venv/bin/python -m pytest tests/integrations/test_integrations_hf_cli.py -q
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from spikeguard.cli import main  # noqa: E402

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]

TINY = ["--steps", "2", "--batch-size", "2", "--seq-len", "32", "--d-model", "32",
        "--eval-batches", "1", "--num-experts", "4"]


def test_train_hf_adaptive_under_measured_budget(tmp_path, capsys):
    log = tmp_path / "run.jsonl"
    assert main(["train", "--hf", "qwen3_moe", *TINY, "--log", str(log)]) == 0
    out = capsys.readouterr().out
    assert "0.85 x the unguarded peak" in out and "emulated device" in out
    assert "bytes per routed copy derived" in out
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert 0 < r["peak_bytes"] <= r["budget_bytes"]
        assert sum(r["decisions"].values()) == 2  # two MoE layers, one micro-batch
        assert r["policy"] == "adaptive"
    assert "val_loss" in records[-1]


def test_train_hf_none_dies_under_the_same_budget(capsys):
    assert main(["train", "--hf", "mixtral", *TINY, "--policy", "none"]) == 3
    err = capsys.readouterr().err
    assert err.startswith("spikeguard: out of memory") and err.count("\n") == 1


def test_train_hf_from_json_file(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "olmoe", "norm_topk_prob": True,
                                  "hidden_size": 4096, "vocab_size": 50304}))
    assert main(["train", "--hf", str(config), *TINY, "--budget", "64MiB"]) == 0
    assert "olmoe" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--hf", "nosuch"], "unknown transformers model type 'nosuch'"),
    (["--hf", "llama"], "not a mixture-of-experts model"),
    (["--hf", "missing.json"], "config JSON not found"),
    (["--hf", "{\"hidden_size\": 8}"], "no \"model_type\""),
    (["--hf", "{not json"], "not valid JSON"),
    (["--hf", "mixtral", "--top-k", "9", "--num-experts", "8"], "model.top_k (9) cannot exceed model.num_experts (8)"),
    (["--hf", "mixtral", "--d-model", "0"], "d_model must be a positive integer"),
    (["--hf", "mixtral", "--nproc", "2", "--ep", "1"], "--ep must be the number of processes"),
    (["--hf", "mixtral", "--budget", "lots"], "as a byte size"),
    (["--hf", "mixtral", "--steps", "0"], "steps must be a positive integer"),
])
def test_train_hf_bad_input_is_one_line(argv, message, capsys):
    assert main(["train", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err
