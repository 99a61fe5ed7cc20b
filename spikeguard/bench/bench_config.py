"""The typed configuration of `spikeguard bench`, built once from its command line.

    cfg = BenchConfig.from_args(args)   # every check, one UsageError (exit 2) before any job
    cfg.run                             # the measurement pass's RunConfig: model, layout,
                                        # steps, skew or trace, checkpoints (train's checks)

The bench's functions read this object, never the argparse Namespace: what a job runs
(model, layout, micro-batches resolved by train's configuration) is said once, here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from spikeguard.errors import UsageError
from spikeguard.runtime.policies import POLICIES as GUARD_POLICIES

# The run order: the ceiling (no guard), then the guard's policies from the most kept to
# the least (a policy added to spikeguard.runtime.policies and not placed here fails at
# import, loudly).
POLICIES = ("ceiling", *sorted(GUARD_POLICIES, key=("none", "offload", "experts", "full",
                                                    "adaptive").index))
NO_LIMIT = "1TiB"


@dataclass(frozen=True)
class BenchConfig:
    """One bench: the measurement pass's RunConfig, the policies compared and how."""

    run: object                    # spikeguard.train.config.RunConfig (measurement pass)
    policies: tuple
    budget: Optional[int]          # None: auto (the calm steps' peak plus the margin)
    segments: int
    restart_cost: float            # seconds per crash, for the at-scale figure
    work: Optional[str]
    json: Optional[str]
    plots: Optional[str]
    docs: Optional[str]
    overwrite: bool
    argv: tuple

    # ---- what the jobs share (read from the measurement pass's configuration) ----------
    @property
    def preset(self) -> str:
        return self.run.model.preset

    @property
    def overrides(self) -> dict:
        """num_layers / num_experts given on the command line."""
        return dict(self.run.model.overrides)

    @property
    def layout(self):
        return self.run.layout

    @property
    def schedule(self) -> str:
        return self.run.parallel.schedule

    @property
    def steps(self) -> int:
        return self.run.train.steps

    @property
    def trace(self) -> Optional[str]:
        return self.run.files.trace

    @property
    def checkpoint_every(self) -> int:
        return self.run.files.checkpoint_every

    @property
    def skew(self):
        """The skew the measurement pass records (spikeguard.train.config.SkewChoice)."""
        return self.run.skew

    @classmethod
    def from_args(cls, args) -> "BenchConfig":
        """Every check of the command line, before any job (UsageError, exit 2)."""
        for name in ("ep", "pp", "dp", "steps", "batch_size", "segments", "checkpoint_every"):
            if getattr(args, name) <= 0:
                raise UsageError(f"--{name.replace('_', '-')} must be positive, "
                                 f"got {getattr(args, name)}")
        if args.ep < 2:
            raise UsageError("--ep must be at least 2: spikes are one rank receiving more "
                             "than its share")
        if args.segments > args.steps:
            raise UsageError(f"--segments {args.segments} exceeds --steps {args.steps}")
        if args.trace is not None and args.spike_from_layer:
            raise UsageError("--spike-from-layer shapes the skew the bench records; a --trace "
                             "is replayed as it was recorded")
        if not math.isfinite(args.restart_cost) or args.restart_cost < 0:
            raise UsageError(f"--restart-cost must be a finite number of seconds >= 0, "
                             f"got {args.restart_cost}")
        policies = _policies(args.policies)
        budget = None
        if args.budget != "auto":
            from spikeguard.memory.budget import parse_bytes
            budget = parse_bytes(args.budget)
        from spikeguard.bench.outputs import check_outputs
        # an output that is the --trace is refused before the trace is read
        check_outputs(json=args.json, docs=args.docs, plots=args.plots, trace=args.trace,
                      overwrite=args.overwrite)
        if args.trace is not None:
            from spikeguard.routing.trace import load_trace
            load_trace(args.trace)   # missing, a folder, binary, not a trace: one line now
        run = _run_config(args)
        _check_work(args.work)
        return cls(run=run, policies=policies, budget=budget, segments=args.segments,
                   restart_cost=args.restart_cost, work=args.work, json=args.json,
                   plots=args.plots, docs=args.docs, overwrite=args.overwrite,
                   argv=tuple(args.argv))


def _policies(text: str) -> tuple:
    policies = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [p for p in policies if p not in POLICIES]
    if unknown or not policies or len(set(policies)) != len(policies):
        raise UsageError(f"--policies must name each of {', '.join(POLICIES)} at most once, "
                         f"got {text!r}")
    return tuple(policies)


def _check_work(work: Optional[str]) -> None:
    if work is not None and Path(work).is_file():
        raise UsageError(f"--work {work} is a file")
    if work is not None and Path(work).is_dir() and any(Path(work).iterdir()):
        # Its checkpoints would be resumed and its logs overwritten: never reuse one.
        raise UsageError(f"--work {work} is not empty; give a new or empty folder")


def _run_config(args):
    """The measurement pass's RunConfig: spikeguard.train.config checks the model, the
    layout (pp x ep x dp processes, layers per stage, experts per rank, micro-batches per
    stage) and the skew exactly as `train` will, before any process starts."""
    from spikeguard.train.config import RunConfig

    model = {"preset": args.preset, **{k: getattr(args, k) for k in ("num_layers", "num_experts")
                                        if getattr(args, k) is not None}}
    train = {"steps": args.steps, "batch_size": args.batch_size, "seed": args.seed}
    if args.micro_batches is not None:
        train["micro_batches"] = args.micro_batches
    skew = {} if args.trace is not None else {
        "pattern": args.pattern, "seed": args.skew_seed, "spike_prob": args.spike_prob,
        "spike_max": args.spike_max, "spike_from_layer": args.spike_from_layer}
    return RunConfig.from_dict({
        "model": model, "train": train, "skew": skew,
        "parallel": {"nproc": args.pp * args.ep * args.dp, "pp": args.pp, "ep": args.ep,
                     "schedule": args.schedule},
        "guard": {"policy": "none", "budget": NO_LIMIT},
        "files": {"trace": args.trace, "checkpoint_every": args.checkpoint_every}})
