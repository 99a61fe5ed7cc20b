"""The step-level safety net under expert parallelism, on the true (allocator-level) device.

Two spawned ranks (gloo, EP=2, tiny with 4 experts: 2 per rank). One rank's prevention is
blinded (every layer saves everything, no whole-layer recompute at entry, no layer-room
check) under a budget halfway between its forward and backward peaks, measured by the
independent meter on an uninterrupted run of the same job: its forward fits, its
backward does not. The device refuses at the limit as a GPU does (nothing is deferred):
the failed rank frees its attempt, makes the reverse exchanges its peer waits in, and
tells it at the step's end flag point (spikeguard.parallel.exchange_journal), so both
ranks abandon the step, restore the gradients they had before it (a warm-up backward
accumulated before attach) and re-run it with full recompute, with gradients bitwise
those of the uninterrupted job. The same for a forward that runs out: the micro-batch
again, on both ranks. And where nothing fits, every rank ends with the same line.

    .venv/bin/python -m pytest tests/parallel/test_parallel_true_device.py -q -p no:cacheprovider
"""

from __future__ import annotations

import json

import pytest
import torch

import true_device_workers as workers
from spikeguard.parallel.launch_utils import run_spawned

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]

WORLD = 2
SPAWN_TIMEOUT_S = 90     # a hung collective fails here, well inside the 180 s above
MIXED_TIMEOUT_S = 45     # the healthy three-step job takes under 10 s on 2 loaded cores


def _load(out_dir, scenario: str, rank: int) -> dict:
    return torch.load(out_dir / f"{scenario}_rank{rank}.pt", weights_only=False)


@pytest.fixture(scope="module")
def forced_run(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("true_device_ep")
    run_spawned(workers.forced_backward_oom_worker, WORLD, (str(out_dir), 0),
                store_path=out_dir / "store", timeout_s=SPAWN_TIMEOUT_S)
    return out_dir


def test_each_ranks_device_peak_is_the_meters(forced_run):
    """Under EP too, on every rank, the guard's reported peak is the independent meter's
    within 2% (the device also sees what gloo allocates on its threads and scratch inside
    one op; the meter sees neither)."""
    for rank in range(WORLD):
        ceiling = _load(forced_run, "ceiling", rank)
        seen, device = max(ceiling["peaks"].values()), ceiling["record"]["peak_bytes"]
        assert seen <= device <= 1.02 * seen, (rank, device, seen, device / seen)


def test_backward_oom_on_one_rank_reruns_both_with_uninterrupted_gradients(forced_run):
    for rank in range(WORLD):
        ceiling, forced = _load(forced_run, "ceiling", rank), _load(forced_run, "forced", rank)
        assert ceiling["record"]["safety_net_reruns"] == 0, rank
        record = forced["record"]
        # Both ranks went through the step-level net: the overflowing one, and the other
        # because the group agreed (otherwise it would be waiting in a collective).
        assert record["safety_net_reruns"] >= 1, (rank, record)
        assert record["safety_net"][0]["scope"] == "step", (rank, record["safety_net"])
        assert record["micro_batches"] == len(workers.MICRO_BATCH_SIZES)
        expected, actual = ceiling["grads"], forced["grads"]
        assert expected.keys() == actual.keys()
        differ = [n for n in expected
                  if actual[n] is None or not torch.equal(expected[n], actual[n])]
        assert not differ, f"rank {rank}: gradients differ from the uninterrupted job: {differ}"
    peaks = _load(forced_run, "ceiling", 0)["peaks"]
    budget = _load(forced_run, "forced", 0)["budget"]
    assert peaks["forward"] < budget < peaks["backward"], (peaks, budget)
    reasons = [_load(forced_run, "forced", r)["record"]["safety_net"][0]["reason"]
               for r in range(WORLD)]
    assert reasons[0] == reasons[1], reasons      # one agreed line on every rank
    assert reasons[0].startswith("rank 0 ran out of memory in backward"), reasons
    assert "on a device of" in reasons[0], reasons
    for rank in range(WORLD):   # nothing was let past the device, on either rank
        forced = _load(forced_run, "forced", rank)
        assert forced["meter_peak"] <= forced["budget"], (rank, forced)
        assert forced["record"]["peak_bytes"] <= forced["budget"], (rank, forced)


@pytest.mark.parametrize("policies", [("adaptive", "adaptive"), ("adaptive", "none")],
                         ids=["same", "mixed"])
def test_run_step_under_any_mix_of_policies_keeps_the_group_in_step(tmp_path, policies):
    """Three run_step steps, huge budgets. Ranks may run different policies (the
    per-micro-batch agreement is issued by every guard whatever its policy, and
    test_parallel_ep.py runs adaptive beside "none" under guard.step()); every rank must
    then issue the same collectives, or one waits forever on a collective the other
    skipped. "same" is the control: the job itself is sound."""
    run_spawned(workers.mixed_policy_run_step_worker, WORLD, (str(tmp_path), 3, policies),
                store_path=tmp_path / "store", timeout_s=MIXED_TIMEOUT_S)
    for rank in range(WORLD):
        assert _load(tmp_path, "mixed", rank)["steps"] == 3


def test_forward_oom_on_one_rank_reruns_the_micro_batch_on_both(tmp_path):
    """Rank 1 alone runs out in a forward (prevention blinded, a budget between full
    recompute's step peak and the all-saved forward peak): it frees the attempt, makes the
    exchanges its peer waits for and flags the next flag point; both ranks run that
    micro-batch again with full recompute, the step needs no step-level re-run, and the
    gradients are bitwise the uninterrupted job's. No rank's meter passes its budget."""
    run_spawned(workers.forced_forward_oom_worker, WORLD, (str(tmp_path), 1),
                store_path=tmp_path / "store", timeout_s=SPAWN_TIMEOUT_S)
    forced1 = _load(tmp_path, "fwd_forced", 1)
    assert forced1["full_peak"] < forced1["budget"] < forced1["forward_peak"], forced1
    for rank in range(WORLD):
        ceiling, forced = _load(tmp_path, "fwd_ceiling", rank), _load(tmp_path, "fwd_forced", rank)
        record = forced["record"]
        assert record["safety_net_reruns"] >= 1 and record["safety_net"] == [], (rank, record)
        assert record["micro_batches"] == len(workers.MICRO_BATCH_SIZES), record
        expected, actual = ceiling["grads"], forced["grads"]
        differ = [n for n in expected
                  if actual[n] is None or not torch.equal(expected[n], actual[n])]
        assert not differ, f"rank {rank}: gradients differ from the uninterrupted job: {differ}"
        assert forced["meter_peak"] <= forced["budget"], (rank, forced["meter_peak"])
        assert record["peak_bytes"] <= forced["budget"], (rank, record)


def test_a_rank_that_cannot_settle_its_backward_ends_the_job_with_one_line(tmp_path):
    """Rank 0's backward is refused while its caller still holds the attempt's graph and
    the device is full: it cannot allocate the zero rows of the exchanges its peer waits
    in, nor its flag point's row. It ends the job (its note in the job's store, the groups
    aborted): both ranks end with the same line, naming rank 0's backward, within
    seconds; no torch error escapes either rank."""
    run_spawned(workers.unsettled_backward_worker, WORLD, (str(tmp_path),),
                store_path=tmp_path / "store", timeout_s=SPAWN_TIMEOUT_S)
    r0, r1 = [json.loads((tmp_path / f"unsettled_rank{r}.json").read_text())
              for r in range(WORLD)]
    assert r0["ended"] is not None and r0["ended"] == r1["ended"], (r0, r1)
    assert r0["ended"].startswith("rank 0 ran out of memory in backward of micro-batch 0"), r0
    assert r0["seconds"] < 60 and r1["seconds"] < 60, (r0, r1)
