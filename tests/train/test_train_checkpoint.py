"""Checkpoints and dropped steps: a resumed run continues bitwise where the saved one was,
a save is atomic, a skipped step draws its data but trains nothing; the train command's
trace and checkpoint flags refuse bad input before any work.

    .venv/bin/python -m pytest tests/train/test_train_checkpoint.py -q
"""

from __future__ import annotations

import json

import pytest
import torch

from spikeguard import cli
from spikeguard.errors import UsageError
from spikeguard.train.checkpoint import Checkpointer

pytestmark = pytest.mark.timeout(120)
TINY = ["train", "--preset", "tiny", "--batch-size", "4", "--threads", "1", "--eval-every", "100"]


def _losses(path):
    return [json.loads(line).get("loss") for line in open(path)]


def test_resume_continues_bitwise(tmp_path, capsys):
    assert cli.main(TINY + ["--steps", "4", "--log", str(tmp_path / "full.jsonl")]) == 0
    ck = str(tmp_path / "ck")
    assert cli.main(TINY + ["--steps", "2", "--checkpoint-dir", ck, "--checkpoint-every", "2",
                            "--log", str(tmp_path / "a.jsonl")]) == 0
    assert cli.main(TINY + ["--steps", "4", "--checkpoint-dir", ck, "--resume",
                            "--log", str(tmp_path / "b.jsonl")]) == 0
    resumed = _losses(tmp_path / "a.jsonl") + _losses(tmp_path / "b.jsonl")
    assert resumed == _losses(tmp_path / "full.jsonl")
    assert [json.loads(l)["step"] for l in open(tmp_path / "b.jsonl")] == [3, 4]
    assert not [p for p in (tmp_path / "ck").rglob("*") if "tmp" in p.name]   # renamed


def test_skipped_steps_keep_later_data_aligned(tmp_path):
    assert cli.main(TINY + ["--steps", "3", "--log", str(tmp_path / "all.jsonl")]) == 0
    assert cli.main(TINY + ["--steps", "3", "--skip-steps", "2",
                            "--log", str(tmp_path / "skip.jsonl")]) == 0
    records = [json.loads(line) for line in open(tmp_path / "skip.jsonl")]
    assert records[1] == {"step": 2, "skipped": True, "tokens": 0, "step_time_s": 0.0}
    full = _losses(tmp_path / "all.jsonl")
    assert records[0]["loss"] == full[0]
    assert records[2]["loss"] != full[2]   # step 2's update is missing, step 3's data is not


def test_save_interval_and_last(tmp_path):
    from spikeguard.model import build_model, model_config

    model = build_model(model_config("tiny"), seed=0)
    opt = torch.optim.AdamW(model.parameters())
    gen = torch.Generator().manual_seed(0)
    ck = Checkpointer(tmp_path, every=3)
    assert [ck.after_step(s, [(model, opt)], gen, last=s == 4) for s in range(1, 5)] == \
        [False, False, True, True]
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert (manifest["step"], manifest["folder"]) == (4, "step-4")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["manifest.json", "step-4"]
    assert sorted(p.name for p in (tmp_path / "step-4").iterdir()) == [".metadata", "__0_0.distcp"]
    assert Checkpointer(tmp_path, every=3, resume=False).restore([(model, opt)], gen) == 0
    assert Checkpointer(tmp_path, every=3, resume=True).restore([(model, opt)], gen) == 4
    other = build_model(model_config("tiny", d_model=64), seed=0)
    with pytest.raises(UsageError, match="does not fit this run"):
        Checkpointer(tmp_path, every=3, resume=True).restore(
            [(other, torch.optim.AdamW(other.parameters()))], gen)


@pytest.mark.parametrize("extra, match", [
    (["--skip-steps", "2,x"], "comma-separated"),
    (["--skip-steps", "0"], "from 1"),
    (["--checkpoint-every", "0"], "positive"),
    (["--resume"], "needs --checkpoint-dir"),
    (["--resume", "--checkpoint-dir", "{tmp}/none"], "does not exist"),
    (["--checkpoint-dir", "{tmp}/afile"], "is a file"),
    (["--record-trace", "{tmp}/nowhere/t.jsonl"], "existing folder"),
    (["--trace", "{tmp}/missing.jsonl"], "does not exist"),
    (["--trace", "{tmp}/t.jsonl", "--num-layers", "3"], "num_layers is 2 but this run has 3"),
    (["--trace", "{tmp}/t.jsonl", "--steps", "9"], "holds 2 steps"),
    (["--trace", "{tmp}/t.jsonl", "--record-trace", "{tmp}/t.jsonl"], "overwrite"),
])
def test_bad_run_flags_exit_2_and_keep_files(tmp_path, capsys, extra, match):
    (tmp_path / "afile").write_text("x")
    assert cli.main(TINY + ["--steps", "2", "--record-trace", str(tmp_path / "t.jsonl")]) == 0
    before = (tmp_path / "t.jsonl").read_text()
    capsys.readouterr()
    argv = TINY + ["--steps", "2"] + [a.replace("{tmp}", str(tmp_path)) for a in extra]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and match in err[0], err
    assert (tmp_path / "t.jsonl").read_text() == before


def test_a_save_over_the_format_before_dcp_leaves_only_its_own(tmp_path):
    """--overwrite of a version-1 checkpoint (per-rank rank{r}.pt files and their manifest):
    the new manifest and its DCP folder replace it, nothing of the old format is left."""
    from spikeguard.model import build_model, model_config

    for name in ("rank0.pt", "rank1.pt", "rank1.pt.next"):
        (tmp_path / name).write_bytes(b"old")
    (tmp_path / "manifest.json").write_text(json.dumps({"format": "spikeguard-checkpoint",
                                                        "version": 1}))
    model = build_model(model_config("tiny"), seed=0)
    opt = torch.optim.AdamW(model.parameters())
    Checkpointer(tmp_path, every=1).after_step(1, [(model, opt)], torch.Generator(), last=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["manifest.json", "step-1"]
