"""--budget auto: the one calm-peak probe (spikeguard.train.auto_budget.calm_peak_bytes)
of every family gives the device's whole count over a real second step (forward,
backward, clip and the AdamW step, its state resident), exactly, on one process; it
leaves no trace on the model or the optimizer; the budget adds the margin to the
activation part only. Under transformers' EP with FSDP2: tests/integrations/
test_integrations_hf_probe.py.

    .venv/bin/python -m pytest tests/train/test_train_auto_budget.py -q
"""

from __future__ import annotations

import pytest
import torch

import spikeguard
from spikeguard.errors import UsageError
from spikeguard.model import build_model, model_config
from spikeguard.train.auto_budget import AUTO_MARGIN, auto_budget, calm_peak_bytes
from spikeguard.train.engines import LocalEngine
from spikeguard.train.families import BuiltinFamily, HFFamily
from spikeguard.train.train_config import TrainConfig, make_optimizer

pytestmark = pytest.mark.timeout(120)
CFG = model_config("tiny")
SEQ = 32


def _builtin():
    return build_model(CFG, seed=0), BuiltinFamily, LocalEngine


def _hf():
    pytest.importorskip("transformers")
    from spikeguard.integrations.hf_models import HFSizes, build_hf_model
    sizes = HFSizes(d_model=32, num_experts=4, d_expert=32, seq_len=SEQ)
    return build_hf_model("qwen3_moe", sizes, seed=0), HFFamily, LocalEngine


def _titan():
    pytest.importorskip("torchtitan")
    from spikeguard.integrations.titan_models import TitanSizes, build_titan_model
    from spikeguard.train.titan_family import TitanEngine, TitanFamily
    return build_titan_model("deepseek_v3", TitanSizes(seq_len=SEQ), seed=0), TitanFamily, \
        TitanEngine


def _engine(build):
    model, family, kind = build()
    engine = kind(model, family, None, grad_clip=1.0)
    engine.build_optimizers(lambda m: make_optimizer(m, TrainConfig()))
    gen = torch.Generator().manual_seed(3)

    class Bytes:   # what a run draws from: its corpus (bytes), here random ones
        @staticmethod
        def get_batch(split, batch_size, seq_len, gen):
            t = torch.randint(0, 256, (batch_size, seq_len + 1), generator=gen)
            return t[:, :-1], t[:, 1:]
    batches = [family.draw(Bytes, "train", 4, SEQ, gen) for _ in range(2)]
    return engine, batches


def _real_steps(engine, batches, steps=2) -> list[int]:
    """Each real step's whole peak under a guard of policy none with no limit."""
    engine.attach_guards(lambda m, o: spikeguard.attach(m, budget="1TiB", policy="none",
                                                        optimizer=o))
    guard, peaks = engine.guards[0], []
    for _ in range(steps):
        engine.step(batches)
        peaks.append(max(guard.history[-1]["peak_bytes"], guard.meter.peak()))
    return peaks


@pytest.mark.parametrize("build", [_builtin, _hf, _titan], ids=["builtin", "hf", "titan"])
def test_probe_is_a_real_second_step_and_leaves_no_trace(build):
    engine, batches = _engine(build)
    before = [p.detach().clone() for p in engine.model.parameters()]
    peak, static = calm_peak_bytes(engine, batches)
    assert engine.guards == [] and getattr(engine.model, "_spikeguard", None) is None
    assert all(p.grad is None for p in engine.model.parameters())
    assert all(torch.equal(a, p) for a, p in zip(before, engine.model.parameters()))
    assert engine.optimizers[0].state_dict()["state"] == {}
    first, second = _real_steps(engine, batches)
    # The calm step is the second: AdamW's state is resident through it. Exact here.
    assert second > first and peak == second
    assert static == engine.guards[0].history[-1]["static_bytes"] and 0 < static < peak


def test_the_run_after_the_probe_is_the_run_without_it():
    """Bitwise: the probe's two updates and optimizer state are undone."""
    runs = []
    for probe in (False, True):
        engine, batches = _engine(_builtin)
        if probe:
            calm_peak_bytes(engine, batches)
        _real_steps(engine, batches, steps=3)
        runs.append([p.detach().clone() for p in engine.model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_margin_is_on_activations_and_rounded_to_kib():
    assert auto_budget(100 * 1024, 60 * 1024) == 104 * 1024       # 40 KiB activations, +10%
    assert auto_budget(1000, 0, margin=0.5) == 2048               # 1500 rounded up
    assert auto_budget(4096, 4096) == 4096                        # nothing but static
    assert AUTO_MARGIN == 0.10


@pytest.mark.parametrize("args, fragment", [
    ((0, 0), "calm peak"), ((-5, 0), "calm peak"), ((100, 200), "static bytes"),
    ((100, -1), "static bytes"), ((100, 10, -0.1), "margin"), ((100, 10, float("nan")), "margin"),
    ((1.5, 0), "calm peak")])
def test_bad_arguments_are_usage_errors(args, fragment):
    with pytest.raises(UsageError, match=fragment):
        auto_budget(*args)


def test_probe_needs_micro_batches():
    engine, _ = _engine(_builtin)
    with pytest.raises(UsageError, match="at least one micro-batch"):
        calm_peak_bytes(engine, [])
