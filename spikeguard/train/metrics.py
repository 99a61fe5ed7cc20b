"""Per-step scalars for the tools people watch runs in: one interface, sinks behind it.

    .venv/bin/spikeguard train --preset tiny --steps 3 --budget 4MiB --tensorboard runs/tb
    .venv/bin/tensorboard --logdir runs/tb

The loop (spikeguard.train.loop.run_loop) hands every finished step's record to
`step_scalars`, and what it returns to each `MetricsSink`: the same record the step line
and the JSONL log (`--log`) are made of, so a TensorBoard curve and a log line of one step
never disagree. Only rank 0 writes (it is the rank that prints): its own figures, plus
the cluster's worst peak (`max_peak_bytes`) where the run has several ranks; every
rank's figures stay in the per-rank JSONL logs. A dropped step (`--skip-steps`) writes nothing.

A sink is anything with `write(step, scalars)` and `close()` (a Protocol, so a caller's
own logger plugs in without subclassing): `TensorBoardSink` writes event files through
`torch.utils.tensorboard.SummaryWriter`, which names each file uniquely (time, host,
pid), so a resumed run adds a file beside the old ones and never replaces one.
"""

from __future__ import annotations

from typing import Any, Mapping, Protocol, runtime_checkable

# scalar tag -> the step record's key it is read from (nested keys joined by '.').
SCALARS: dict[str, str] = {
    "train/loss": "loss",
    "train/tokens_per_s": "tokens_per_s",
    "train/val_loss": "val_loss",
    "train/imbalance": "imbalance",
    "memory/peak_bytes": "peak_bytes",
    "memory/max_peak_bytes": "max_peak_bytes",   # the cluster's worst rank (EP / PP runs)
    "memory/budget_bytes": "budget_bytes",
    "memory/reserved_bytes": "reserved_bytes",
    "memory/evicted_bytes": "evicted_bytes",
    "memory/prefetched_bytes": "prefetched_bytes",
    "guard/decisions_save": "decisions.save",
    "guard/decisions_recompute": "decisions.recompute",
    "guard/decisions_offload": "decisions.offload",
    "guard/safety_net_reruns": "safety_net_reruns",
    "guard/plan_us": "plan_us",
}


@runtime_checkable
class MetricsSink(Protocol):
    """Where a step's scalars go. `write` is called once per trained step, in step order;
    `close` once, when the run ends (also when it fails)."""

    def write(self, step: int, scalars: dict[str, float]) -> None: ...

    def close(self) -> None: ...


def _lookup(record: Mapping[str, Any], key: str) -> Any:
    value: Any = record
    for part in key.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return None
        value = value[part]
    return value


def step_scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """The record's scalars by tag (SCALARS): those it has, as floats. Missing or None
    (no guard: no memory figures; no budget; no validation this step) is left out, not
    written as 0; a non-finite loss is kept (a diverging curve should show it)."""
    if record.get("skipped"):
        return {}
    out = {}
    for tag, key in SCALARS.items():
        value = _lookup(record, key)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        out[tag] = float(value)
    return out


class TensorBoardSink:
    """Scalars into TensorBoard event files in `folder` (created if missing; files
    already there are kept). Needs the `tensorboard` package (spikeguard[tensorboard])."""

    def __init__(self, folder: str):
        from spikeguard.extras import require

        require("tensorboard", "tensorboard", "--tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=folder)

    def write(self, step: int, scalars: dict[str, float]) -> None:
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, global_step=step)
        # Flushed per step, as the JSONL log is: an interrupted run keeps its curve.
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def write_step(sinks, record: Mapping[str, Any]) -> None:
    """One finished step's scalars to every sink (nothing for a dropped step)."""
    scalars = step_scalars(record)
    if not scalars:
        return
    for sink in sinks:
        sink.write(int(record["step"]), scalars)
