"""Memory snapshots (spikeguard/memory/snapshot.py): one file per out-of-memory, written at
the refusal, re-run or fatal; on CPU the emulated device's figures as JSON, checked
against the device's own rule (what was in use plus what was asked passes the budget);
on CUDA the allocator's history, its calls stubbed here at their boundary (the real
thing runs in scripts/gpu_check.py's snapshot check on a GPU).

    .venv/bin/python -m pytest tests/memory/test_memory_snapshot.py -q
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch

import spikeguard
from spikeguard.errors import UsageError
from spikeguard.memory import snapshot as snapshot_module
from spikeguard.memory.snapshot import MAX_ENTRIES, MemorySnapshots
from spikeguard.model import build_model, model_config
from spikeguard.plan.catalogue import ALL_SAVE

pytestmark = pytest.mark.timeout(120)

CFG = model_config("tiny")


def _data(sizes, seed: int) -> list:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, CFG.vocab_size, (b, CFG.seq_len + 1), generator=gen) for b in sizes]


DATA = _data((4, 8), seed=5)


def _step_fn(model):
    def fn():
        for tokens in DATA:
            model(tokens[:, :-1], tokens[:, 1:]).loss.backward()
    return fn


def _peaks() -> tuple[int, int]:
    """(full recompute's peak, everything kept's peak) of one step of DATA."""
    peaks = []
    for policy in ("full", "none"):
        model = build_model(CFG, seed=0)
        guard = spikeguard.attach(model, budget=1 << 40, policy=policy)
        guard.run_step(_step_fn(model))
        peaks.append(guard.history[-1]["peak_bytes"])
        guard.detach()
    return peaks[0], peaks[1]


def _blind(guard) -> None:
    """Every layer saves everything and none falls back whole: only the net is left."""
    guard.decide = lambda layer, num_routed: guard.planner.fixed(ALL_SAVE, num_routed)
    guard.window.layer_cannot_fit = lambda layer: False


def _records(folder: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))]


def _check_against_the_device(record: dict) -> None:
    """The emulated device's rule at a refusal, and the attribution's own sums."""
    assert record["device"] == "cpu (emulated)" and record["rank"] == 0
    at_refusal = record["in_use_at_refusal_bytes"]
    assert at_refusal <= record["budget_bytes"] < record["refused_would_be_bytes"]
    assert at_refusal + record["refused_request_bytes"] == record["refused_would_be_bytes"]
    # The device's peak reached what was in use at the refusal, and nothing was allocated
    # between the refusal and the snapshot (the failing op only let its temporaries go).
    assert record["peak_bytes"] >= at_refusal >= record["allocated_bytes"]
    assert sum(p["bytes"] for p in record["attributed"]) == record["attributed_bytes"]
    assert 0 < record["attributed_bytes"] <= record["allocated_bytes"]
    assert record["unattributed_bytes"] == record["allocated_bytes"] - record["attributed_bytes"]


def test_each_rerun_leaves_one_snapshot_at_the_refusal(tmp_path):
    full, kept = _peaks()
    budget = (full + kept) // 2
    reference = build_model(CFG, seed=0)
    _step_fn(reference)()
    model = build_model(CFG, seed=0)
    folder = tmp_path / "snaps"
    guard = spikeguard.attach(model, budget=budget, policy="adaptive", memory_snapshot=folder)
    _blind(guard)
    guard.run_step(_step_fn(model))
    record = guard.history[-1]
    assert record["safety_net_reruns"] >= 1
    records = _records(folder)
    # One file per refusal: each re-run followed exactly one.
    assert len(records) == record["safety_net_reruns"]
    for rec in records:
        _check_against_the_device(rec)
        assert rec["step"] == 0 and rec["budget_bytes"] == budget
    # The places the ledger attributes are the layers and operators of the model.
    ops = {p["op"] for rec in records for p in rec["attributed"]}
    assert {"attn", "gate_up"} <= ops
    # Writing the snapshot changed nothing of the step: gradients bitwise the plain model's.
    assert all(torch.equal(a.grad, b.grad)
               for a, b in zip(reference.parameters(), model.parameters()))
    guard.detach()


def test_a_fatal_out_of_memory_names_its_snapshot(tmp_path):
    model = build_model(CFG, seed=0)
    guard = spikeguard.attach(model, budget="1MiB", policy="none", memory_snapshot=tmp_path)
    with pytest.raises(spikeguard.DeviceOutOfMemory) as caught:
        guard.run_step(_step_fn(model))
    files = sorted(tmp_path.iterdir())
    assert [f.name for f in files] == ["step000000-rank0-oom.json"]
    assert caught.value.memory_snapshot == str(files[0])
    rec = _records(tmp_path)[0]
    assert rec["error"] == str(caught.value)
    _check_against_the_device(rec)
    guard.detach()


def test_an_existing_file_is_never_replaced(tmp_path):
    (tmp_path / "step000000-rank0-oom.json").write_text("mine")
    model = build_model(CFG, seed=0)
    guard = spikeguard.attach(model, budget="1MiB", policy="none", memory_snapshot=tmp_path)
    with pytest.raises(spikeguard.DeviceOutOfMemory):
        guard.run_step(_step_fn(model))
    assert (tmp_path / "step000000-rank0-oom.json").read_text() == "mine"
    assert json.loads((tmp_path / "step000000-rank0-oom-2.json").read_text())["step"] == 0
    guard.detach()


def test_without_the_argument_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model = build_model(CFG, seed=0)
    guard = spikeguard.attach(model, budget="1MiB", policy="none")
    with pytest.raises(spikeguard.DeviceOutOfMemory) as caught:
        guard.run_step(_step_fn(model))
    assert caught.value.memory_snapshot is None
    assert list(tmp_path.iterdir()) == []
    guard.detach()


@pytest.mark.parametrize("bad, match", [(123, "memory_snapshot must be a folder's path"),
                                        ("", "memory_snapshot must be a folder's path")])
def test_a_bad_argument_is_one_line(bad, match):
    with pytest.raises(UsageError, match=match):
        spikeguard.attach(build_model(CFG, seed=0), budget="1MiB", memory_snapshot=bad)


def test_a_folder_under_a_file_is_refused(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(UsageError, match="cannot be a folder: .* is a file"):
        spikeguard.attach(build_model(CFG, seed=0), budget="1MiB",
                          memory_snapshot=tmp_path / "f" / "snaps")


# ---- CUDA, its calls stubbed at the boundary -------------------------------------------
class _CudaMeter:
    is_cuda = True


def test_cuda_records_the_allocators_history_and_pickles_its_snapshot(tmp_path, monkeypatch):
    calls, state = [], {"segments": [{"total_size": 2 << 20}], "device_traces": [[
        {"action": "alloc", "size": 1 << 20, "frames": [{"filename": "x.py", "line": 1}]}]]}
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history",
                        lambda *args, **kwargs: calls.append((args, kwargs)))
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", lambda *args, **kwargs: state)
    snaps = MemorySnapshots(tmp_path, _CudaMeter(), budget_bytes=1 << 30)
    assert calls == [((), {"max_entries": MAX_ENTRIES, "stacks": "python"})]   # from attach on

    err = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB")
    oom = spikeguard.DeviceOutOfMemory("forward of micro-batch 1, layer 5, op shared: ...")
    path = snaps.taken(err, oom, step=7, attribution=lambda: pytest.fail("CPU only"))
    assert path == str(tmp_path / "step000007-rank0-oom.pickle")
    with open(path, "rb") as f:
        assert pickle.load(f) == state   # what torch.cuda.memory._dump_snapshot writes
    assert oom.memory_snapshot == err.memory_snapshot == path
    # The same refusal turned into the guard's error again: no second file.
    again = spikeguard.DeviceOutOfMemory("the same refusal")
    assert snaps.taken(err, again, step=7, attribution=dict) == path
    assert again.memory_snapshot == path and len(list(tmp_path.iterdir())) == 1

    snaps.stop()
    snaps.stop()   # detach twice is refused elsewhere; the recording stops once
    assert calls[1:] == [((), {"enabled": None})]


def test_process_rank_alone_is_zero():
    assert snapshot_module.process_rank() == 0


def test_train_memory_snapshot_writes_the_fatal_ones_file(tmp_path, capsys):
    from spikeguard import cli

    folder = tmp_path / "snaps"
    code = cli.main(["train", "--preset", "tiny", "--steps", "2", "--batch-size", "4",
                     "--budget", "1MiB", "--policy", "none", "--memory-snapshot", str(folder)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 3 and len(err) == 1 and err[0].startswith("spikeguard: out of memory"), err
    assert [p.name for p in folder.iterdir()] == ["step000000-rank0-oom.json"]
    _check_against_the_device(_records(folder)[0])
