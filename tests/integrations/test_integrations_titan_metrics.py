"""The guard's per-step figures in torchtitan's own metric loggers: SpikeGuardTrainer hands
them, tagged `spikeguard/<SCALARS tag>`, to `metrics_processor.logger` at each step
torchtitan logs, each the largest over the guard steps since the previous log.

  * through torchtitan's own entry point (`torchrun -m torchtitan.train`, one rank, 4
    steps, `--metrics.enable_tensorboard`, `--metrics.log_freq 2`: steps 1, 2 and 4 are
    logged), with an allocation forced into step 2's backward that the safety net
    re-runs: torchtitan's TensorBoard event files, read back, hold spikeguard's tags at
    exactly torchtitan's logged steps, the peaks equal to the independent meter's (the
    device's own peak counter read after every optimizer step, titan_train_registry.py;
    step 4's the largest of steps 3 and 4; the re-run step 2's at least the meter's,
    which sees only the re-run), the budget the job's, the re-run at step 2;
    torchtitan's own tags beside them;
  * one level down, in process: the seam's windows, and nothing logged at a step
    torchtitan does not log.

    .venv/bin/python -m pytest tests/integrations/test_integrations_titan_metrics.py -q
"""

from __future__ import annotations

import struct
import types
from pathlib import Path

import pytest

pytest.importorskip("torchtitan")
pytest.importorskip("torchdata")   # torchtitan's Trainer's data loader
pytest.importorskip("datasets")
pytest.importorskip("tensorboard")

from titan_train_job import make_assets, run_job  # noqa: E402

from spikeguard.runtime.scalars import SCALARS, largest_scalars, step_scalars  # noqa: E402

BUDGET = 1 << 30   # 1GiB: never bites; the forced allocation (the budget's size) does
LOGGED = [1, 2, 4]   # log_freq 2 over 4 steps: torchtitan's should_log (metrics.py:362)


def _as_float32(value: float) -> float:
    return struct.unpack("f", struct.pack("f", value))[0]


def _scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    runs = {p.parent for p in folder.rglob("events.out.tfevents.*")}
    assert len(runs) == 1, runs   # rank 0's one TensorBoard folder under dump_folder/tb
    acc = EventAccumulator(str(runs.pop()), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)]
            for tag in acc.Tags()["scalars"]}


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_torchtitans_tensorboard_gets_the_guards_scalars(tmp_path):
    assets = make_assets(tmp_path / "assets")
    job = run_job(assets, tmp_path / "job", "--spikeguard.policy", "adaptive",
                  "--spikeguard.budget", str(BUDGET), "--metrics.enable_tensorboard",
                  "--metrics.log_freq", "2", backward_oom_at=1)
    assert job.returncode == 0, job.output[-4000:]
    report = job.reports[0]
    peaks = report["peaks"]
    assert len(peaks) == 4 and report["reruns"] == [0, 1, 0, 0], report

    got = _scalars(tmp_path / "job" / "out")
    ours = {tag for tag in got if tag.startswith("spikeguard/")}
    assert {"spikeguard/memory/peak_bytes", "spikeguard/memory/budget_bytes",
            "spikeguard/memory/reserved_bytes", "spikeguard/guard/decisions_save",
            "spikeguard/guard/safety_net_reruns"} <= ours, sorted(got)
    for tag in ours:   # one value per step torchtitan logged, at that step
        assert [step for step, _ in got[tag]] == LOGGED, (tag, got[tag])
    # the meter's steps (0-based) behind each logged step; step 2 (index 1) was re-run:
    # the meter, read after the optimizer's step, saw the re-run only, and the guard's
    # record holds the step's true peak, the failed attempt's included: at least as large
    windows = [[0], [1], [2, 3]]
    meter = [_as_float32(max(peaks[i] for i in window)) for window in windows]
    logged = got["spikeguard/memory/peak_bytes"]
    assert [logged[0], logged[2]] == [(1, meter[0]), (4, meter[2])], (logged, peaks)
    assert logged[1][1] >= meter[1], (logged, peaks)
    # and every value is the guard's own records' (as the rank wrote them), window by window
    records = [{"peak_bytes": p, "decisions": d, "safety_net_reruns": r}
               for p, d, r in zip(report["record_peaks"], report["decisions"], report["reruns"])]
    for tag in ("memory/peak_bytes", "guard/decisions_save", "guard/decisions_recompute",
                "guard/safety_net_reruns"):
        assert got["spikeguard/" + tag] == [
            (step, _as_float32(largest_scalars([records[i] for i in window])[tag]))
            for step, window in zip(LOGGED, windows)], (tag, got["spikeguard/" + tag], records)
    assert all(value <= BUDGET for _, value in got["spikeguard/memory/peak_bytes"])
    assert got["spikeguard/memory/budget_bytes"] == [(step, float(BUDGET)) for step in LOGGED]
    assert got["spikeguard/guard/safety_net_reruns"] == list(zip(LOGGED, [0.0, 1.0, 0.0]))
    # torchtitan's own figures, at the same steps, untouched
    assert [step for step, _ in got["loss_metrics/global_avg_loss"]] == LOGGED
    assert not set(SCALARS) & set(got), sorted(got)   # spikeguard's only under its prefix


def _record(step: int, peak: int, recompute: int, reruns: int = 0) -> dict:
    return {"step": step, "peak_bytes": peak, "budget_bytes": 100, "reserved_bytes": peak,
            "decisions": {"save": 4 - recompute, "recompute": recompute, "offload": 0},
            "safety_net_reruns": reruns, "plan_us": 10.0}


class _Logger:
    def __init__(self):
        self.calls: list[tuple[int, dict]] = []

    def log(self, metrics, step):
        self.calls.append((step, dict(metrics)))


def test_the_seam_logs_each_window_largest_at_torchtitans_logged_steps():
    from spikeguard.integrations.titan_trainer import TAG_PREFIX, SpikeGuardTrainer
    from torchtitan.components.metrics import MetricsProcessor

    guard = types.SimpleNamespace(history=[])
    logger = _Logger()
    processor = types.SimpleNamespace(config=MetricsProcessor.Config(log_freq=2),
                                      logger=logger)
    processor.should_log = types.MethodType(MetricsProcessor.should_log, processor)
    trainer = types.SimpleNamespace(guards=[guard], num_logged=[0],
                                    metrics_processor=processor, step=0)
    history = [_record(0, 50, 0), _record(1, 90, 2, reruns=1), _record(2, 70, 1),
               _record(3, 60, 0), _record(4, 40, 0)]
    for record in history:   # torchtitan's train(): step += 1, train_step, (the record)
        trainer.step += 1
        guard.history.append(record)
        SpikeGuardTrainer.log_guard_scalars(trainer)

    assert [step for step, _ in logger.calls] == [1, 2, 4]   # 3 and 5: not logged
    windows = [history[0:1], history[1:2], history[2:4]]
    for (_, metrics), window in zip(logger.calls, windows):
        assert metrics == {TAG_PREFIX + tag: value
                           for tag, value in largest_scalars(window).items()}
    assert logger.calls[2][1]["spikeguard/memory/peak_bytes"] == 70.0
    assert logger.calls[1][1]["spikeguard/guard/safety_net_reruns"] == 1.0
    assert set(logger.calls[0][1]) == {TAG_PREFIX + t for t in step_scalars(history[0])}
