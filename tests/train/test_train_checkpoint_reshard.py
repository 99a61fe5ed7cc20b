"""DCP checkpoints reshard (issue 25 item 3), through the real command line (torchrun, gloo):
a checkpoint saved at EP=2 resumes at EP=2 bitwise, and at EP=4, at DP=2 x EP=2 and on one
process with the loss continuing where it was; the experts are keyed by global index, so
DCP's own tools read the whole model from it.

    straight  EP=2, 6 steps, no checkpoint
    prefix    EP=2, 3 steps, checkpoint at step 3
    resumed   the prefix's checkpoint, steps 4-6, in each layout

The first step after a resume runs the straight run's weights on rank 0's data shard
(shard 0: the same draws in every layout), so its loss is the straight run's step 4 loss
up to float rounding (the experts' rows are grouped by other ranks' tokens: another GEMM
shape, 1e-5 relative); the later steps train on another number of shards, so they
continue (below step 1's loss, within 5% of the straight run's) rather than repeat.

    .venv/bin/python -m pytest tests/train/test_train_checkpoint_reshard.py
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(900)]
TINY = ["train", "--preset", "tiny", "--num-experts", "8", "--batch-size", "2",
        "--threads", "1", "--eval-every", "100", "--eval-batches", "1"]
EP2 = ["--nproc", "2"]
LAYOUTS = {"ep2": EP2, "ep4": ["--nproc", "4"], "dp2 x ep2": ["--nproc", "4", "--ep", "2"],
           "one process": ["--nproc", "1"]}


def spikeguard(*argv, cwd) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "spikeguard", *map(str, argv)], cwd=cwd,
                          capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def _losses(path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, path.read_text().splitlines())}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("reshard")
    spikeguard(*TINY, *EP2, "--steps", "6", "--log", "straight.jsonl", cwd=d)
    spikeguard(*TINY, *EP2, "--steps", "3", "--checkpoint-dir", "ck", "--checkpoint-every", "3",
               "--log", "prefix.jsonl", cwd=d)
    for name, layout in LAYOUTS.items():
        shutil.copytree(d / "ck", d / name)
        spikeguard(*TINY, *layout, "--steps", "6", "--checkpoint-dir", name, "--resume",
                   "--log", f"{name}.jsonl", cwd=d)
    return d


def test_a_resume_in_the_same_layout_is_bitwise(runs):
    straight = _losses(runs / "straight.jsonl")
    assert {**_losses(runs / "prefix.jsonl"), **_losses(runs / "ep2.jsonl")} == straight


@pytest.mark.parametrize("layout", [n for n in LAYOUTS if n != "ep2"])
def test_a_resume_in_another_layout_continues_the_loss(runs, layout):
    straight = _losses(runs / "straight.jsonl")
    resumed = _losses(runs / f"{layout}.jsonl")
    assert sorted(resumed) == [4, 5, 6]
    assert resumed[4] == pytest.approx(straight[4], rel=1e-5)
    for step in (5, 6):
        assert resumed[step] < straight[1]
        assert resumed[step] == pytest.approx(straight[step], rel=0.05)


def test_the_checkpoint_holds_every_expert_by_global_index(runs, tmp_path):
    """DCP's own converter reads the EP=2 checkpoint whole: each layer's 8 experts once,
    under the keys a one-process run's checkpoint has too."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    manifest = json.loads((runs / "ck" / "manifest.json").read_text())
    dcp_to_torch_save(runs / "ck" / manifest["folder"], tmp_path / "whole.pt")
    whole = torch.load(tmp_path / "whole.pt", weights_only=True)
    experts = sorted(k for k in whole if k.startswith("model.") and ".expert" in k)
    assert experts == sorted(f"model.blocks.{layer}.moe.experts.{w}.expert{g}"
                             for layer in range(2) for w in ("w13_ED2F", "w2_EFD")
                             for g in range(8))
    assert whole["step"].item() == 3
    assert {k for k in whole if k.startswith("data.shard")} == {"data.shard0", "data.shard1"}
    one = json.loads((runs / "one process" / "manifest.json").read_text())
    dcp_to_torch_save(runs / "one process" / one["folder"], tmp_path / "one.pt")
    again = torch.load(tmp_path / "one.pt", weights_only=True)
    assert sorted(k for k in again if k.startswith("model.")) == \
        sorted(k for k in whole if k.startswith("model."))
