"""A rank refused by its device under transformers' own expert parallelism, after exchanges.

A tiny Qwen3-MoE, `DistributedConfig(fsdp_size=2, ep_size=2)` on 2 gloo ranks (CPU), the
budget 1.05 x the calm step's device peak. Rank 1's device refuses an allocation at layer
1, after layer 0's exchanges (hf_ep_recovery_worker.py), as CUDA's allocator does: at once,
on that rank alone. In forward the family journal settles what rank 1's peer waits in and
every rank re-runs the micro-batch with full recompute: gradients bitwise the
uninterrupted layout's, the independent meter's peak under the budget on every rank (also
in a later step, where layer 1's vote was skipped on every rank's promise); also
where the refusal lands inside transformers' own dispatch (before its counts exchange) or
combine (before its all-to-all, where the peer waits in it; after it, where the peer has
gone on: settling a combine there hung the job until gloo's timeout, found by `train --hf qwen3_moe --nproc 2 --ep 2 --policy
none --budget 15.4MiB`). In
backward, after a calm step (whose backward's collectives the journal recorded), the
refused rank replays the rest of its backward's collectives with zeros and every rank
re-runs the step, bitwise, at the last layer and at the first, in either micro-batch, and
with a layer recomputed whole before the refusal; in the first step's backward (nothing
recorded: the rest is not known) and before a layer recomputed whole (the peer's
recompute would route on zeros) every rank ends in the same line, within seconds.

    .venv/bin/python -m pytest tests/integrations/test_integrations_hf_ep_recovery.py -q
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from two_rank_job import torchrun_job

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(200)]

WORKER = Path(__file__).with_name("hf_ep_recovery_worker.py")
JOB_TIMEOUT_S = 150   # a hung collective fails here (the group's own timeout is longer)


def found(tmp_path: Path, where: str) -> list[dict]:
    code, err = torchrun_job(WORKER, [tmp_path, where], JOB_TIMEOUT_S, f"of {where}")
    assert code == 0, err[-3000:]
    return [json.loads((tmp_path / f"{where}_rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.parametrize("where", ["window", "attention", "dispatch", "combine",
                                   "combine_output"])
def test_a_forward_refused_after_exchanges_is_re_run_by_every_rank_bitwise(tmp_path, where):
    ranks = found(tmp_path, where)
    for rank, got in enumerate(ranks):
        assert got["differ"] == [], (rank, got)
        assert got["reruns"] == 1, (rank, got)           # both ranks, the same re-run
        assert got["meter_peak"] <= got["budget"], (rank, got)
        assert got["peak"] <= got["budget"], (rank, got)


@pytest.mark.parametrize("where", ["attention_skipped", "window_skipped"])
def test_a_forward_refused_in_a_layer_whose_vote_was_skipped_is_re_run_bitwise(tmp_path,
                                                                               where):
    """After a calm step every rank promises at layer 0's vote (runtime/window.py
    `promise`), so layer 1 casts none; the refused rank then owes its peer layer 1's
    dispatch and combine, not a vote (family_journal.py `_settle`)."""
    ranks = found(tmp_path, where)
    for rank, got in enumerate(ranks):
        assert got["promised"][:1] == [True], (rank, got)   # layer 1 did not vote
        assert got["differ"] == [], (rank, got)
        assert got["reruns"] == 1, (rank, got)
        assert got["meter_peak"] <= got["budget"], (rank, got)
        assert got["peak"] <= got["budget"], (rank, got)


def test_a_backward_refused_ends_every_rank_with_the_same_line_in_seconds(tmp_path):
    ranks = found(tmp_path, "backward")
    lines = {got["ended"] for got in ranks}
    assert len(lines) == 1, ranks
    line = lines.pop()
    assert line.startswith("rank 1 ran out of memory in backward of micro-batch 0, layer 1"), line
    assert "on a device of" in line, line
    assert all(got["seconds"] < 20 for got in ranks), ranks


@pytest.mark.parametrize("where", ["later_backward_1", "later_backward_0",
                                   "later_backward_mb1", "later_backward_whole0"])
def test_a_backward_refused_after_a_calm_step_re_runs_the_step_on_every_rank(tmp_path,
                                                                                where):
    ranks = found(tmp_path, where)
    for rank, got in enumerate(ranks):
        assert "ended" not in got, (rank, got)
        assert got["differ"] == [], (rank, got)
        assert got["reruns"] == 1, (rank, got)           # the step, once, on both ranks
        assert len(got["step_reruns"]) == 1, (rank, got)
        assert got["step_reruns"][0].startswith("rank 1 ran out of memory in backward of "
                                                "micro-batch "), (rank, got)
        assert got["meter_peak"] <= got["budget"], (rank, got)
        assert got["peak"] <= got["budget"], (rank, got)
    assert ranks[0]["step_reruns"] == ranks[1]["step_reruns"]


@pytest.mark.parametrize("where", ["steady_backward_1", "steady_backward_0"])
def test_a_steady_backward_records_nothing_and_its_refusal_re_runs_bitwise(tmp_path, where):
    # Steps 1 and 2 watched (each micro-batch's span seen twice alike), steps 3 and 4 not:
    # the refusal in step 4 placed by the groups' sequence numbers alone.
    ranks = found(tmp_path, where)
    for rank, got in enumerate(ranks):
        assert "ended" not in got, (rank, got)
        step1, step2, step3, step4_to_refusal = got["watched"][:4]
        assert step1 > 0 and step2 > 0, (rank, got["watched"])
        assert step3 == 0 and step4_to_refusal == 0, (rank, got["watched"])
        assert got["differ"] == [], (rank, got)
        assert got["reruns"] == 1, (rank, got)
        assert len(got["step_reruns"]) == 1, (rank, got)
        assert got["step_reruns"][0].startswith("rank 1 ran out of memory in backward of "
                                                "micro-batch 0"), (rank, got)
        assert got["meter_peak"] <= got["budget"], (rank, got)
    assert ranks[0]["step_reruns"] == ranks[1]["step_reruns"]


def test_a_backward_refused_before_a_whole_layer_recompute_ends_every_rank(tmp_path):
    # The peer's recompute of that layer would route on the zeros replayed to it.
    ranks = found(tmp_path, "later_backward_whole1")
    lines = {got.get("ended") for got in ranks}
    assert len(lines) == 1 and None not in lines, ranks
    assert lines.pop().startswith("rank 1 ran out of memory in backward of micro-batch 0, "
                                  "layer 1"), ranks
    assert all(got["seconds"] < 20 for got in ranks), ranks
