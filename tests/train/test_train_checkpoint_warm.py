"""A resumed run's guard starts warm: what the guard learned online (the layer peaks'
slopes, the forecast's bytes per token, the window's per-token figures, the cost model's
timings: spikeguard.runtime.learned) is in the checkpoint, and the first steps after a
resume decide exactly as the uninterrupted run did. Without it (the guards left cold, as
every resume was before DCP checkpoints) they decide otherwise, checked here too so the
claim stays true.

The cost model is frozen at fixed timings in every run (the same in all three): its
timings are measured, so two processes would rank close plans differently by noise; the
bytes the guard learns are the emulated device's, the same in every run.

    .venv/bin/python -m pytest tests/train/test_train_checkpoint_warm.py
"""

from __future__ import annotations

import io

import pytest
from rich.console import Console

import spikeguard
from spikeguard.data.corpus import load_corpus
from spikeguard.model import build_model, model_config
from spikeguard.train import TrainConfig, train
from spikeguard.train.checkpoint import Checkpointer

pytestmark = pytest.mark.timeout(300)
BUDGET = "1.5MiB"   # tiny, 2 micro-batches of 4 x 32: every step recomputes and offloads


@pytest.fixture(scope="module")
def corpus():
    return load_corpus(max_bytes=2 * 2**20)


def _guard(model, optimizer):
    guard = spikeguard.attach(model, budget=BUDGET, policy="adaptive", optimizer=optimizer)
    guard.cost.stage_s_per_token.update({s: 1e-7 * (i + 1) for i, s in
                                         enumerate(sorted(guard.cost.stage_s_per_token))})
    guard.cost.d2h_s_per_byte = guard.cost.h2d_s_per_byte = 2e-10
    guard.cost.freeze()
    return guard


def _run(corpus, steps: int, checkpoint=None) -> dict[int, tuple]:
    cfg = model_config("tiny")
    records = train(build_model(cfg, seed=0), cfg,
                    TrainConfig(steps=steps, batch_size=4, micro_batches=2, eval_every=100,
                                eval_batches=1), corpus, guard_factory=_guard,
                    checkpoint=checkpoint, console=Console(file=io.StringIO()))
    return {r["step"]: (r["decisions"], r["evicted_bytes"], r["peak_bytes"], r["loss"])
            for r in records}


def _resumed(corpus, folder) -> dict[int, tuple]:
    _run(corpus, 3, Checkpointer(folder, every=3))
    return _run(corpus, 6, Checkpointer(folder, every=3, resume=True))


def test_the_first_steps_after_a_resume_decide_as_the_uninterrupted_run(corpus, tmp_path,
                                                                       monkeypatch):
    straight = _run(corpus, 6)
    assert any(d["recompute"] + d["offload"] for d, *_ in straight.values())
    warm = _resumed(corpus, tmp_path / "warm")
    assert sorted(warm) == [4, 5, 6]
    for step in (4, 5, 6):
        assert warm[step] == straight[step], step
    # The guards left cold: the same losses, other decisions on the first steps.
    monkeypatch.setattr(Checkpointer, "restore_guards", lambda self, guards: False)
    cold = _resumed(corpus, tmp_path / "cold")
    assert [cold[s][3] for s in (4, 5, 6)] == [straight[s][3] for s in (4, 5, 6)]
    assert cold[4][:3] != straight[4][:3]


def test_the_guard_state_round_trips_and_refuses_another_guard():
    from spikeguard.errors import UsageError

    cfg = model_config("tiny")
    guard = _guard(build_model(cfg, seed=0), None)
    state = guard.state_dict()
    state["layer_room"]["forward_per_token"] = 123.5
    state["forecast"]["head_bytes_per_token"] = 77.25
    other = _guard(build_model(cfg, seed=0), None)
    other.load_state_dict(state)
    assert other.state_dict() == state
    with pytest.raises(UsageError, match="not version 1"):
        other.load_state_dict({**state, "version": 9})
    with pytest.raises(UsageError, match="times the stages"):
        other.load_state_dict({**state, "cost": {**state["cost"], "stage_s_per_token": {}}})
    guard.detach()
    other.detach()
