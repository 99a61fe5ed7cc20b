"""A step's record (what `spikeguard train` logs and `spikeguard bench` reads) counts the
whole step on the device: the guard's own record closes before the optimizer step, and
AdamW's step (its state, the gradients and its foreach temporaries) can be the step's
peak when the activations are small.

    .venv/bin/python -m pytest tests/train/test_train_step_peak.py -q
"""

from __future__ import annotations

import io

import pytest
import torch
from rich.console import Console

import spikeguard
from spikeguard.data import load_corpus
from spikeguard.memory.device import EmulatedDevice
from spikeguard.model import build_model, model_config
from spikeguard.runtime.device_state import move_state_to_device
from spikeguard.train import TrainConfig, train
from spikeguard.train.train_config import make_optimizer

pytestmark = pytest.mark.timeout(300)

# One short sequence a step, every layer recomputed: activations far below the parameters,
# AdamW's step the peak.
CFG = dict(steps=2, batch_size=1, eval_every=100, eval_batches=1, seed=0)


def _adamw_step_peak(cfg, train_cfg, corpus) -> int:
    """AdamW's second step alone on a device of its own, measured apart from any guard:
    the model, its gradients and the optimizer's state resident, the step's peak."""
    model = build_model(cfg, seed=0)
    opt = make_optimizer(model, train_cfg)
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):
        idx_BT, targets_BT = corpus.get_batch("train", 1, cfg.seq_len, gen)
        model(idx_BT, targets_BT).loss.backward()
        if not opt.state:
            opt.step()   # the state, as the second step finds it
    device = EmulatedDevice(1 << 40)
    try:
        move_state_to_device(model, [opt], device)
        with device.active():
            device.reset_peak()
            opt.step()
            return device.peak()
    finally:
        device.close()


def test_the_steps_record_includes_the_optimizer_steps_peak():
    corpus = load_corpus(max_bytes=2**20)
    cfg = model_config("tiny")
    train_cfg = TrainConfig(**CFG)
    guards = []

    def attach(model, optimizer):
        guards.append(spikeguard.attach(model, budget=1 << 40, policy="full",
                                        optimizer=optimizer))
        return guards[-1]
    records = train(build_model(cfg, seed=0), cfg, train_cfg, corpus, guard_factory=attach,
                    console=Console(file=io.StringIO()))
    adamw = _adamw_step_peak(cfg, train_cfg, corpus)
    backward = guards[0].history[-1]["peak_bytes"]   # the guard's: forward and backward
    assert backward < adamw, "this case's peak is the optimizer step's"
    assert records[-1]["peak_bytes"] >= adamw
    assert records[-1]["step_time_s"] > 0
