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
import subprocess
import sys
from dataclasses import dataclass
from typing import Optional, Sequence

from spikeguard.errors import UsageError

GROUP_TIMEOUT_S = 120  # a rank blocked this long in a collective gives up


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or (
        "RANK" in os.environ and "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ)


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


USAGE_DIR_ENV = "SPIKEGUARD_USAGE_DIR"
USAGE_EXIT = 2   # a rank's usage error (spikeguard.cli): quiet_torchrun passes it on


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


def relaunch_under_torchrun(nproc: int, argv: Sequence[str],
                            usage_dir: Optional[str] = None) -> int:
    """Run `spikeguard <argv>` on `nproc` local processes; returns torchrun's exit code.

    The arguments travel in an environment variable, not on torchrun's command line: its
    parser takes abbreviations, so `--nproc` or `--log` after `-m spikeguard` would be
    read as its own `--nproc-per-node` / `--log-dir` (Python 3.11 argparse). torchrun is
    run through spikeguard.parallel.quiet_torchrun, so that a failed rank's one line is
    not followed by torchrun's own traceback; exit 3 means a rank ran out of memory."""
    cmd = [sys.executable, "-m", "spikeguard.parallel.quiet_torchrun", "--standalone",
           f"--nproc-per-node={nproc}", "-m", "spikeguard"]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
               PYTHONUNBUFFERED="1")
    env[ARGV_ENV] = json.dumps(list(argv))
    if usage_dir is not None:
        env[USAGE_DIR_ENV] = usage_dir
    return subprocess.call(cmd, env=env)


def launch_job(nproc: int, argv: Sequence[str]) -> int:
    """The launching process's whole job: relaunch under torchrun and turn its exit code
    into the command's (0 done, 2 a rank's usage error, printed here once however many
    ranks found it; 3 a rank failed, the rank printed why)."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="spikeguard-usage-") as usage_dir:
        code = relaunch_under_torchrun(nproc, argv, usage_dir)
        errors = usage_errors(usage_dir)
    if errors or code == USAGE_EXIT:
        for line in errors or ["spikeguard: error: a rank refused its input (torchrun exit 2)"]:
            sys.stderr.write(line + "\n")
        return USAGE_EXIT
    if code:
        print(f"spikeguard: a rank failed (torchrun exit {code}); its message is above",
              file=sys.stderr)
        return 3
    return 0


def worker_argv() -> Optional[list[str]]:
    """The arguments a relaunched worker was given (None outside such a worker)."""
    if under_torchrun() and ARGV_ENV in os.environ:
        return json.loads(os.environ[ARGV_ENV])
    return None


@dataclass
class Worker:
    """This process's place in the group."""

    rank: int
    world_size: int
    group: object

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_worker(timeout_s: float = GROUP_TIMEOUT_S) -> Optional[Worker]:
    """Join the process group torchrun set up (None when not under torchrun)."""
    if not under_torchrun():
        return None
    import torch
    import torch.distributed as dist

    # The first checkpoint imports torch._dynamo, which then holds on to an existing group
    # and keeps it from shutting down cleanly: import it first (see launch_utils.init_gloo).
    import torch._dynamo  # noqa: F401

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    return Worker(dist.get_rank(), dist.get_world_size(), dist.group.WORLD)
