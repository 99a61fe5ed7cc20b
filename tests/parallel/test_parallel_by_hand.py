"""torchrun started by hand (the README's several-machines form, here on one machine): a
mistake or an out-of-memory ends in the failing rank's one line, the other ranks quiet.

    .venv/bin/python -m pytest tests/parallel/test_parallel_by_hand.py -q     # ~1 min

torchrun's own ChildFailedError table is torch's, printed by the torchrun process after
the ranks have gone; a rank cannot prevent it short of exiting 0, which would lie. With
`python -m spikeguard.parallel.quiet_torchrun` in place of `torchrun` (same arguments)
the job's whole stderr is that one line, with spikeguard's exit code (2 bad input, 3 out
of memory).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

TYPO = ["train", "--preset", "tiny", "--num-experts", "8", "--ep", "2", "--steps", "2",
        "--batch-size", "8", "--threads", "1", "--budgt", "1MiB"]
OOM = ["train", "--preset", "tiny", "--num-experts", "8", "--ep", "2", "--steps", "6",
       "--batch-size", "8", "--threads", "1", "--skew", "one-hot-rank", "--spike-prob", "0.5",
       "--spike-max", "2", "--budget", "auto", "--policy", "none"]
# Nothing fits, not even full recompute: the ranks agree on one line (docs/recovery.md).
AGREED = ["train", "--preset", "tiny", "--num-experts", "8", "--ep", "2", "--steps", "3",
          "--batch-size", "8", "--skew", "one-hot-rank", "--spike-prob", "1", "--spike-max",
          "2", "--threads", "1", "--policy", "adaptive", "--budget", "1.5MiB"]
LAUNCHERS = {"torchrun": ["-m", "torch.distributed.run"],
             "quiet_torchrun": ["-m", "spikeguard.parallel.quiet_torchrun"]}


def _by_hand(launcher: str, argv: list[str]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPIKEGUARD_")}
    env.update(SPIKEGUARD_ARGV=json.dumps(argv), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, *LAUNCHERS[launcher], "--standalone",
                           "--nproc-per-node", "2", "-m", "spikeguard"],
                          capture_output=True, text=True, timeout=240, env=env)


def _spikeguard_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("spikeguard:")]


@pytest.mark.parametrize("argv, code, line", [
    (TYPO, 2, "spikeguard: error: unrecognized arguments: --budgt 1MiB"),
    (OOM, 3, "spikeguard: out of memory on rank 0: rank 0 ran out of memory in "),
    (AGREED, 3, "spikeguard: out of memory on rank "),
], ids=["typo", "out-of-memory", "agreed-end"])
@pytest.mark.parametrize("launcher", list(LAUNCHERS))
def test_a_failed_job_by_hand_ends_in_the_failing_ranks_one_line(launcher, argv, code, line):
    done = _by_hand(launcher, argv)
    said = f"exit {done.returncode}\n{done.stderr[-3000:]}"
    # The safety net's warnings before the end (one per re-run, by one rank) aside:
    err = [s for s in done.stderr.splitlines() if "re-running it with full recompute" not in s]
    # One spikeguard line from the whole job: no "interrupted by SIGTERM" from the rank
    # torchrun stopped, no "another rank failed" from the one whose collective broke.
    assert [s[:len(line)] for s in _spikeguard_lines(done.stderr)] == [line], said
    assert err and err[0].startswith(line), said   # before torchrun's own report, if any
    if launcher == "quiet_torchrun":
        assert done.returncode == code and len(err) == 1, said
    else:
        assert done.returncode == 1, said   # torchrun's exit code for a failed child
        assert "ChildFailedError" in done.stderr, said   # its table: torch's, after the line


@pytest.mark.parametrize("local_rank", ["0", "1"])
def test_only_each_machines_first_rank_says_a_mistake_every_rank_finds(local_rank):
    """Every rank parses the same SPIKEGUARD_ARGV: the machine's local rank 0 prints the
    line and exits 2 at once; the others say nothing and wait for torchrun's SIGTERM (here
    none comes: they exit 2 after the wait), so that they cannot print it a second time, or
    be first to fail, before torchrun stops them. A rank's environment as torchrun sets it,
    without torchrun: the mistake is found before any process group is joined."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPIKEGUARD_")}
    env.update(SPIKEGUARD_ARGV=json.dumps(TYPO), RANK=local_rank, LOCAL_RANK=local_rank,
               WORLD_SIZE="2")
    done = subprocess.run([sys.executable, "-m", "spikeguard"], capture_output=True,
                          text=True, timeout=120, env=env)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert lines == ([] if local_rank == "1" else
                     ["spikeguard: error: unrecognized arguments: --budgt 1MiB "
                      "(see 'spikeguard --help')"]), done.stderr
