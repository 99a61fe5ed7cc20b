"""Checkpoints are verified before a resume (issue 15, part 2; DCP, issue 25), through the
real command line: a corrupt, truncated, random, text or missing DCP file (a rank's
`__<r>_0.distcp`, DCP's `.metadata`), another model's, a pipeline layout's, an old format's
checkpoint is one stderr line naming the file and what differs, exit 2, no traceback, on
one rank and on two (`--nproc 2`: refused before torchrun starts, so no rank enters a
collective its peer does not); an empty folder needs `--resume auto`; a checkpoint at
--steps leaves nothing to train; the manifest lists every file DCP wrote with its checksum.

    .venv/bin/python -m pytest tests/train/test_train_checkpoint_verify.py -q
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(400)]
TINY = ["train", "--preset", "tiny", "--batch-size", "2", "--threads", "1",
        "--eval-every", "100", "--eval-batches", "1"]


def spikeguard(*argv, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "spikeguard", *map(str, argv)], cwd=cwd,
                          capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A 2-step checkpoint of one rank (ck1) and of two expert-parallel ranks (ck2)."""
    d = tmp_path_factory.mktemp("ck")
    for name, extra in (("ck1", []), ("ck2", ["--nproc", "2"])):
        proc = spikeguard(*TINY, "--steps", "2", "--checkpoint-dir", name,
                          "--checkpoint-every", "2", *extra, cwd=d)
        assert proc.returncode == 0, proc.stderr
    return d


def _truncate(size):
    def cut(path: Path) -> None:
        path.write_bytes(path.read_bytes()[:size])
    return cut


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


BREAK = {
    "random bytes": lambda p: p.write_bytes(os.urandom(p.stat().st_size)),
    "truncated to 20 kB": _truncate(20_000),
    "0 bytes": _truncate(0),
    "a text file": lambda p: p.write_text("101\n"),
    "one byte flipped": _flip_byte,
    "missing": lambda p: p.unlink(),
    "version 1": lambda p: p.write_text(json.dumps({**json.loads(p.read_text()), "version": 1})),
}

# (checkpoint, file broken, extra flags, what stderr must say)
RANK0, RANK1, METADATA = "step-2/__0_0.distcp", "step-2/__1_0.distcp", "step-2/.metadata"
CASES = {
    **{f"rank 0's file {how}": ("ck1", RANK0, [], how) for how in BREAK if how != "version 1"},
    **{f"--nproc 2, rank 1's file {how}": ("ck2", RANK1, ["--nproc", "2"], how)
       for how in ("random bytes", "truncated to 20 kB", "missing")},
    **{f"DCP's .metadata {how}": ("ck2", METADATA, ["--nproc", "2"], how)
       for how in ("one byte flipped", "missing")},
    "another model": ("ck1", None, ["--d-model", "64"], None),
    "another layout": ("ck2", None, ["--nproc", "2", "--pp", "2"], None),
    "the old format": ("ck1", "manifest.json", [], "version 1"),
    "manifest missing": ("ck1", "manifest.json", [], "missing"),
    "manifest is text": ("ck1", "manifest.json", [], "a text file"),
}
SAYS = {"another model": "saved by another model: d_model 32 (this run 64)",
        "another layout": "saved by another layout: ep 2 (this run 1), pp 1 (this run 2)",
        "version 1": "is version 1; this spikeguard reads version 2",
        "manifest missing": "manifest.json is missing",
        "manifest is text": "manifest.json is not a spikeguard checkpoint manifest",
        "missing": "is missing", "random bytes": "does not match its checksum",
        "truncated to 20 kB": "bytes, the manifest says", "0 bytes": "is 0 bytes",
        "a text file": "is 4 bytes", "one byte flipped": "does not match its checksum"}


@pytest.mark.parametrize("name", CASES)
def test_bad_checkpoint_is_one_line_exit_2(saved, tmp_path, name):
    source, broken, extra, how = CASES[name]
    ck = tmp_path / "ck"
    shutil.copytree(saved / source, ck)
    if broken is not None:
        BREAK[how](ck / broken)
    before = {p: p.read_bytes() for p in ck.rglob("*") if p.is_file()}
    proc = spikeguard(*TINY, "--steps", "4", "--checkpoint-dir", ck, "--resume", *extra,
                      cwd=tmp_path)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert len(err) == 1 and "Traceback" not in proc.stderr, proc.stderr
    want = SAYS.get(name) or SAYS[how]
    assert want in err[0], err[0]
    if broken is not None and broken != "manifest.json" and name not in SAYS:
        assert broken in err[0]   # the file is named
    assert {p: p.read_bytes() for p in ck.rglob("*") if p.is_file()} == before


def test_empty_folder_needs_resume_auto_and_past_steps_is_refused(saved, tmp_path):
    (tmp_path / "empty").mkdir()
    proc = spikeguard(*TINY, "--steps", "2", "--checkpoint-dir", "empty", "--resume",
                      cwd=tmp_path)
    assert proc.returncode == 2 and "--resume auto" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    proc = spikeguard(*TINY, "--steps", "2", "--checkpoint-dir", "empty", "--resume", "auto",
                      "--checkpoint-every", "2", "--log", "auto.jsonl", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert [json.loads(l)["step"] for l in open(tmp_path / "auto.jsonl")] == [1, 2]
    assert json.loads((tmp_path / "empty" / "manifest.json").read_text())["step"] == 2
    shutil.copytree(saved / "ck1", tmp_path / "ck")
    proc = spikeguard(*TINY, "--steps", "2", "--checkpoint-dir", "ck", "--resume",
                      cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert "at step 2, and --steps is 2: nothing left to train" in proc.stderr


def test_manifest_lists_every_file_with_its_checksum(saved):
    manifest = json.loads((saved / "ck2" / "manifest.json").read_text())
    assert manifest["step"] == 2 and manifest["folder"] == "step-2"
    assert manifest["layout"] == {"nproc": 2, "pp": 1, "dp": 1, "ep": 2, "schedule": "1f1b"}
    assert manifest["model"]["d_model"] == 32
    written = sorted(p for p in (saved / "ck2" / "step-2").iterdir())
    assert [p.name for p in written] == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert manifest["files"] == {
        f"step-2/{p.name}": {"bytes": p.stat().st_size,
                             "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
        for p in written}
    assert not [p for p in (saved / "ck2").rglob("*") if "tmp" in p.name]


# ---- a save that dies half-way --------------------------------------------------------
def _ckpt_state(step: int):
    import torch

    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    with torch.no_grad():
        model.weight.fill_(float(step))
    return [(model, opt)], torch.Generator().manual_seed(step)


@pytest.mark.parametrize("dies_at,resumes_at", [(2, 2), (3, 4)],
                         ids=["before the manifest", "after the manifest"])
def test_a_save_that_dies_half_way_resumes_from_a_whole_checkpoint(tmp_path, dies_at,
                                                                    resumes_at):
    """The job dies at the second barrier of step 4's save (DCP has written every file,
    no new manifest: step 2 is the checkpoint) or at the third (the manifest names the
    new folder; the old one was not removed yet: step 4). The next save removes what a
    dead one left."""
    import torch

    from spikeguard.train.checkpoint import Checkpointer

    saver = Checkpointer(tmp_path, every=2)
    saver.after_step(2, *_ckpt_state(2), last=False)
    calls = []

    def dying_barrier():
        calls.append(1)
        if len(calls) == dies_at:
            raise RuntimeError("the job died here")

    saver._barrier = dying_barrier
    with pytest.raises(RuntimeError):
        saver.after_step(4, *_ckpt_state(4), last=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["manifest.json", "step-2", "step-4"]
    parts, gen = _ckpt_state(0)
    restorer = Checkpointer(tmp_path, every=2, resume=True)
    assert restorer.restore(parts, gen) == resumes_at
    assert torch.equal(parts[0][0].weight, torch.full((4, 4), float(resumes_at)))
    restorer.after_step(6, *_ckpt_state(6), last=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["manifest.json", "step-6"]
