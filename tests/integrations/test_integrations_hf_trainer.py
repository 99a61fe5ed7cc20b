"""transformers' real `Trainer` under the guard, with the one line docs/hf.md gives
(`guard_trainer(trainer, ...)`): a tiny Qwen3-MoE built from its config, 3 optimizer
steps, one process. The guarded runs end with parameters `torch.equal` to the unguarded
Trainer's; adaptive, at a budget between full recompute's peak and the all-saved peak,
stays under it where `none` dies in one line; gradient accumulation gives one guard
record per micro-batch; from their second step (none) and third (adaptive) the forwards
run calm, as the plain model's (runtime/calm_forward.py); the guard is gone when
training ends. Peaks are read by a
callback at each step's end from the device's own peak counter (the emulated allocator's,
the optimizer step included), not from the guard's history.

    .venv/bin/python -m pytest tests/integrations/test_integrations_hf_trainer.py -q
"""

from __future__ import annotations

import ast
import dataclasses
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

import spikeguard  # noqa: E402
from spikeguard.integrations.hf_trainer import guard_trainer  # noqa: E402

from hf_helpers import tiny_qwen3_moe  # noqa: E402

pytestmark = [pytest.mark.timeout(240), pytest.mark.filterwarnings("ignore")]

HUGE = "1GiB"


def _model(**config):
    return tiny_qwen3_moe(**config)


class _DevicePeaks(transformers.TrainerCallback):
    """After the guard's callback: the device's own peak counter at each step's end."""

    def __init__(self, trainer):
        self.trainer, self.peaks = trainer, []

    def on_step_end(self, args, state, control, **kwargs):
        guard = getattr(self.trainer, "spikeguard", None)
        if guard is not None:
            self.peaks.append(guard.meter.peak())


def _train(tmp_path, accumulation: int = 1, after=None, config=None, **guard):
    """(model, trainer) after 3 optimizer steps of 4 sequences of 33 bytes; the device's
    peaks per step are `trainer.device_peaks`; `config`: more of the model's settings."""
    gen = torch.Generator().manual_seed(0)
    data = [{"input_ids": w, "labels": w} for w in torch.randint(0, 256, (12, 33), generator=gen)]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=4 // accumulation,
        gradient_accumulation_steps=accumulation, learning_rate=1e-3, report_to="none",
        save_strategy="no", logging_strategy="no", use_cpu=True, seed=0, disable_tqdm=True)
    model = _model(**(config or {}))
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
    if guard:
        guard_trainer(trainer, **guard)   # the one line a user adds
    if after is not None:
        trainer.add_callback(after(trainer))
    peaks = _DevicePeaks(trainer)
    trainer.add_callback(peaks)
    trainer.train()
    trainer.device_peaks = peaks.peaks
    return model, trainer


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The unguarded Trainer's parameters, and the peaks of `none` and `full`."""
    tmp = tmp_path_factory.mktemp("trainer")
    plain, _ = _train(tmp)
    out = {"plain": [p.detach().clone() for p in plain.parameters()]}
    for policy in ("none", "full"):
        model, trainer = _train(tmp, budget=HUGE, policy=policy)
        out[policy] = trainer.spikeguard.history
        out[policy + "_peak"] = max(trainer.device_peaks)
        assert _equal(out["plain"], model), policy
    return out


def _equal(reference, model) -> bool:
    return all(torch.equal(a, b) for a, b in zip(reference, model.parameters()))


def test_three_steps_bitwise_and_the_guard_is_gone_after(runs, tmp_path):
    assert [len(runs[p]) for p in ("none", "full")] == [3, 3]
    assert runs["full_peak"] < runs["none_peak"]
    model, trainer = _train(tmp_path, budget=HUGE, policy="adaptive")
    assert _equal(runs["plain"], model)
    # calm forwards (runtime/calm_forward.py) run inside the Trainer's own steps: none's
    # after its first forward of these shapes, adaptive's once a hooked forward kept
    # everything and its step ended, from a start no higher than that step's room under
    # the budget allows: the optimizer's state, which arrives in step 1's update, fits a
    # huge budget's room (compared to the byte, step 1 ran hooked: [0, 0, 1])
    calm = {p: [r["calm_forwards"] for r in h]
            for p, h in (("none", runs["none"]), ("adaptive", trainer.spikeguard.history))}
    assert calm == {"none": [0, 1, 1], "adaptive": [0, 1, 1]}, calm
    assert [r["calm_forwards"] for r in runs["full"]] == [0, 0, 0]
    assert not trainer.spikeguard.attached                 # detached at on_train_end
    assert "forward" not in vars(model)


@pytest.mark.slow
def test_adaptive_under_a_budget_where_none_dies(runs, tmp_path):
    full, kept = runs["full_peak"], runs["none_peak"]
    budget = full + (kept - full) // 2
    model, trainer = _train(tmp_path, budget=budget, policy="adaptive")
    history = trainer.spikeguard.history
    assert len(trainer.device_peaks) == 3 and all(p <= budget for p in trainer.device_peaks)
    assert all(not r["safety_net"] for r in history)
    assert any(r["decisions"]["recompute"] + r["decisions"]["offload"] for r in history)
    assert _equal(runs["plain"], model)
    with pytest.raises(spikeguard.DeviceOutOfMemory) as info:
        _train(tmp_path, budget=budget, policy="none")
    assert "\n" not in str(info.value)


class _Blind(transformers.TrainerCallback):
    """After the guard's callback: a forecast blind to what is still to come, so the plan
    keeps what the backward then has no room for (tests/runtime/test_runtime_safety_net)."""

    def __init__(self, trainer):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        guard = self.trainer.spikeguard
        guard.forecast.still_to_come = lambda *a, **k: 0
        guard.forecast.head_bytes_per_token = 0.0
        guard.forecast.observe = lambda *a, **k: None
        guard.layer_room.room = dataclasses.replace(
            guard.layer_room.room, expert_grad_bytes=0, expert_grad_sum_bytes=0)


@pytest.mark.slow
def test_the_step_level_net_re_runs_a_training_step_that_ran_out(runs, tmp_path, caplog):
    # Near the all-saved peak the blinded plan keeps everything, and the output head's
    # backward runs out: only a net around the whole training_step can re-run that.
    full, kept = runs["full_peak"], runs["none_peak"]
    budget = full + 9 * (kept - full) // 10
    snaps = tmp_path / "snaps"
    with caplog.at_level(logging.WARNING, logger="spikeguard"):
        model, trainer = _train(tmp_path, budget=budget, policy="adaptive", after=_Blind,
                                memory_snapshot=str(snaps))
    history = trainer.spikeguard.history
    reruns = [r for record in history for r in record["safety_net"]]
    assert reruns and all(r["scope"] == "step" and r["reason"].startswith("backward")
                          for r in reruns), history
    # guard_trainer's memory_snapshot: one snapshot per refusal, each a re-run here.
    assert len(list(snaps.iterdir())) == len(reruns)
    assert all(p <= budget for p in trainer.device_peaks)
    assert any("full recompute" in r.getMessage() for r in caplog.records)
    assert _equal(runs["plain"], model)


@pytest.mark.slow
def test_accumulation_re_runs_by_replay_and_copies_no_gradient(tmp_path, monkeypatch):
    """A window's second micro-step opens with the first's gradients: its re-run replays
    the first from none instead of copying every gradient to host at each micro-step,
    from the random state it began with (attention dropout: without it the sums differ)."""
    config = {"attention_dropout": 0.3}
    from spikeguard.runtime import device_state
    copied, copy = [], device_state._host_copy
    monkeypatch.setattr(device_state, "_host_copy",
                        lambda t: copied.append(t.numel()) or copy(t))   # no reference kept
    plain, _ = _train(tmp_path, accumulation=2, config=config)
    reference = [p.detach().clone() for p in plain.parameters()]
    peaks = {}
    for policy in ("none", "full"):
        _, trainer = _train(tmp_path, accumulation=2, config=config, budget=HUGE,
                            policy=policy)
        peaks[policy] = max(trainer.device_peaks)
    budget = peaks["full"] + 9 * (peaks["none"] - peaks["full"]) // 10
    model, trainer = _train(tmp_path, accumulation=2, config=config, budget=budget,
                            policy="adaptive", after=_Blind)
    history = trainer.spikeguard.history
    assert len(history) == 6
    # the backward ran out in some window's second micro-step, and the step re-ran
    assert any(r["safety_net"] for r in history[1::2]), history
    assert all(r["scope"] == "step" for record in history for r in record["safety_net"])
    assert copied == []
    assert all(p <= budget for p in trainer.device_peaks)
    assert _equal(reference, model)


def test_gradient_accumulation_is_one_record_per_micro_batch(runs, tmp_path):
    model, trainer = _train(tmp_path, accumulation=2, budget=HUGE, policy="adaptive")
    assert len(trainer.spikeguard.history) == 6


def test_the_trainers_gradient_checkpointing_is_refused(tmp_path):
    trainer = transformers.Trainer(model=_model(), args=transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=1, report_to="none", use_cpu=True,
        gradient_checkpointing=True, disable_tqdm=True), train_dataset=[])
    guard_trainer(trainer, budget=HUGE)
    with pytest.raises(spikeguard.UsageError, match="gradient_checkpointing=False"):
        trainer.callback_handler.on_train_begin(trainer.args, trainer.state, trainer.control)


@pytest.mark.multiprocess
def test_the_docs_example_runs_as_written_under_its_budget(tmp_path):
    page = (Path(__file__).resolve().parents[2] / "docs" / "hf.md").read_text(encoding="utf-8")
    example = [b for b in re.findall(r"```python\n(.*?)```", page, re.S)
               if "guard_trainer" in b][0]   # the one-process example (the first)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", example], capture_output=True, text=True,
                          timeout=200, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    records = ast.literal_eval(done.stdout.strip().splitlines()[-1])
    assert len(records) == 3 and all(peak <= int(2.1 * 2**20) for peak, _ in records)
    assert str(records) in " ".join(page.split())   # the page quotes what it prints
