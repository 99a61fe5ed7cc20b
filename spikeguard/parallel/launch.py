"""Launching expert-parallel training: torchrun outside, a process group inside.

`spikeguard train --nproc 2 --ep 2 ...` validates the layout before any process starts,
then re-runs the same command under torchrun (`python -m torch.distributed.run
--standalone --nproc-per-node N -m spikeguard train ...`). Each worker joins a process
group (gloo on CPU, NCCL on CUDA) with a timeout, shards the experts and trains. If a rank
dies, torchrun stops the others; a rank blocked in a collective gives up at the timeout.

Several machines: set the arguments in SPIKEGUARD_ARGV (a JSON list, so torchrun's own
parser never sees them) and run on each node
    SPIKEGUARD_ARGV='["train", "--ep", "8", "--budget", "60GiB"]' \\
    torchrun --nnodes 2 --node-rank K --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        --nproc-per-node 4 -m spikeguard
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Optional, Sequence

from spikeguard.errors import UsageError

GROUP_TIMEOUT_S = 120  # a rank blocked this long in a collective gives up


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or (
        "RANK" in os.environ and "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ)


def by_hand() -> bool:
    """A rank of a torchrun the user started (the several-machines form), not one of
    spikeguard's launcher, which prints the job's final line itself."""
    return under_torchrun() and LAUNCHER_ENV not in os.environ


HAND_STOP_WAIT_S = 5.0   # how long a quiet rank of a torchrun by hand waits to be stopped


def wait_to_be_stopped_by_hand() -> None:
    """A rank of a torchrun by hand whose job's line another rank prints: wait for the
    SIGTERM torchrun sends every rank once one has exited (the default action, silent),
    so that the rank that printed is the first torchrun sees fail, its root cause. The
    wait is bounded: a torchrun that never stops it (its peer is on another machine and
    still running) then sees the agreed exit code (the caller's)."""
    import signal
    import time

    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    deadline = time.monotonic() + HAND_STOP_WAIT_S
    while time.monotonic() < deadline:
        time.sleep(0.05)


def check_layout(nproc: int, ep: int, num_experts: int) -> None:
    """Every layout mistake, before any process group starts."""
    if nproc < 1 or ep < 1:
        raise UsageError(f"--nproc and --ep must be positive, got {nproc} and {ep}")
    if nproc % ep:
        raise UsageError(f"expert-parallel size {ep} must divide the number of processes {nproc}")
    if num_experts % ep:
        raise UsageError(f"expert-parallel size {ep} must divide the number of experts "
                         f"({num_experts})")
    if ep != nproc:
        raise UsageError(f"--ep {ep} with --nproc {nproc} needs data parallelism over the "
                         f"rest, which is not built yet: use --ep {nproc}")


ARGV_ENV = "SPIKEGUARD_ARGV"
LAUNCHER_ENV = "SPIKEGUARD_LAUNCHER_PID"   # every process of a launched job carries it
TORCHRUN_ENV = "SPIKEGUARD_TORCHRUN_PID"   # set by quiet_torchrun for its ranks
FAILURES_ENV = "SPIKEGUARD_FAILURES"       # where quiet_torchrun writes which ranks failed
USAGE_DIR_ENV = "SPIKEGUARD_USAGE_DIR"     # where the ranks write their usage errors
USAGE_EXIT = 2   # a rank's usage error (spikeguard.cli): quiet_torchrun passes it on
# A forwarded SIGINT/SIGTERM gets this long to end the job before everything left is
# SIGKILLed; torchrun's own grace before it kills its ranks is shorter.
STOP_GRACE_S = 6.0
TORCHRUN_SHUTDOWN_S = 4


def torchrun_command(nproc: int) -> list[str]:
    return [sys.executable, "-m", "spikeguard.parallel.quiet_torchrun", "--standalone",
            f"--nproc-per-node={nproc}", f"--shutdown-timeout={TORCHRUN_SHUTDOWN_S}",
            "-m", "spikeguard"]


def launch_job(nproc: int, argv: Sequence[str]) -> int:
    """Run `spikeguard <argv>` on `nproc` local processes under torchrun; the command's
    exit code: 0 done, 130 / 143 stopped by SIGINT / SIGTERM, else the failed rank's.

    The arguments travel in an environment variable, not on torchrun's command line: its
    parser takes abbreviations, so `--nproc` or `--log` after `-m spikeguard` would be
    read as its own `--nproc-per-node` / `--log-dir` (Python 3.11 argparse). torchrun is
    run through spikeguard.parallel.quiet_torchrun, so that a failed rank's one line is
    not followed by torchrun's own traceback.

    torchrun starts in its own session (a terminal's Ctrl-C reaches this process only,
    as a scheduler's SIGTERM does) and each rank in its own (torchrun's doing): a signal
    to this process is forwarded to every process of the job, found by the variable
    LAUNCHER_ENV they all inherit, and whatever is left after STOP_GRACE_S is SIGKILLed.
    If this process is SIGKILLed, torchrun and the ranks follow through PR_SET_PDEATHSIG
    (watch_parent)."""
    fd, failures_path = tempfile.mkstemp(prefix="spikeguard-failures-", suffix=".json")
    os.close(fd)
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
               PYTHONUNBUFFERED="1")
    env[ARGV_ENV] = json.dumps(list(argv))
    env[LAUNCHER_ENV] = str(os.getpid())
    env[FAILURES_ENV] = failures_path
    with tempfile.TemporaryDirectory(prefix="spikeguard-usage-") as usage_dir:
        env[USAGE_DIR_ENV] = usage_dir
        try:
            job = _Job(subprocess.Popen(torchrun_command(nproc), env=env,
                                        start_new_session=True))
            code = job.run()
            failures = read_failures(failures_path)
        finally:
            os.unlink(failures_path)
        errors = usage_errors(usage_dir)
    if job.signum is None and (errors or code == USAGE_EXIT):
        # Every rank usually finds the same mistake: each distinct line once, exit 2.
        for line in errors or ["spikeguard: error: a rank refused its input (torchrun exit 2)"]:
            sys.stderr.write(line + "\n")
        return USAGE_EXIT
    if job.signum is not None:
        name = signal.Signals(job.signum).name
        print(f"spikeguard: stopped by {name}: torchrun and its {nproc} ranks ended",
              file=sys.stderr)
        return 128 + job.signum
    if code == 0:
        return 0
    line, exit_code = describe_failure(failures, code)
    print(f"spikeguard: {line}", file=sys.stderr)
    return exit_code


class _Job:
    """torchrun's process while it runs, with SIGINT/SIGTERM forwarded to the whole job."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc
        self.signum: Optional[int] = None
        self.kill_at: Optional[float] = None

    def run(self) -> int:
        handlers = {sig: signal.signal(sig, self._on_signal)
                    for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            while True:
                try:
                    code = self.proc.wait(timeout=0.1)
                    break
                except subprocess.TimeoutExpired:
                    if self.kill_at is not None and time.monotonic() >= self.kill_at:
                        self._signal_job(signal.SIGKILL)
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
        # torchrun is gone: no rank may outlive it (one it lost track of, or one still
        # stopping after a forwarded signal gets the rest of the grace).
        deadline = self.kill_at if self.kill_at is not None else time.monotonic()
        while job_processes(os.getpid()) and time.monotonic() < deadline:
            time.sleep(0.1)
        self._signal_job(signal.SIGKILL)
        end = time.monotonic() + 5
        while job_processes(os.getpid()) and time.monotonic() < end:
            time.sleep(0.05)
        return code

    def _on_signal(self, signum, frame) -> None:
        if self.signum is None:
            self.signum = signum
            self.kill_at = time.monotonic() + STOP_GRACE_S
            self._signal_job(signum)
        else:                       # a second Ctrl-C: stop waiting
            self.kill_at = time.monotonic()

    def _signal_job(self, sig: int) -> None:
        for pid in {self.proc.pid, *job_processes(os.getpid())}:
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass


def job_processes(launcher_pid: int) -> list[int]:
    """Live processes that carry LAUNCHER_ENV=launcher_pid (Linux /proc; zombies carry
    no environment)."""
    marker = f"{LAUNCHER_ENV}={launcher_pid}".encode()
    found = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return found
    for entry in entries:
        if not entry.isdigit() or int(entry) == launcher_pid:
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if marker in f.read().split(b"\0"):
                    found.append(int(entry))
        except OSError:
            continue
    return found


def read_failures(path: str) -> list[dict]:
    try:
        with open(path) as f:
            text = f.read()
        return json.loads(text) if text else []
    except (OSError, ValueError):
        return []


# Exit codes a rank gives for its own reason (spikeguard.cli). Exit 1 is most often a
# consequence (a peer's broken collective), and SIGTERM / SIGINT (or 143 / 130) is how
# torchrun stops the ranks left once one failed.
_RANK_REASONS = {3: "ran out of memory", 2: "stopped on a usage error"}
_STOPPING = {-signal.SIGTERM, -signal.SIGINT, 128 + signal.SIGTERM, 128 + signal.SIGINT}


def describe_failure(failures: list[dict], torchrun_code: int) -> tuple[str, int]:
    """The final line and exit code of a job whose ranks failed, naming the root cause:
    a rank killed by a signal (other than torchrun's own SIGTERM), then a rank that gave
    a reason of its own, then any other exit code, then exit 1, then the stopped ones."""
    def order(f: dict) -> tuple:
        code = f["exitcode"]
        if code in _STOPPING:
            return (4, f["rank"])
        return (0 if code < 0 else 1 if code in _RANK_REASONS else 3 if code == 1 else 2,
                f["rank"])

    if not failures:
        return f"the job failed (torchrun exit {torchrun_code})", 1
    first = min(failures, key=order)
    rank, code = first["rank"], first["exitcode"]
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"rank {rank} was killed by {name}; the job stopped", 1
    if code in _RANK_REASONS:
        return f"rank {rank} {_RANK_REASONS[code]} (exit {code}, its message is above)", code
    return f"rank {rank} failed with exit code {code}; the job stopped", 1


def rank_usage_file() -> Optional[str]:
    """Where a relaunched rank writes its usage error for the launcher to print once (None
    outside a rank started by launch_job: print it)."""
    folder = os.environ.get(USAGE_DIR_ENV)
    if folder is None or not under_torchrun():
        return None
    return os.path.join(folder, f"rank{os.environ.get('RANK', '0')}.txt")


def usage_errors(folder: str) -> list[str]:
    """The ranks' usage errors, each distinct line once, in rank order."""
    lines: list[str] = []
    names = sorted(os.listdir(folder), key=lambda n: int("".join(filter(str.isdigit, n)) or 0))
    for name in names:
        with open(os.path.join(folder, name), encoding="utf-8", errors="replace") as f:
            for line in f.read().splitlines():
                if line and line not in lines:
                    lines.append(line)
    return lines


def rank_started() -> None:
    """In a rank under torchrun: end with torchrun, even if it is SIGKILLed."""
    if under_torchrun():
        ppid = os.environ.get(TORCHRUN_ENV)
        watch_parent(int(ppid) if ppid else None)


def watch_parent(expected_ppid: Optional[int], sig: int = signal.SIGTERM) -> None:
    """Get `sig` when the parent process dies (Linux PR_SET_PDEATHSIG), so a job whose
    launcher was SIGKILLed does not train on. The kernel ties it to the parent *thread*:
    torchrun and the launcher start their children from their main threads. If the
    parent is already gone (it died before this ran), act now."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    PR_SET_PDEATHSIG = 1
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if expected_ppid is not None and os.getppid() != expected_ppid:
        os.kill(os.getpid(), sig)


def worker_argv() -> Optional[list[str]]:
    """The arguments a relaunched worker was given (None outside such a worker); a
    UsageError unless SPIKEGUARD_ARGV is a JSON list of strings (set by hand on several
    machines, it may be anything)."""
    if not (under_torchrun() and ARGV_ENV in os.environ):
        return None
    text = os.environ[ARGV_ENV]
    try:
        argv = json.loads(text)
    except ValueError as err:   # JSONDecodeError, and what a lone surrogate gives
        raise UsageError(f"{ARGV_ENV} is not JSON ({err}); write the arguments as a JSON "
                         f"list, e.g. {ARGV_ENV}='[\"train\", \"--ep\", \"8\"]'") from None
    if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
        raise UsageError(f"{ARGV_ENV} must be a JSON list of strings (the spikeguard "
                         f"arguments), got {text[:60]!r}")
    return argv


@dataclass
class Worker:
    """This process's place in the group."""

    rank: int
    world_size: int
    group: object
    owned: bool = True   # this call created the group (so the run ends it), or joined one

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_worker(timeout_s: float = GROUP_TIMEOUT_S) -> Optional[Worker]:
    """Join the process group torchrun set up (None when not under torchrun). A process
    that is in one already (the bench's reusable worker: spikeguard.bench.worker) gets
    that group, not owned: the run that asked must leave it alive."""
    if not under_torchrun():
        return None
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return Worker(dist.get_rank(), dist.get_world_size(), dist.group.WORLD, owned=False)

    # The first checkpoint imports torch._dynamo, which then holds on to an existing group
    # and keeps it from shutting down cleanly: import it first (see launch_utils.init_gloo).
    import torch._dynamo  # noqa: F401

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    return Worker(dist.get_rank(), dist.get_world_size(), dist.group.WORLD)
