"""Per-step scalars for the tools people watch runs in: one interface, sinks behind it.

    .venv/bin/spikeguard train --preset tiny --steps 3 --budget 4MiB --tensorboard runs/tb
    .venv/bin/tensorboard --logdir runs/tb
    .venv/bin/spikeguard train --preset tiny --steps 3 --budget 4MiB --wandb my-project

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
`WandbSink` logs them to a Weights & Biases run (`wandb.init`, `run.log(..., step=)`), in
the mode `wandb_mode` picks: offline unless W&B has a key, so a run without one never
waits on a login prompt or the network; each run is a new folder `wandb/offline-run-*`
(or `run-*`) under WANDB_DIR, or the current folder, named by time and a random id.
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Protocol, runtime_checkable

from spikeguard.runtime.scalars import SCALARS, step_scalars

__all__ = ["SCALARS", "MetricsSink", "TensorBoardSink", "WandbSink", "step_scalars",
           "wandb_mode", "write_step"]


@runtime_checkable
class MetricsSink(Protocol):
    """Where a step's scalars go. `write` is called once per trained step, in step order;
    `close` once, when the run ends (also when it fails)."""

    def write(self, step: int, scalars: dict[str, float]) -> None: ...

    def close(self) -> None: ...


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


def wandb_mode() -> str:
    """WANDB_MODE where it is set; otherwise "online" only where W&B has a key to log in
    with (WANDB_API_KEY, WANDB_IDENTITY_TOKEN_FILE, or the .netrc entry `wandb login`
    writes for WANDB_BASE_URL's host), else "offline": without a key wandb 0.31's online
    init asks for one on a terminal, or fails ("No API key configured") without one, and
    a training run must do neither. The key itself stays W&B's to read."""
    import netrc
    from urllib.parse import urlsplit

    env = os.environ
    if env.get("WANDB_MODE"):
        return env["WANDB_MODE"]
    if env.get("WANDB_API_KEY") or env.get("WANDB_IDENTITY_TOKEN_FILE"):
        return "online"
    host = urlsplit(env.get("WANDB_BASE_URL") or "https://api.wandb.ai").netloc
    try:
        netrc_file = netrc.netrc(env.get("NETRC") or os.path.expanduser("~/.netrc"))
        entry = netrc_file.authenticators(host)
    except (OSError, netrc.NetrcParseError):
        entry = None
    return "online" if entry and entry[2] else "offline"


class WandbSink:
    """Scalars into a W&B run of `project` (wandb_mode()'s mode; its files under
    WANDB_DIR, or the current folder, as W&B places them). Needs the `wandb` package
    (spikeguard[wandb])."""

    def __init__(self, project: str):
        from spikeguard.extras import require

        wandb = require("wandb", "wandb", "--wandb")
        # console "off": the step lines are already in the JSONL log, and W&B's capture
        # would wrap the stream the CLI's rich console prints to. quiet: W&B still says
        # where the run is and its mode, not a summary table after spikeguard's own.
        self.run = wandb.init(project=project, mode=wandb_mode(),
                              dir=os.environ.get("WANDB_DIR") or None,
                              settings=wandb.Settings(console="off", quiet=True))

    def write(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


def write_step(sinks, record: Mapping[str, Any]) -> None:
    """One finished step's scalars to every sink (nothing for a dropped step)."""
    scalars = step_scalars(record)
    if not scalars:
        return
    for sink in sinks:
        sink.write(int(record["step"]), scalars)
