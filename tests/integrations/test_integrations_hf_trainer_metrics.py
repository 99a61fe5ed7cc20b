"""The guard's per-step figures in transformers' real `Trainer` logs: with `guard_trainer`,
every training log (logging_steps=1) carries spikeguard's scalars (the tags
`train --tensorboard` writes), each the largest over the guard steps since the previous
log; `state.log_history` holds them, and a `report_to` sink (the Trainer's own
TensorBoardCallback here) writes them, read back from its event files. The tiny
Qwen3-MoE of tests/integrations/test_integrations_hf_trainer.py, 3 optimizer steps of 2
micro-batches each (6 guard steps, 3 logs).

    .venv/bin/python -m pytest tests/integrations/test_integrations_hf_trainer_metrics.py -q
"""

from __future__ import annotations

import struct

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("tensorboard")

from spikeguard.integrations.hf_trainer import guard_trainer  # noqa: E402

from hf_helpers import tiny_qwen3_moe  # noqa: E402
from spikeguard.runtime.scalars import step_scalars  # noqa: E402

pytestmark = [pytest.mark.timeout(240), pytest.mark.filterwarnings("ignore")]


def _model():
    return tiny_qwen3_moe()


def _expected(history: list[dict], per_log: int) -> list[dict[str, float]]:
    """Per log, each tag's largest value over its `per_log` guard steps."""
    out = []
    for first in range(0, len(history), per_log):
        window: dict[str, float] = {}
        for record in history[first:first + per_log]:
            for tag, value in step_scalars(record).items():
                window[tag] = max(window.get(tag, value), value)
        out.append(window)
    return out


def _as_float32(value: float) -> float:
    return struct.unpack("f", struct.pack("f", value))[0]


def test_the_trainers_logs_and_report_to_sinks_get_the_guards_scalars(tmp_path, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb"))
    gen = torch.Generator().manual_seed(0)
    data = [{"input_ids": w, "labels": w} for w in torch.randint(0, 256, (12, 33), generator=gen)]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=3, per_device_train_batch_size=2,
        gradient_accumulation_steps=2, learning_rate=1e-3, report_to="tensorboard",
        save_strategy="no", logging_strategy="steps", logging_steps=1, use_cpu=True, seed=0,
        disable_tqdm=True)
    trainer = transformers.Trainer(model=_model(), args=args, train_dataset=data)
    guard_trainer(trainer, budget="1GiB", policy="adaptive")
    trainer.train()

    history = trainer.spikeguard.history
    assert len(history) == 6   # one guard step per micro-batch
    expected = _expected(history, per_log=2)
    logged = [e for e in trainer.state.log_history if "loss" in e]
    assert [e["step"] for e in logged] == [1, 2, 3]
    for entry, want in zip(logged, expected):
        assert {tag: entry[tag] for tag in want} == want
    tags = set(expected[0])
    assert {"memory/peak_bytes", "memory/budget_bytes", "guard/decisions_save",
            "guard/safety_net_reruns"} <= tags
    assert all(want["memory/peak_bytes"] > 0 for want in expected)

    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    for tag in tags:   # the Trainer's TensorBoardCallback prefixes training logs: train/
        events = [(e.step, e.value) for e in acc.Scalars(f"train/{tag}")]
        assert events == [(step, _as_float32(want[tag]))
                          for step, want in zip((1, 2, 3), expected)], tag
    assert "train/loss" in acc.Tags()["scalars"]   # the Trainer's own figures still there
