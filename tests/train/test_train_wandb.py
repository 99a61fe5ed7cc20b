"""W&B sink: `train --wandb [PROJECT]` with no key configured writes an offline run, whose
logged scalars, read back from its transaction log (`wandb/offline-run-*/run-*.wandb`),
equal the JSONL log's records of the same steps; a second run is a new folder beside the
first; bad input (a name W&B refuses, an unknown WANDB_MODE, a folder that cannot take
the run, a missing wandb package) is one line and exit 2 before the run starts.

    .venv/bin/python -m pytest tests/train/test_train_wandb.py -q

wandb 0.31 ships no Python reader for its transaction log (its Go core writes and reads
it), so `_records` reads it as it is written: a 7-byte header (":W&B", 0xBEE1, version 0),
then LevelDB log records (crc32 over type and data, length, type; FULL or FIRST..LAST
chunks in 32 KiB blocks), each a `wandb_internal_pb2.Record`; the checksums are verified,
so a misread fails instead of passing on garbage. wandb-core writes that log through a
buffer it flushes on its own clock: `run.finish()` can return before the file holds the
run (measured: 7 bytes, the header alone, after a 1-step run; all of it ~0.5 s later, and
always by the time the process has exited), so `_run` reads until the run's exit record.
"""

from __future__ import annotations

import json
import struct
import sys
import time
import zlib
from pathlib import Path

import pytest

from spikeguard import cli
from spikeguard.errors import UsageError
from spikeguard.train.config import RunConfig
from spikeguard.train.metrics import SCALARS, wandb_mode

from metric_records import expected_scalars
from one_line import check_one_line, unwritable

TINY = ["train", "--preset", "tiny", "--steps", "3", "--batch-size", "2", "--threads", "1"]
GUARDED = TINY + ["--budget", "1MiB", "--policy", "adaptive"]   # recomputes and offloads
BLOCK = 32768
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


@pytest.fixture
def wandb_dir(tmp_path, monkeypatch) -> Path:
    """No W&B key anywhere and every W&B folder under tmp_path: the user's own settings,
    cache and credentials neither steer nor receive anything."""
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL",
                 "WANDB_PROJECT", "WANDB_ENTITY", "WANDB_RUN_ID", "WANDB_RESUME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no.netrc"))
    for name in ("CONFIG", "CACHE", "DATA"):
        monkeypatch.setenv(f"WANDB_{name}_DIR", str(tmp_path / f"wandb-{name.lower()}"))
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wb"))
    return tmp_path / "wb"


def _records(path: Path):
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert struct.unpack_from("<4sHB", data) == (b":W&B", 0xBEE1, 0)
    pos, chunks = 7, b""
    while pos + 7 <= len(data):
        if BLOCK - pos % BLOCK < 7:   # a block's tail too short for a header: padding
            pos += BLOCK - pos % BLOCK
            continue
        crc, length, kind = struct.unpack_from("<IHB", data, pos)
        if pos + 7 + length > len(data):
            return   # the rest is not written yet
        chunk = data[pos + 7:pos + 7 + length]
        assert kind in (FULL, FIRST, MIDDLE, LAST), (path, pos, kind)
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) == crc, (path, pos)
        pos += 7 + length
        chunks += chunk
        if kind in (FULL, LAST):
            record = pb.Record()
            record.ParseFromString(chunks)
            chunks = b""
            yield record


def _finished(log: Path, timeout_s: float = 60.0) -> list:
    """The log's records once they include the run's exit (see the module docstring)."""
    deadline = time.monotonic() + timeout_s
    while True:
        records = list(_records(log))
        if any(r.WhichOneof("record_type") == "exit" for r in records):
            return records
        assert time.monotonic() < deadline, f"{log}: no exit record after {timeout_s} s"
        time.sleep(0.2)


def _run(run_dir: Path) -> tuple[str, dict[str, list[tuple[int, float]]]]:
    """The run's project, and tag -> (step, value) of everything it logged (W&B's own
    `_step`, `_runtime`, `_timestamp` left out)."""
    (log,) = run_dir.glob("run-*.wandb")
    project, history = None, {}
    for record in _finished(log):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            project = record.run.project
        elif kind == "history":
            for item in record.history.item:
                tag = "/".join(item.nested_key) or item.key
                if not tag.startswith("_"):
                    history.setdefault(tag, []).append((record.history.step.num,
                                                        json.loads(item.value_json)))
    return project, history


def _expected(records: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """Tag -> (step, value) straight from the JSONL records (W&B keeps 64-bit floats)."""
    return expected_scalars(records)


@pytest.mark.multiprocess   # wandb.init starts W&B's core service
@pytest.mark.timeout(240)
def test_an_offline_run_logs_the_log_records(wandb_dir, tmp_path, capsys):
    log = tmp_path / "run.jsonl"
    assert cli.main(GUARDED + ["--wandb", "sg-test", "--log", str(log)]) == 0
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    (run_dir,) = (wandb_dir / "wandb").glob("offline-run-*")   # offline: no key configured
    project, history = _run(run_dir)
    assert project == "sg-test"
    assert history == _expected(records)
    assert set(history) == set(SCALARS) - {"memory/max_peak_bytes"}   # one rank
    assert [s for s, _ in history["train/val_loss"]] == [3]
    # The guard worked: not a row of zeros. (Which of the two, and how many, varies with
    # the machine's load: measured both "rec 5 off 2" and "rec 7 off 0" at step 2.)
    assert any(v > 0 for kind in ("recompute", "offload")
               for _, v in history[f"guard/decisions_{kind}"])


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_a_second_run_is_a_new_folder_beside_the_first(wandb_dir, tmp_path, capsys):
    """A bare --wandb logs to project "spikeguard"; the TOML setting reaches the run too;
    the first run's files are kept byte for byte."""
    assert cli.main(TINY + ["--steps", "1", "--wandb"]) == 0
    (first,) = (wandb_dir / "wandb").glob("offline-run-*")
    assert _run(first)[0] == "spikeguard"   # and its log complete before it is copied
    kept = {p: p.read_bytes() for p in first.rglob("*") if p.is_file() and not p.is_symlink()}
    (tmp_path / "run.toml").write_text("[files]\nwandb = 'from-toml'\n")
    assert cli.main(TINY + ["--steps", "2", "--config", str(tmp_path / "run.toml")]) == 0
    assert {p: p.read_bytes() for p in kept} == kept
    runs = sorted((wandb_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 2
    (second,) = set(runs) - {first}
    assert _run(second)[0] == "from-toml"
    assert [s for s, _ in _run(first)[1]["train/loss"]] == [1]
    assert [s for s, _ in _run(second)[1]["train/loss"]] == [1, 2]


def test_the_mode_is_offline_unless_wandb_has_a_key(wandb_dir, tmp_path, monkeypatch):
    assert wandb_mode() == "offline"
    netrc = tmp_path / "no.netrc"
    netrc.write_text("machine example.com login user password secret\n")
    assert wandb_mode() == "offline"   # another host's entry
    netrc.write_text("machine api.wandb.ai login user password 0123abcd\n")
    assert wandb_mode() == "online"    # what `wandb login` writes
    monkeypatch.setenv("WANDB_BASE_URL", "https://wandb.example.org")
    assert wandb_mode() == "offline"   # a key for the cloud is not one for this server
    monkeypatch.setenv("WANDB_API_KEY", "0123abcd")
    assert wandb_mode() == "online"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert wandb_mode() == "disabled"  # the user's word wins


def _bad(tmp: Path, monkeypatch) -> dict[str, tuple[list[str], str]]:
    (tmp / "a_file").write_text("x")
    (tmp / "corpus").mkdir()
    (tmp / "corpus" / "text.txt").write_text("the quick brown fox jumps. " * 400)
    return {
        "a name W&B refuses": (["--wandb", "team/run"], "--wandb: Invalid project name "
                               "'team/run': cannot contain characters"),
        "a name too long": (["--wandb", "x" * 129], "exceeded 128 characters"),
        "an empty name": (["--wandb", " "], "--wandb needs a project name"),
        "an unknown mode": (["--wandb"], "WANDB_MODE=sometimes is not a W&B mode"),
        "WANDB_DIR a file": (["--wandb"], f"WANDB_DIR {tmp / 'a_file'} is a file"),
        "WANDB_DIR inside --data": (["--wandb", "--data", str(tmp / "corpus")],
                                    "inside the --data folder"),
    }


@pytest.mark.parametrize("case", ["a name W&B refuses", "a name too long", "an empty name",
                                  "an unknown mode", "WANDB_DIR a file",
                                  "WANDB_DIR inside --data"])
def test_bad_wandb_input_is_one_line_before_the_run(case, wandb_dir, tmp_path, capsys,
                                                    monkeypatch):
    flags, says = _bad(tmp_path, monkeypatch)[case]
    if case == "an unknown mode":
        monkeypatch.setenv("WANDB_MODE", "sometimes")
    elif case == "WANDB_DIR a file":
        monkeypatch.setenv("WANDB_DIR", str(tmp_path / "a_file"))
    elif case == "WANDB_DIR inside --data":
        monkeypatch.setenv("WANDB_DIR", str(tmp_path / "corpus" / "wb"))
    code = cli.main(TINY + flags)
    err = capsys.readouterr()
    check_one_line(code, err.err, says)
    assert "step" not in err.out   # refused before the run
    assert not wandb_dir.exists() and not (tmp_path / "corpus" / "wb").exists()


@pytest.mark.multiprocess   # unwritable(): chattr +i where chmod does not stop root
def test_an_unwritable_wandb_folder_is_one_line_before_the_run(wandb_dir, tmp_path, capsys,
                                                               monkeypatch):
    (tmp_path / "ro").mkdir()
    with unwritable(tmp_path / "ro"):
        monkeypatch.setenv("WANDB_DIR", str(tmp_path / "ro" / "wb"))
        code = cli.main(TINY + ["--wandb"])
        check_one_line(code, capsys.readouterr().err,
                       f"WANDB_DIR {tmp_path / 'ro' / 'wb'} cannot be created")
        monkeypatch.delenv("WANDB_DIR")
        monkeypatch.chdir(tmp_path / "ro")   # no WANDB_DIR: W&B writes under the current one
        code = cli.main(TINY + ["--wandb"])
        err = capsys.readouterr()
        check_one_line(code, err.err, "--wandb writes its run under the current folder")
        assert "set WANDB_DIR" in err.err and "step" not in err.out


def test_a_wandb_setting_that_is_not_a_string_is_refused():
    with pytest.raises(UsageError, match="files.wandb must be a string"):
        RunConfig.from_dict({"model": {"preset": "tiny"}, "files": {"wandb": True}})


def test_a_missing_wandb_package_is_one_line(wandb_dir, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)   # `import wandb` fails as if absent
    code = cli.main(TINY + ["--wandb"])
    err = capsys.readouterr()
    check_one_line(code, err.err, "--wandb needs wandb, which is not installed: "
                                  "pip install 'spikeguard[wandb]'")
    assert not wandb_dir.exists() and "step" not in err.out
