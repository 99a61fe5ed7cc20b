"""transformers' own layout, `DistributedConfig(fsdp_size=2, ep_size=2)` (2 gloo ranks under
torchrun, CPU): FSDP2's units in the byte model, adaptive between full recompute's peak and
the all-saved peak keeps running.

The worker (hf_fsdp_worker.py) takes both peaks on the device's own counter (the worst
rank), then runs adaptive at 0.1, 0.5 and 0.9 of the way between them, 4 steps each: every
step's gradients `torch.equal` to the unguarded layout's, no safety-net re-run, the
device's peak under the budget on both ranks. (With the FSDP2 terms taken out, the same
sweep re-ran micro-batches on the way: the byte model is what makes it hold.)

    .venv/bin/python -m pytest tests/integrations/test_integrations_hf_fsdp.py -q
"""

from __future__ import annotations

from pathlib import Path

import pytest
from two_rank_job import run_two_ranks

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

WORKER = Path(__file__).with_name("hf_fsdp_worker.py")
JOB_TIMEOUT_S = 240


def test_adaptive_between_full_and_all_saved_under_distributed_config(tmp_path):
    for found in run_two_ranks(WORKER, tmp_path, JOB_TIMEOUT_S):
        assert found["peaks"]["full"] < found["peaks"]["none"], found["peaks"]
        for run in found["runs"]:
            assert run["differ"] == [], run
            assert run["reruns"] == 0, run
            assert run["peak"] <= run["budget"], run
        assert any(r["decisions"]["save"] for r in found["runs"])   # not all recomputed
