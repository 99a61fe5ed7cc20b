"""spikeguard inside torchtitan's own Trainer, launched by torchtitan's own entry point.

In the config registry module a run already uses, wrap its config function's result:

    from spikeguard.integrations.titan_trainer import with_spikeguard
    def my_run():
        return with_spikeguard(deepseek_v3_debugmodel(), budget="70GiB", policy="adaptive")

    torchrun --nproc-per-node 8 -m torchtitan.train --module my_pkg --config my_run \
        --spikeguard.budget 60GiB          # the settings are torchtitan CLI options too

Why a Trainer.Config subclass (docs/titan.md, "The seam"): torchtitan 0.3.0's entry point
builds whatever its config names (`trainer = config.build()`, torchtitan/train.py:51:
`Configurable.Config.build` constructs the config's owner class), and its
`Trainer.train_step` has no hook around the micro-batch loop; the step-level safety net
must own forward, backward and what follows, so the owner is `SpikeGuardTrainer`, chosen
by the config, never subclassed by the user. It adds spikeguard's model converter and
`attach_titan` to the model spec (attach after parallelize and optimizer build, as
before), and runs each `train_step` inside `guard.run_step`: an out-of-memory anywhere in
the step before the optimizer's update frees it and re-runs it whole, on the same
micro-batches, with every layer recomputed. An out-of-memory in the update itself is never
re-run (half applied): one line, as is every other failure of the guard; exit codes as
the `spikeguard` CLI's (2 a setting, 3 out of memory). At each step torchtitan logs, the
guard's figures (memory/peak_bytes, guard/decisions_recompute, ...: the tags of
spikeguard.runtime.scalars) go to torchtitan's own metric loggers as
`spikeguard/memory/peak_bytes`, ..., wherever its config sends them
(`--metrics.enable_tensorboard`, `--metrics.enable_wandb`).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
import time
from dataclasses import dataclass, field

import torch

from spikeguard.errors import DeviceOutOfMemory, UsageError
from spikeguard.memory.budget import parse_bytes
from spikeguard.integrations.titan_converter import GuardSettings, SpikeGuardConverter, attach_titan
from spikeguard.parallel.launch_utils import peer_failure
from spikeguard.runtime.agreement import JobEnds, worst
from spikeguard.runtime.device_state import PHASE_OPTIMIZER
from spikeguard.runtime.scalars import largest_scalars
from spikeguard.runtime.step import run_steps

from torchtitan.trainer import Trainer  # noqa: E402  (titan_converter said how to install)


TAG_PREFIX = "spikeguard/"   # before each SCALARS tag in torchtitan's metric loggers


class OptimizerStepOutOfMemory(RuntimeError):
    """The device ran out inside the optimizer's update: not a step to re-run."""


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def _leave(text: str, code: int) -> None:
    """One line on stderr, then exit at once: the interpreter's and gloo's teardown with a
    peer still in a collective would print pages under the one line."""
    sys.stderr.write(text + "\n")
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(code)


class SpikeGuardTrainer(Trainer):
    """torchtitan's Trainer whose every training step a spikeguard guard owns."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        spikeguard: SpikeGuardConverter.Config = field(
            default_factory=SpikeGuardConverter.Config)
        """spikeguard's settings: budget, policy, shared_policy, memory_snapshot (see
        SpikeGuardConverter)."""

    def __init__(self, config: Config):
        try:
            settings = _settings(config.spikeguard)
            if config.parallelism.pipeline_parallel_degree > 1:
                raise UsageError("spikeguard inside torchtitan's Trainer does not run its "
                                 "pipeline parallelism yet: set "
                                 "parallelism.pipeline_parallel_degree = 1")
            config.model_spec = _guarded_spec(config.model_spec, settings)
            super().__init__(config)
        except UsageError as err:
            _leave(f"spikeguard: error: {_one_line(err)}", 2)
        self.guards = [part.spikeguard for part in self.model_parts]
        self.num_logged = [0] * len(self.guards)   # per guard: history records logged

    def train_step(self, data_iterator):
        """One guarded step; a failure of it is one line and the exit (here, not in
        `train`: torchtitan's `train` is under torchelastic's `@record`, which would
        print the exception's traceback beneath the line)."""
        try:
            result = self._guarded_step(data_iterator)
        except (DeviceOutOfMemory, OptimizerStepOutOfMemory) as err:
            self._fail(f"out of memory on rank {os.environ.get('RANK', '0')}: "
                       f"{_one_line(err)}", 3, err)
        except UsageError as err:
            self._fail(f"error: {_one_line(err)}", 2, err)
        except RuntimeError as err:   # a peer's process gone: its own line says why
            peer = peer_failure(err)
            if peer is None:
                raise
            self._fail(f"rank {os.environ.get('RANK', '?')} stopped: another rank of the "
                       f"group failed ({_one_line(peer).split('. ')[0]})", 1, err)
        self.log_guard_scalars()
        return result

    def log_guard_scalars(self) -> None:
        """At a step torchtitan logs, the guard's scalars into torchtitan's own metric
        loggers (TensorBoard, W&B: `metrics_processor.logger`, a no-op on a rank
        torchtitan does not let log), tagged `spikeguard/<SCALARS tag>`, each the largest
        over the guard steps since the previous log (docs/titan.md, "Metrics"). After
        the step, not inside torchtitan's own `metrics_processor.log` call: the step's
        record exists only once `run_steps` has closed it."""
        if not self.metrics_processor.should_log(self.step):
            return
        records = [record for guard, seen in zip(self.guards, self.num_logged)
                   for record in guard.history[seen:]]
        self.num_logged = [len(guard.history) for guard in self.guards]
        scalars = largest_scalars(records)
        if scalars:
            self.metrics_processor.logger.log(
                {f"{TAG_PREFIX}{tag}": value for tag, value in scalars.items()}, self.step)

    def _fail(self, text: str, code: int, err: BaseException) -> None:
        """An agreed failure (every rank of the EP group holds the same line) is said by
        the rank that ran out; the others leave a moment later, silent, so that torchrun
        names that rank first."""
        self.close()
        if isinstance(err, JobEnds) and worst(err.notes).rank != int(os.environ.get("RANK", "0")):
            time.sleep(2.0)
            sys.stdout.flush()
            os._exit(code)
        _leave(f"spikeguard: {text}", code)

    def _guarded_step(self, data_iterator):
        """torchtitan's step inside `run_steps`: its micro-batches drawn first, so that a
        re-run sees the same data; the previous step's gradients dropped first, so that the
        net's snapshot of them (taken to put back after a failed attempt) is empty."""
        num = self.gradient_accumulation_steps * self.num_pipeline_parallel_microbatches
        batches = [next(data_iterator) for _ in range(num)]
        self.optimizers.zero_grad(set_to_none=True)
        seen = self.ntokens_seen

        def body():
            self.ntokens_seen = seen   # a re-run counts its tokens once
            try:
                return Trainer.train_step(self, iter(batches))
            except (torch.OutOfMemoryError, DeviceOutOfMemory) as err:
                if any(g.position.phase == PHASE_OPTIMIZER for g in self.guards):
                    raise OptimizerStepOutOfMemory(
                        f"in the optimizer step: {_one_line(self.guards[0].device_oom(err))}"
                    ) from None
                raise
        return run_steps(self.guards, body)

    def close(self) -> None:
        for guard in getattr(self, "guards", []):
            if guard.attached:
                guard.detach()
        super().close()


def _settings(config: SpikeGuardConverter.Config) -> GuardSettings:
    return GuardSettings.of(config)


def _guarded_spec(spec, settings: GuardSettings):
    """The model spec with spikeguard's converter applied to its model config and
    `attach_titan` as its post-optimizer hook (chaining the spec's own)."""
    if spec is None:
        raise UsageError("the trainer config has no model_spec: build it from a torchtitan "
                         "config function (model_registry(...))")
    converter = settings.converter_config().build()
    return dataclasses.replace(
        spec, model=converter.convert(spec.model),
        post_optimizer_build_fn=functools.partial(attach_titan,
                                                  chain=spec.post_optimizer_build_fn))


def with_spikeguard(config: Trainer.Config, *, budget=None, policy: str = "adaptive",
                    shared_policy: str = "keep",
                    memory_snapshot=None) -> "SpikeGuardTrainer.Config":
    """`config` (torchtitan's own Trainer.Config, from any config function) as a
    SpikeGuardTrainer config with these settings; a bad setting is a UsageError here.
    `memory_snapshot`: a folder for a snapshot of each out-of-memory (as attach's)."""
    if type(config) not in (Trainer.Config, SpikeGuardTrainer.Config):
        raise UsageError(f"with_spikeguard wraps torchtitan's Trainer.Config; this config "
                         f"is {type(config).__qualname__}, whose own trainer it would "
                         f"replace")
    settings = GuardSettings(budget, policy, shared_policy, memory_snapshot)   # validates
    if budget is not None:
        parse_bytes(budget)
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
              if f.init and f.name != "spikeguard"}
    return SpikeGuardTrainer.Config(**fields, spikeguard=settings.converter_config())


__all__ = ["SpikeGuardTrainer", "with_spikeguard", "OptimizerStepOutOfMemory", "TAG_PREFIX"]
