"""Under transformers' own EP, what spikeguard hands gloo is freed on the main thread.

gloo's worker thread drops a collective's work item, and with it the tensors it was
handed, some time after the wait returned; a tensor nothing else held was then freed on
that thread while the step went on, and a step's peak moved with the same data
(spikeguard.parallel.release). Traced on the recovery check's runs: the flag points' rows
(64 + 128 B an all-gather) were the most frequent, about 8 per rank and run, and moved
both ranks' metered peak by 192 B. Three guarded steps of the tiny Qwen3-MoE, fsdp 2,
ep 2 on 2 gloo ranks (hf_ep_release_worker.py): none of the flag points' storages is
freed off the main thread. (FSDP2's all-gather buffers, torch's backward all-to-alls and
transformers' dispatch are not spikeguard's calls: still freed there at times.)

    .venv/bin/python -m pytest tests/integrations/test_integrations_hf_ep_release.py -q
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from two_rank_job import torchrun_job

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(200)]

WORKER = Path(__file__).with_name("hf_ep_release_worker.py")
JOB_TIMEOUT_S = 150


def test_flag_points_let_go_before_the_step_goes_on(tmp_path):
    code, err = torchrun_job(WORKER, [tmp_path], JOB_TIMEOUT_S)
    assert code == 0, err[-3000:]
    for rank in (0, 1):
        late = json.loads((tmp_path / f"release_rank{rank}.json").read_text())
        assert late.get("flag point", 0) == 0, (rank, late)
