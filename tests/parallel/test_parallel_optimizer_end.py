"""An out-of-memory in the optimizer step under expert parallelism ends every rank together.

The device refuses inside AdamW's first step (its moments) as a GPU does, at the
allocation; the update may be half applied, so nothing re-runs. Every rank makes one flag
point after its optimizer steps (spikeguard.train.engines.optimizer_steps), so every rank
ends with the same line naming the rank that ran out: exit 3, no traceback, the line
printed once and the launcher's naming the same rank, no process of the job left.

    .venv/bin/python -m pytest tests/parallel/test_parallel_optimizer_end.py -q
"""

import time

import pytest
from test_parallel_agreed_end import _errors, _run
from test_parallel_signals import _job_pids   # processes of a launcher's job

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

# tiny at EP=2, 2 sequences per step, everything kept: the step's forward and backward
# peak is 825.5 KiB on rank 0 (the larger), AdamW's first step would reach 857 KiB on both.
EP2 = ["train", "--preset", "tiny", "--num-experts", "8", "--nproc", "2", "--steps", "2",
       "--batch-size", "2", "--threads", "1", "--policy", "none", "--budget", "0.82MiB"]


def test_an_optimizer_step_out_of_memory_ends_every_rank_with_one_agreed_line():
    proc, out, err = _run(EP2, timeout_s=240)
    assert proc.returncode == 3, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    lines = _errors(err)
    assert len(lines) == 2, lines      # the agreed line (once) and the launcher's
    assert lines[0].startswith("spikeguard: out of memory on rank 0: rank 0 ran out of "
                               "memory in the optimizer step (an allocation would have "
                               "put "), lines
    assert "also rank 1" in lines[0] and "the update may be half applied" in lines[0], lines
    assert lines[1].startswith("spikeguard: rank 0 ran out of memory (exit 3"), lines
    assert not [ln for ln in out.splitlines() if ln.startswith("step")], out   # no step stood
    time.sleep(1)
    assert _job_pids(proc.pid) == []
