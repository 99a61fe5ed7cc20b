"""A 2-rank torchrun job of a worker script that writes rank{r}.json into a folder: the
launch, the hang timeout and the exit check the HF layout tests share."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


def run_two_ranks(worker: Path, out_dir: Path, timeout_s: int) -> list[dict]:
    """Run `worker out_dir` on 2 gloo ranks under torchrun (--standalone); each rank's
    JSON record, rank 0 first. Fails the test on a hang or a non-zero exit."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--standalone", str(worker), str(out_dir)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the torchrun job did not finish in {timeout_s} s (hang)")
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in (0, 1)]
