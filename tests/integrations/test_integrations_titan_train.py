"""spikeguard inside torchtitan's own Trainer, through torchtitan's own entry point.

Every job is `torchrun -m torchtitan.train --module titan_train_registry --config ...`
(titan_train_job.py): torchtitan 0.3.0's real `main`, its config manager, its Trainer
(FSDP2 applied, as it applies it even on one rank), its data loader over a corpus and a
tokenizer made here; spikeguard is on only through the config (`with_spikeguard`, and
`--spikeguard.budget/--spikeguard.policy` on torchtitan's command line). Peaks are the
independent meter's: the device's own peak counter read after every optimizer step
(titan_train_registry.py), not the guard's history. Shown:
  * one rank, FSDP2: `full` peaks below everything kept (`none`, its forwards calm
    from the second step, as under EP=2 below); at a budget halfway
    between, adaptive runs every step with no safety-net re-run and its true peak under
    the budget, and `none` dies in one line (exit 3); an allocation forced into step 2's
    backward (one no plan foresees): the step-level net re-runs that step, and torchtitan
    logs the uninterrupted job's loss and grad norm at every step;
  * EP=2 (torchtitan's own EP on gloo, `partial_dtensor`, FSDP2 over the 2 ranks): a 2x
    spike forced onto rank 0 at step 3 under 1.04x the calm all-kept peak: `none` dies on
    rank 0 at that step in one line, adaptive finishes on both ranks under the budget,
    with no re-run;
  * a bad setting on torchtitan's command line: one line, exit 2.

    .venv/bin/python -m pytest tests/integrations/test_integrations_titan_train.py -q
"""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("torchtitan")
pytest.importorskip("torchdata")   # torchtitan's Trainer's data loader
pytest.importorskip("datasets")

from titan_train_job import EP2, make_assets, run_job  # noqa: E402

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(900)]

HUGE = "1GiB"
OOM_LINE = "spikeguard: out of memory on rank 0: "
SPIKE_EVERY = 3          # step 3 of 4 (index 2) is the spike


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return make_assets(tmp_path_factory.mktemp("titan_assets"))


def _job(assets, tmp_path, name, policy, budget, *options, **kwargs):
    return run_job(assets, tmp_path / name, "--spikeguard.policy", policy,
                   "--spikeguard.budget", str(budget), *options, **kwargs)


def _ok(job, steps: int = 4):
    assert job.returncode == 0, job.output[-4000:]
    assert len(job.reports[0]["peaks"]) == steps, job.reports


def _died_in_one_line(job, at_step: int):
    """Exit 3 on rank 0 at `at_step` (torchtitan logged the steps before it), one line."""
    assert job.returncode != 0, job.output[-2000:]
    assert len(job.lines(OOM_LINE)) == 1, job.output[-4000:]
    assert "exitcode  : 3" in job.output
    # no exception rendered by the rank or by torchelastic's error file; one traceback,
    # the launcher's own ChildFailedError
    assert "DeviceOutOfMemory" not in job.output and job.output.count("Traceback") == 1
    assert job.steps_logged == at_step - 1, job.output[-4000:]


def test_one_rank_fsdp2_adaptive_between_full_and_all_kept(assets, tmp_path):
    kept = _job(assets, tmp_path, "none", "none", HUGE)
    full = _job(assets, tmp_path, "full", "full", HUGE)
    _ok(kept)
    _ok(full)
    assert "Applied FSDP to the model" in kept.output   # torchtitan's FSDP2, one rank
    # inside torchtitan's own Trainer `none`'s forwards run calm (runtime/calm_forward.py)
    # once a forward of their shapes ran hooked: one micro-batch a step
    assert kept.reports[0]["calm"] == [0, 1, 1, 1], kept.reports
    kept_peak, full_peak = kept.peak(), full.peak()
    assert full_peak < kept_peak, (full_peak, kept_peak)
    budget = (full_peak + kept_peak) // 2

    adaptive = _job(assets, tmp_path, "adaptive", "adaptive", budget)
    _ok(adaptive)
    report = adaptive.reports[0]
    assert report["budget"] == budget
    assert report["reruns"] == [0, 0, 0, 0]
    assert adaptive.peak() <= budget, (adaptive.reports, budget)

    # an allocation no plan foresees, in step 2's backward: the step-level net frees the
    # attempt (FSDP2's state with it) and re-runs the step; torchtitan then logs the same
    # loss and grad norm, every step, as the uninterrupted job
    net = _job(assets, tmp_path, "net", "adaptive", budget, backward_oom_at=1)
    _ok(net)
    assert net.reports[0]["reruns"] == [0, 1, 0, 0], net.reports
    assert net.peak() <= budget, (net.reports, budget)
    assert net.metrics() == adaptive.metrics() and len(net.metrics()) == 4, net.output[-3000:]

    dies = _job(assets, tmp_path, "none_tight", "none", budget)
    _died_in_one_line(dies, at_step=2)   # step 1 fits: AdamW's state is made in its update


def test_ep2_forced_spike_none_dies_adaptive_survives(assets, tmp_path):
    calm = _job(assets, tmp_path, "calm", "none", HUGE, *EP2, nproc=2)
    _ok(calm)
    assert [r["calm"] for r in calm.reports] == [[0, 1, 1, 1]] * 2, calm.reports
    # the calm all-kept peak, worst rank, once the optimizer's state exists (step 2 on)
    budget = int(1.04 * max(calm.peak(rank, steps=[1, 2, 3]) for rank in (0, 1)))

    dies = _job(assets, tmp_path, "none_spike", "none", budget, *EP2, nproc=2,
                spike_every=SPIKE_EVERY)
    _died_in_one_line(dies, at_step=SPIKE_EVERY)

    adaptive = _job(assets, tmp_path, "adaptive_spike", "adaptive", budget, *EP2, nproc=2,
                    spike_every=SPIKE_EVERY)
    _ok(adaptive)
    for rank in (0, 1):
        report = adaptive.reports[rank]
        assert report["reruns"] == [0, 0, 0, 0], report
        assert adaptive.peak(rank) <= budget, (rank, report, budget)


def test_a_bad_setting_is_one_line_and_exit_2(assets, tmp_path):
    job = _job(assets, tmp_path, "bad", "sometimes", HUGE)
    assert job.returncode != 0
    assert len(job.lines("spikeguard: error: unknown policy 'sometimes'")) == 1, job.output[-3000:]
    assert "exitcode  : 2" in job.output


def _debug_config():
    from torchtitan.models.deepseek_v3.config_registry import deepseek_v3_debugmodel
    return deepseek_v3_debugmodel()


def test_with_spikeguard_keeps_the_users_config_and_adds_the_settings():
    from spikeguard.integrations.titan_trainer import SpikeGuardTrainer, with_spikeguard
    config = _debug_config()
    guarded = with_spikeguard(config, budget="70GiB", policy="full")
    assert type(guarded) is SpikeGuardTrainer.Config
    assert guarded.build.__func__ is config.build.__func__   # torchtitan's own build ...
    assert type(guarded)._owner is SpikeGuardTrainer         # ... of spikeguard's trainer
    assert guarded.model_spec is config.model_spec and guarded.training is config.training
    assert (guarded.spikeguard.budget, guarded.spikeguard.policy) == ("70GiB", "full")
    assert guarded.spikeguard.memory_snapshot is None
    snapping = with_spikeguard(config, budget="70GiB", memory_snapshot="runs/snaps")
    assert snapping.spikeguard.memory_snapshot == "runs/snaps"


@pytest.mark.parametrize("kwargs, says", [
    ({"policy": "sometimes"}, "unknown policy 'sometimes'"),
    ({"shared_policy": "drop"}, "unknown shared_policy 'drop'"),
    ({"budget": "lots"}, "cannot read budget 'lots'"),
    ({"budget": -1}, "budget"),
    ({"memory_snapshot": 7}, "memory_snapshot must be a folder's path"),
])
def test_with_spikeguard_refuses_a_bad_setting_in_one_line(kwargs, says):
    import spikeguard
    from spikeguard.integrations.titan_trainer import with_spikeguard
    with pytest.raises(spikeguard.UsageError, match=says) as info:
        with_spikeguard(_debug_config(), **kwargs)
    assert "\n" not in str(info.value)


def test_with_spikeguard_refuses_a_config_of_another_trainer():
    import spikeguard
    from spikeguard.integrations.titan_trainer import SpikeGuardTrainer, with_spikeguard
    from torchtitan.trainer import Trainer

    class OtherTrainer(Trainer):
        @dataclasses.dataclass(kw_only=True, slots=True)
        class Config(Trainer.Config):
            pass
    with pytest.raises(spikeguard.UsageError, match="whose own trainer it would replace"):
        with_spikeguard(OtherTrainer.Config(**_fields(_debug_config())))
    assert SpikeGuardTrainer   # imported: the module needs torchtitan's Trainer


def _fields(config) -> dict:
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init}
