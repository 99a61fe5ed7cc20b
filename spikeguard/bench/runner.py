"""The bench's jobs: real `spikeguard train` processes, killed by spikes and restarted.

Every policy trains the same model on the same data with the same routing (a recorded
trace, replayed exactly), as a real job would: under torchrun, expert-parallel, with
checkpoints. A static policy whose memory a spike overflows dies (exit 3, "out of memory
on rank R"); the runner restarts it from its last checkpoint with the crashed step's batch
dropped (as operators do; replaying it would crash again), and the restarted job re-does
the steps since that checkpoint. The wall clock of every job is kept so the lost time is
measured, not assumed.

Every job runs on the bench's reusable worker (spikeguard.bench.worker): the same rank
processes run job after job until one dies, so a short bench is not its process start-ups;
a crash is still the death of those processes, and the replacement's start-up is charged
to it (Job.wall_s).

Interleaving: the steps are cut into segments; segment by segment, every policy runs its
part (each part a job resuming from the policy's own checkpoint), in an order that rotates,
so machine noise in one minute hits all policies alike.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

from spikeguard.errors import UsageError

if TYPE_CHECKING:
    from spikeguard.bench.worker import WorkerPool

CRASH_MARK = "spikeguard: out of memory"
JOB_TIMEOUT_S = 1800


@dataclass
class Job:
    """One `spikeguard train` process tree (torchrun and its ranks)."""

    policy: str
    first_step: int          # the first step it trains (after resuming)
    last_step: int           # the step it was asked to reach
    wall_s: float
    crashed_step: Optional[int]
    records: list[dict]      # rank 0's log


@dataclass
class PolicyRun:
    """Everything one policy did over the bench."""

    policy: str
    jobs: list[Job] = field(default_factory=list)
    dropped: set[int] = field(default_factory=set)   # steps whose batch was dropped

    def final_records(self) -> list[dict]:
        """Per step, the record of the last job that ran it, plus a crash marker for each
        dropped step (the step the job died on)."""
        by_step: dict[int, dict] = {}
        for job in self.jobs:
            for record in job.records:
                by_step[record["step"]] = record
        for step in self.dropped:
            by_step[step] = {"step": step, "crashed": True, "skipped": True, "tokens": 0}
        return [by_step[s] for s in sorted(by_step)]


def read_log(path: Path) -> list[dict]:
    if not path.exists():
        return []
    with path.open() as f:
        return [json.loads(line) for line in f if line.strip()]


class JobRunner:
    """Runs `spikeguard train` with the common arguments plus a policy's own, on the
    bench's reusable worker (spikeguard.bench.worker: real processes, reused until a job
    kills them)."""

    def __init__(self, common: list[str], work: Path, nproc: int,
                 echo: Callable[[str], None] = lambda text: None,
                 pool: Optional["WorkerPool"] = None):
        from spikeguard.bench.worker import WorkerPool

        self.common = common
        self.work = work
        self.nproc = nproc
        self.echo = echo
        self.pool = pool if pool is not None else WorkerPool(work / "workers", nproc)
        self._count = 0
        self._crashed: Optional[Job] = None   # the last job that killed its worker

    def run(self, name: str, extra: list[str], first_step: int, last_step: int,
            policy: str) -> Job:
        from spikeguard.files import LineFile

        self._count += 1
        stem = self.work / "logs" / f"{self._count:03d}-{name}"
        stem.parent.mkdir(parents=True, exist_ok=True)
        log = stem.with_suffix(".jsonl")
        argv = ["train", *self.common, *extra, "--steps", str(last_step), "--log", str(log)]
        out, err = stem.with_suffix(".out"), stem.with_suffix(".err")
        for path in (out, err):   # created here, exclusively; the ranks append to them
            LineFile(path, mode="new", what="bench job output").close()
        code, wall, startup = self.pool.run(argv, out, err, JOB_TIMEOUT_S)
        if startup and self._crashed is not None:
            # The replacement worker's start-up is the crash's: a real restart pays it.
            self._crashed.wall_s += startup
        self._crashed = None
        records = read_log(log)
        stderr = err.read_text(errors="replace")
        crashed = None
        if code != 0:
            if CRASH_MARK not in stderr:
                tail = " | ".join(stderr.strip().splitlines()[-3:])
                raise UsageError(f"bench job {stem.name} failed (exit {code}): {tail}")
            crashed = (records[-1]["step"] if records else first_step - 1) + 1
        self.echo(f"  {name:<10} steps {first_step}-{last_step}: "
                  f"{'died on step ' + str(crashed) if crashed else 'done'} in {wall:.1f} s"
                  + (f" (+{startup:.1f} s worker start-up)" if startup else ""))
        job = Job(policy, first_step, last_step, wall, crashed, records)
        if crashed is not None:
            self._crashed = job
        return job


def run_policy_segment(runner: JobRunner, run: PolicyRun, policy_args: list[str],
                       ckpt: Path, first: int, last: int) -> None:
    """Train `run.policy` from step `first` to `last`, restarting after every crash."""
    start = first
    for _ in range(last - first + 2):   # at most one crash per step, then done
        extra = [*policy_args, "--checkpoint-dir", str(ckpt)]
        if start > 1:
            extra.append("--resume")
        if run.dropped:
            extra += ["--skip-steps", ",".join(str(s) for s in sorted(run.dropped))]
        job = runner.run(run.policy, extra, start, last, run.policy)
        run.jobs.append(job)
        if job.crashed_step is None:
            return
        run.dropped.add(job.crashed_step)
        start = checkpoint_step(ckpt) + 1
    raise UsageError(f"{run.policy}: crashed more often than it has steps")


def checkpoint_step(folder: Path) -> int:
    """The step of the committed checkpoint in `folder`: its manifest's (0 if none)."""
    from spikeguard.train.checkpoint import MANIFEST, read_manifest

    return int(read_manifest(folder)["step"]) if (folder / MANIFEST).exists() else 0
