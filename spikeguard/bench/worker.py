"""The bench's reusable worker: one torchrun job whose ranks run `spikeguard train` jobs one
after another, in the same processes, until one of them fails.

Before, every part of every policy was a new `spikeguard train` process tree (launcher,
torchrun, one Python per rank, each importing torch): a 40-step `tiny` bench was 49 such
start-ups and took 7.5 minutes here, nearly all of it start-up. Now the bench starts this
worker once; each job is a file the ranks read, and they run it as `spikeguard <argv>`
would (spikeguard.cli.main: the same parser, checks, exit codes and one-line messages), with
their stdout and stderr sent to the job's own .out / .err files.

A crash stays a real process death: a rank whose job fails (out of memory under a static
policy: exit 3) leaves the process at once, as a launched rank always does (cli._exit_now);
torchrun stops the others and exits, and the bench starts a fresh worker for the next job,
charging its start-up to the crash (a real restart pays it too). Any layout runs in it (EP,
DP x EP, PP x EP): a job is a whole `train` command inside the worker's process group,
which the job's run uses rather than creates (spikeguard.parallel.launch.init_worker).

The protocol, in the worker's folder: `jobNNNN.json` ({"argv", "out", "err"}, written
atomically by the bench), `ready.rankR` once a rank has joined the group, `jobNNNN.rankR.done`
once rank R finished job NNNN, `stop` to end the worker.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Callable, Optional, Sequence

from spikeguard.errors import UsageError

WORKER_COMMAND = "bench-worker"   # SPIKEGUARD_ARGV's first word for a worker's ranks
POLL_S = 0.02
START_TIMEOUT_S = 300


def job_file(folder: Path, number: int) -> Path:
    return folder / f"job{number:04d}.json"


def done_file(folder: Path, number: int, rank: int) -> Path:
    return folder / f"job{number:04d}.rank{rank}.done"


# ---- in the ranks ---------------------------------------------------------------------------
def serve(folder: str, run: Callable[[list[str]], int]) -> int:
    """A rank of the worker: join the group once, then run each job with `run` (cli.main)
    until `stop` appears. A job that fails never returns here (its rank exits)."""
    import torch.distributed as dist

    from spikeguard.parallel.launch import init_worker

    where = Path(folder)
    worker = init_worker()
    rank = worker.rank if worker is not None else 0
    (where / f"ready.rank{rank}").touch()
    number = 0
    while True:
        number += 1
        spec_path = job_file(where, number)
        while not spec_path.exists():
            if (where / "stop").exists():
                from spikeguard.parallel.mesh import release_shared_meshes
                release_shared_meshes()
                if worker is not None:
                    dist.barrier()
                    dist.destroy_process_group()
                gc.collect()
                return 0
            time.sleep(POLL_S)
        spec = json.loads(spec_path.read_text(encoding="utf-8"))
        with _redirected(spec["out"], spec["err"]):
            try:
                code = run(list(spec["argv"]))
            except BaseException:
                # A bug, not a user's mistake (cli.main turns those into exit codes): the
                # traceback belongs in the job's .err, where the bench quotes from.
                traceback.print_exc()
                raise SystemExit(1) from None
        gc.collect()   # the job's model, guards and devices, before the next job's
        done_file(where, number, rank).write_text(str(code))


@contextlib.contextmanager
def _redirected(out: str, err: str):
    """This process's stdout and stderr (the file descriptors, so that everything written,
    by Python or not, lands there) go to the job's files while it runs."""
    saved = []
    for stream, path in ((sys.stdout, out), (sys.stderr, err)):
        stream.flush()
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
        saved.append((stream, os.dup(stream.fileno())))
        os.dup2(fd, stream.fileno())
        os.close(fd)
    try:
        yield
    finally:
        for stream, fd in saved:
            stream.flush()
            os.dup2(fd, stream.fileno())
            os.close(fd)


# ---- in the bench ---------------------------------------------------------------------------
class WorkerPool:
    """The bench's side: starts the worker when a job needs one, hands it jobs, notices
    when it died, and ends it. `startups` lists each start-up's seconds."""

    def __init__(self, folder: Path, nproc: int):
        self.folder, self.nproc = folder, nproc
        self.folder.mkdir(parents=True, exist_ok=True)
        self._proc: Optional[subprocess.Popen] = None
        self._dir: Optional[Path] = None
        self._count = 0        # workers started
        self._number = 0       # jobs handed to the current worker
        self._busy = False     # a job handed over and not done yet
        self.startups: list[float] = []

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> float:
        """Start a worker and wait until every rank joined its group; its seconds."""
        from spikeguard.parallel.launch import (ARGV_ENV, FAILURES_ENV, LAUNCHER_ENV,
                                                USAGE_DIR_ENV, torchrun_command)

        self._count += 1
        self._number = 0
        self._dir = self.folder / f"worker{self._count:02d}"
        (self._dir / "usage").mkdir(parents=True)
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        env[ARGV_ENV] = json.dumps([WORKER_COMMAND, str(self._dir)])
        env[LAUNCHER_ENV] = str(os.getpid())
        env[FAILURES_ENV] = str(self._dir / "failures.json")
        env[USAGE_DIR_ENV] = str(self._dir / "usage")
        start = time.perf_counter()
        with open(self._dir / "torchrun.out", "x") as out, \
                open(self._dir / "torchrun.err", "x") as err:
            self._proc = subprocess.Popen(torchrun_command(self.nproc), env=env, stdout=out,
                                          stderr=err, start_new_session=True)
        while not all((self._dir / f"ready.rank{r}").exists() for r in range(self.nproc)):
            if not self.alive or time.perf_counter() - start > START_TIMEOUT_S:
                tail = self._tail(self._dir / "torchrun.err")
                self.close()
                raise UsageError(f"the bench's worker did not start: {tail}")
            time.sleep(POLL_S)
        seconds = time.perf_counter() - start
        self.startups.append(seconds)
        return seconds

    def run(self, argv: Sequence[str], out: Path, err: Path,
            timeout_s: float) -> tuple[int, float, float]:
        """Run `spikeguard <argv>` on the worker (started first if none is alive): (exit
        code, seconds from hand-over to done or death, seconds of a start-up it waited
        for). A failed job's worker is gone afterwards, its final line in `err`."""
        startup = 0.0 if self.alive else self.start()
        assert self._dir is not None
        self._number += 1
        from spikeguard.files import atomic_write

        atomic_write(job_file(self._dir, self._number),
                     json.dumps({"argv": list(argv), "out": str(out), "err": str(err)}),
                     overwrite=False, what="bench job")
        done = [done_file(self._dir, self._number, r) for r in range(self.nproc)]
        start = time.perf_counter()
        self._busy = True
        while not all(p.exists() for p in done):
            if not self.alive:
                code = self._proc.wait()
                self._end_job_processes()
                self._report_death(err, code)
                self._proc, self._busy = None, False
                return code or 1, time.perf_counter() - start, startup
            if time.perf_counter() - start > timeout_s:
                self.close()
                raise UsageError(f"bench job {Path(out).stem} ran past {timeout_s:.0f} s")
            time.sleep(POLL_S)
        self._busy = False
        return 0, time.perf_counter() - start, startup

    def _report_death(self, err: Path, code: int) -> None:
        """The job's final line, as the launcher would print it (launch.describe_failure),
        after the ranks' own lines in the job's .err."""
        from spikeguard.parallel.launch import describe_failure, read_failures, usage_errors

        assert self._dir is not None
        lines = usage_errors(str(self._dir / "usage"))
        if not lines:
            lines = [f"spikeguard: {describe_failure(read_failures(str(self._dir / 'failures.json')), code)[0]}"]
        with open(err, "a", encoding="utf-8") as f:
            f.write("".join(line + "\n" for line in lines))

    def _end_job_processes(self, grace_s: float = 5.0) -> None:
        from spikeguard.parallel.launch import job_processes

        deadline = time.monotonic() + grace_s
        while job_processes(os.getpid()) and time.monotonic() < deadline:
            time.sleep(0.05)
        for pid in job_processes(os.getpid()):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)

    def close(self, grace_s: float = 10.0) -> None:
        """End the worker: an idle one is asked to stop; one in the middle of a job (the
        bench was interrupted) gets SIGTERM; whatever is left after `grace_s`, SIGKILL."""
        from spikeguard.parallel.launch import job_processes

        if self._dir is not None and self.alive:
            if self._busy:
                for pid in job_processes(os.getpid()):
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(pid, signal.SIGTERM)
            else:
                (self._dir / "stop").touch()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=grace_s)
        if self._proc is not None and self._proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.wait()
        self._proc = None
        self._busy = False
        self._end_job_processes(grace_s=1.0)

    @staticmethod
    def _tail(path: Path) -> str:
        try:
            lines = path.read_text(errors="replace").strip().splitlines()
        except OSError:
            return "(no output)"
        return " | ".join(lines[-3:]) or "(no output)"
