"""The training loop: learning, determinism, accumulation, the guard seam, the step log.

B = sequences per micro-batch, T = sequence length.

    .venv/bin/python -m pytest tests/train -q
"""

from __future__ import annotations

import contextlib
import io
import json

import pytest
import torch
from rich.console import Console

from spikeguard.data import Corpus, load_corpus, split_bytes
from spikeguard.errors import UsageError
from spikeguard.model import build_model, model_config
from spikeguard.train import (
    TrainConfig, expert_imbalance, format_bytes, format_rate, step_line, summarize, train,
)


@pytest.fixture(scope="module")
def corpus() -> Corpus:
    return load_corpus(max_bytes=2 * 2**20)


def _quiet() -> Console:
    return Console(file=io.StringIO())


def _run(corpus, *, guard=None, guard_factory=None, log_path=None, console=None, seed=0,
         model_seed=0, **train_overrides):
    cfg = model_config("tiny")
    model = build_model(cfg, seed=model_seed)
    train_cfg = TrainConfig(**{"steps": 6, "batch_size": 4, "eval_every": 3, "eval_batches": 2,
                               "seed": seed, **train_overrides})
    return train(model, cfg, train_cfg, corpus, guard=guard, guard_factory=guard_factory,
                 log_path=log_path, console=console or _quiet())


@pytest.mark.parametrize("field,value", [
    ("steps", 0), ("batch_size", 0), ("micro_batches", -1), ("eval_every", 0),
    ("eval_batches", 0), ("lr", 0.0), ("lr", -1e-3), ("lr", float("nan")), ("grad_clip", 0.0),
    ("weight_decay", -0.1), ("seed", -1), ("steps", 2.5), ("batch_size", True),
])
def test_train_config_rejects_bad_values(field, value):
    with pytest.raises(UsageError, match=field):
        TrainConfig(**{field: value})


def test_training_tiny_lowers_validation_loss(corpus):
    records = _run(corpus, steps=40, batch_size=8, eval_every=20, eval_batches=4)
    summary = summarize(records)
    # Untrained: ~ln(256) = 5.5 nats per byte. 40 steps of tiny reach ~3.1 on Python source
    # (measured); a 1-nat margin fails for any loop that does not really learn.
    assert summary["val_loss_init"] > 5.0
    assert summary["val_loss_final"] < summary["val_loss_init"] - 1.0
    assert [r["step"] for r in records] == list(range(1, 41))
    assert [r["step"] for r in records if "val_loss" in r] == [20, 40]


def test_same_seed_gives_bitwise_equal_losses(corpus):
    first = _run(corpus, steps=8, micro_batches=2)
    second = _run(corpus, steps=8, micro_batches=2)
    keys = ("loss", "ce_loss", "aux_loss", "grad_norm", "imbalance_per_layer")
    assert [[r[k] for k in keys] for r in first] == [[r[k] for k in keys] for r in second]
    assert [r.get("val_loss") for r in first] == [r.get("val_loss") for r in second]
    other = _run(corpus, steps=8, micro_batches=2, seed=1)
    assert [r["loss"] for r in other] != [r["loss"] for r in first]


class FakeGuard:
    """Stands in for spikeguard.runtime's guard: a step() context and a history list."""

    def __init__(self, model=None):
        self._model = model
        self.inside = False
        self.steps_entered = 0
        self.forwards_inside = 0
        self.forwards_outside = 0
        self.history: list[dict] = []
        self.grads_at_exit: list[dict[str, torch.Tensor]] = []
        if model is not None:
            model.register_forward_hook(self._count_forward)

    def _count_forward(self, module, args, output):
        if self.inside:
            self.forwards_inside += 1
        else:
            self.forwards_outside += 1

    @contextlib.contextmanager
    def step(self):
        self.inside = True
        self.steps_entered += 1
        yield
        self.inside = False
        if self._model is not None:
            self.grads_at_exit.append({n: p.grad.clone()
                                       for n, p in self._model.named_parameters()})
        # The real guard counts steps from 0 and keeps a per-layer imbalance list: both
        # names clash with the loop's own keys.
        self.history.append({"step": 999, "imbalance": [9.9, 9.9], "peak_bytes": 1_908_408,
                             "budget_bytes": 2 * 2**20,
                             "decisions": {"save": 28, "recompute": 3, "offload": 1}})


def test_guard_factory_wiring(corpus):
    seen = {}

    def factory(model, optimizer):
        seen["calls"] = seen.get("calls", 0) + 1
        seen["optimizer"] = optimizer
        seen["optimizer_params"] = {id(p) for g in optimizer.param_groups for p in g["params"]}
        seen["model_params"] = {id(p) for p in model.parameters()}
        seen["guard"] = FakeGuard(model)
        return seen["guard"]

    text = io.StringIO()
    records = _run(corpus, guard_factory=factory, steps=3, micro_batches=2, eval_every=3,
                   console=Console(file=text))
    assert seen["calls"] == 1
    assert isinstance(seen["optimizer"], torch.optim.AdamW)
    assert seen["optimizer_params"] == seen["model_params"]
    # The initial validation loss is computed before the guard exists: only the final
    # evaluation (eval_batches=2) runs with it attached.
    assert seen["guard"].forwards_outside == 2
    assert len(records) == 3
    for i, record in enumerate(records, start=1):
        assert record["step"] == i                     # the loop's keys win a name clash
        assert isinstance(record["imbalance"], float)
        assert record["peak_bytes"] == 1_908_408
        assert record["decisions"] == {"save": 28, "recompute": 3, "offload": 1}
    lines = [line for line in text.getvalue().splitlines() if line.startswith("step")]
    assert len(lines) == 3
    assert "| peak 1.82 MiB / 2.00 MiB | save 28 rec 3 off 1" in lines[0]


def test_guard_wraps_forward_and_backward_of_all_micro_batches(corpus):
    cfg = model_config("tiny")
    model = build_model(cfg, seed=0)
    guard = FakeGuard(model)
    train(model, cfg, TrainConfig(steps=2, batch_size=4, micro_batches=3, eval_every=2,
                                  eval_batches=2), corpus, guard=guard, console=_quiet())
    assert guard.steps_entered == 2
    assert guard.forwards_inside == 2 * 3
    assert guard.forwards_outside == 2 * 2             # evaluation: initial and final
    # Backward ran inside the context: every gradient exists when the step context exits.
    assert all(g is not None for g in guard.grads_at_exit[0].values())


def test_guard_and_factory_together_is_an_error(corpus):
    with pytest.raises(UsageError, match="either guard or guard_factory"):
        _run(corpus, guard=FakeGuard(), guard_factory=lambda m, o: FakeGuard())


class _FixedBatches(Corpus):
    """A corpus that hands out a prepared list of training windows in order."""

    def get_batch(self, split, batch_size, seq_len, generator):
        if split != "train":
            return super().get_batch(split, batch_size, seq_len, generator)
        idx_BT, targets_BT = self.windows[self.cursor:self.cursor + batch_size].unbind(1)
        self.cursor += batch_size
        return idx_BT, targets_BT


def test_micro_batches_accumulate_the_big_batch_gradient():
    windows_B2T = torch.randint(0, 256, (8, 2, 32), generator=torch.Generator().manual_seed(3))
    base = split_bytes(bytearray(range(256)) * 4, "x")
    # aux_loss_coef=0: the load-balancing loss is a product of per-batch statistics, so
    # its mean over halves is not its value over the whole batch; cross-entropy is.
    cfg = model_config("tiny", aux_loss_coef=0.0)
    grads = []
    for batch_size, micro_batches in ((8, 1), (4, 2), (2, 4)):
        data = _FixedBatches(train_U8=base.train_U8, val_U8=base.val_U8, source="fixed")
        data.windows, data.cursor = windows_B2T, 0
        model = build_model(cfg, seed=0)
        guard = FakeGuard(model)
        train(model, cfg, TrainConfig(steps=1, batch_size=batch_size,
                                      micro_batches=micro_batches), data, guard=guard,
              console=_quiet())
        grads.append(guard.grads_at_exit[0])
    # Same math, different float32 summation order (per micro-batch means, then their
    # sum): differences are a few ulps of O(1e-2) gradients; a missing 1/micro_batches
    # factor would be off by 2x-4x.
    for other in grads[1:]:
        for name, grad in grads[0].items():
            torch.testing.assert_close(other[name], grad, rtol=1e-4, atol=1e-6)


def test_log_writes_one_json_line_per_step(corpus, tmp_path):
    path = tmp_path / "run.jsonl"
    records = _run(corpus, steps=5, eval_every=2, log_path=path)
    lines = path.read_text().splitlines()
    assert len(lines) == 5
    logged = [json.loads(line) for line in lines]
    assert [r["step"] for r in logged] == [1, 2, 3, 4, 5]
    assert [r["step"] for r in logged if "val_loss" in r] == [2, 4, 5]
    for row in logged:
        assert {"loss", "tokens_per_s", "imbalance", "imbalance_per_layer"} <= row.keys()
        assert len(row["imbalance_per_layer"]) == 2
    assert logged == json.loads(json.dumps(records))


def test_log_in_missing_folder_fails_before_training(corpus, tmp_path):
    with pytest.raises(UsageError, match="does not exist"):
        _run(corpus, log_path=tmp_path / "nowhere" / "run.jsonl", guard_factory=_no_guard)


def _no_guard(model, optimizer):
    raise AssertionError("training started before the log path was checked")


def test_progress_bar_on_a_terminal(corpus):
    out = io.StringIO()
    records = _run(corpus, steps=2, console=Console(file=out, force_terminal=True, width=100))
    assert len(records) == 2
    assert "step    2 | loss" in out.getvalue()


def test_expert_imbalance():
    assert expert_imbalance([5, 5, 5, 5]) == 1.0
    assert expert_imbalance([8, 0, 0, 0]) == 4.0
    assert expert_imbalance([0, 0]) == 1.0


def test_step_line_formats():
    assert format_rate(812) == "812"
    assert format_rate(6_340) == "6.34k"
    assert format_rate(41_234) == "41.2k"
    assert format_rate(1_500_000) == "1.50M"
    assert format_bytes(1_908_408) == "1.82 MiB"
    assert format_bytes(2 * 2**30, unit="MiB") == "2048.00 MiB"
    record = {"step": 12, "loss": 2.3141, "tokens_per_s": 41_234.0, "imbalance": 1.93}
    assert step_line(record, 100) == "step   12 | loss 2.314 |  41.2k tok/s | imb 1.9x"
    record |= {"peak_bytes": 1.82 * 2**30, "budget_bytes": 2 * 2**30,
               "decisions": {"save": 28, "recompute": 3, "offload": 1}, "val_loss": 2.4}
    assert step_line(record, 100) == ("step   12 | loss 2.314 |  41.2k tok/s | imb 1.9x | "
                                      "peak 1.82 GiB / 2.00 GiB | save 28 rec 3 off 1 | val 2.400")
