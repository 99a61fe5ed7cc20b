"""PyTorch's own checkpoint and save_on_cpu as rows of runtime_ratios
(spikeguard/bench/native_rows.py): they compute what the plain model computes (gradients
bitwise equal), the device counts them (save_on_cpu's copies leave it), a step past the
budget ran out, and both rows are in the table with their spread and peak.

    .venv/bin/python -m pytest tests/bench/test_bench_native.py -q
"""

from __future__ import annotations

import pytest
import torch

from spikeguard.bench import runtime_ratios
from spikeguard.bench.native_rows import NATIVE, NativeRun, ran_out
from spikeguard.data.corpus import load_corpus
from spikeguard.model import build_model, model_config

pytestmark = pytest.mark.timeout(300)


def _batches(cfg, n=2):
    gen = torch.Generator().manual_seed(0)
    return [load_corpus(None).get_batch("train", 4, cfg.seq_len, gen) for _ in range(n)]


def _grads(model) -> dict:
    return {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("name", NATIVE)
def test_a_native_rows_gradients_equal_the_plain_models(name):
    cfg = model_config("tiny")
    batches = _batches(cfg)
    plain = build_model(cfg, seed=0)
    runtime_ratios.plain_step(plain, batches)
    run = NativeRun(name, build_model(cfg, seed=0), budget_bytes=1 << 40)
    try:
        for _ in range(2):   # a second step too: nothing left over from the first
            run.run_step(lambda: runtime_ratios.plain_step(run.model, batches))
        mine = {n.replace("block.", "").replace("model.", ""): g
                for n, g in _grads(run.model).items()}
    finally:
        run.close()
    want = _grads(plain)
    assert mine.keys() == want.keys()
    assert all(torch.equal(mine[k], want[k]) for k in want), name


def test_the_device_counts_a_native_row_and_save_on_cpu_moves_its_copies_to_host():
    """The plain model's step on the same kind of device is the reference: checkpoint
    keeps less, save_on_cpu keeps less and says how much it moved (all of it back)."""
    cfg = model_config("tiny")
    batches = _batches(cfg)
    peaks, moved = {}, {}
    for name in NATIVE:
        run = NativeRun(name, build_model(cfg, seed=0), budget_bytes=1 << 40)
        try:
            run.run_step(lambda: runtime_ratios.plain_step(run.model, batches))
            peaks[name], moved[name] = run.history[-1]["peak_bytes"], run.history[-1]
        finally:
            run.close()
    plain = runtime_ratios.spikeguard.attach(build_model(cfg, seed=0), budget=1 << 40,
                                             policy="none")
    plain.run_step(lambda: runtime_ratios.plain_step(plain.model, batches))
    ceiling = plain.history[-1]["peak_bytes"]
    plain.detach()
    assert 0 < peaks["checkpoint"] < 0.8 * ceiling
    assert 0 < peaks["save_on_cpu"] < 0.8 * ceiling
    assert moved["save_on_cpu"]["evicted_bytes"] > 0
    assert moved["save_on_cpu"]["prefetched_bytes"] == moved["save_on_cpu"]["evicted_bytes"]
    assert moved["checkpoint"]["evicted_bytes"] == 0


def test_a_native_step_past_the_budget_ran_out():
    cfg = model_config("tiny")
    batches = _batches(cfg, 1)
    run = NativeRun("checkpoint", build_model(cfg, seed=0), budget_bytes=256 << 10)
    try:
        for _ in range(2):
            run.run_step(lambda: runtime_ratios.plain_step(run.model, batches))
        row = {**runtime_ratios.memory_row(run, 0), "native": True}
    finally:
        run.close()
    assert row["peak_bytes"] > 256 << 10 and row["overruns"] == 1
    assert ran_out(row)
    assert not ran_out({**row, "native": False})   # a guarded row has its safety net


def test_the_native_rows_are_in_the_table_with_their_spread_and_peak(capsys):
    assert runtime_ratios.main(["--preset", "tiny", "--reps", "2", "--batch-size", "4"]) == 0
    out = capsys.readouterr().out
    rows = {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:-1]]
            for line in out.splitlines() if line.startswith("│")}
    assert set(rows) == {"ceiling", "full", "adaptive", *NATIVE}
    for name in NATIVE:
        tokens, ratio, quartiles, needed, peak, overruns = rows[name][:6]
        assert float(tokens) > 0
        assert ratio == "ran out" or 0 < float(ratio) < 5
        low, high = (float(q) for q in quartiles.split("-"))
        assert low <= high
        assert needed.startswith("~")
        assert peak.endswith("MiB") or peak.endswith("KiB")
    assert rows["save_on_cpu"][-1] != "0"   # its bytes moved to host are shown
