"""A 2-rank torchrun job of a worker script: the launch, the hang timeout and the exit
check the HF layout and EP tests share. A hung job is ended through torchrun: SIGTERM to
it, which ends its workers (torch's elastic agent starts each worker in a session of its
own, so a kill of torchrun's session alone leaves them running, hung: seen, two orphans
after a forced hang); the session is killed only if that does not end it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest


def torchrun_job(worker: Path, args: list, timeout_s: int, what: str = "") -> tuple[int, str]:
    """Run `worker *args` on 2 gloo ranks under torchrun (--standalone): its exit code and
    stderr. Fails the test on a hang, after ending the job and its workers (module doc)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--standalone", str(worker), *map(str, args)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        _, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.terminate()   # torchrun ends its workers (SIGTERM, then SIGKILL after 30 s)
        try:
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
        pytest.fail(f"the torchrun job{' ' + what if what else ''} did not finish in "
                    f"{timeout_s} s (hang)")
    return proc.returncode, err


def run_two_ranks(worker: Path, out_dir: Path, timeout_s: int) -> list[dict]:
    """Run `worker out_dir` on 2 ranks; each rank's rank{r}.json record, rank 0 first.
    Fails the test on a hang or a non-zero exit."""
    code, err = torchrun_job(worker, [out_dir], timeout_s)
    assert code == 0, err[-3000:]
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in (0, 1)]
