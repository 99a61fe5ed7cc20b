"""Hugging Face models under transformers' own expert parallelism, on real torchrun jobs.

A tiny Qwen3-MoE, `DistributedConfig(fsdp_size=2, ep_size=2)` on 2 gloo ranks (CPU), each
rank its own data; the worker (hf_ep_worker.py) runs the checks and writes what it found.
One job for every check but the last, which ends its job on purpose (rank 0 dies).

    .venv/bin/python -m pytest tests/integrations/test_integrations_hf_ep.py -q
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]

WORKER = Path(__file__).with_name("hf_ep_worker.py")
JOB_TIMEOUT_S = 120   # a hung collective fails here (the group's own timeout is longer)
BATCH_TOKENS = 4 * 33   # hf_ep_worker.py: BATCH sequences of SEQ + 1 tokens a micro-batch
CHECKS = ("policies", "bytes", "hookless", "walk", "tight", "mixed", "votes", "fallback", "spike")


def torchrun(out_dir: Path, *checks: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--standalone", str(WORKER), str(out_dir), *checks]
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the torchrun job of {checks} did not finish in {JOB_TIMEOUT_S} s (hang)")


@pytest.fixture(scope="module")
def found(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("hf_ep")
    done = torchrun(out_dir, *CHECKS)
    assert done.returncode == 0, done.stderr[-3000:]

    def read(check, rank):
        return json.loads((out_dir / f"{check}_rank{rank}.json").read_text())
    read.out_dir = out_dir
    return read


RANKS = (0, 1)


@pytest.mark.parametrize("rank", RANKS)
def test_every_policy_gives_the_unguarded_layouts_gradients_bitwise(found, rank):
    for policy, got in found("policies", rank).items():
        assert got["differ"] == [], (policy, got)
    got = found("policies", rank)
    assert got["none"]["decisions"]["save"] == 4
    assert got["experts"]["decisions"]["recompute"] == 4
    assert got["offload"]["decisions"]["offload"] == 4


@pytest.mark.parametrize("rank", RANKS)
def test_the_device_counts_the_sharded_state_and_the_step_as_the_meter_does(found, rank):
    none = found("policies", rank)["none"]
    # The meter misses kernels' scratch and DTensor-level outputs: the device counts a
    # little more, never less (measured 2.0% more on both ranks).
    assert none["meter_peak"] <= none["device_peak"] <= 1.05 * none["meter_peak"]


@pytest.mark.parametrize("rank", RANKS)
def test_the_byte_model_is_what_the_experts_call_keeps_on_the_received_rows(found, rank):
    for layer, got in found("bytes", rank).items():
        assert got["rows"] > 0
        # derived for the EP call (top-1, unit weights); the rest is the call's per-expert
        # offsets (L int32), which do not grow with the rows
        assert 0 <= got["kept"] - got["predicted"] <= 64, (layer, got)


@pytest.mark.parametrize("rank", RANKS)
@pytest.mark.parametrize("policy", ["none", "adaptive"])
def test_experts_calls_run_hookless_and_change_nothing_but_the_hook(found, rank, policy):
    """Under transformers' EP the experts call (on the received rows) runs with no
    saved-tensor hook where proven, and the later layer whole (runtime/hookless.py);
    against the same guard with every layer hooked: the same gradients (the unguarded
    layout's, bitwise), the same true peak by the independent meter, the ledger empty
    after backward; the modelled "experts" the byte model's bytes, at most the call's
    per-expert offsets (L int32) under what the hook measured; layer 0's other parts
    exactly what the hook measured, layer 1's as layer 0 measured them (up to 2% over:
    layer 0 also saved the rotary tables the layers share)."""
    found_on, found_off = (found("hookless", rank)[f"{policy},{on}"] for on in (True, False))
    assert found_on["hookless_layers"] == 4 and found_off["hookless_layers"] == 0
    for got in (found_on, found_off):
        assert got["differ"] == [] and got["left"] == 0 and got["reruns"] == 0, got
    assert found_on["meter_peak"] == found_off["meter_peak"]
    assert found_on["peak"] == found_off["peak"]
    for key, want in found_off["seen"].items():
        got = found_on["seen"][key]
        mb, layer, op = key.split(",")
        if op == "experts":
            assert want > 0 and 0 <= want - got <= 64, (key, got, want)
        elif layer == "0":
            assert got == want, (key, got, want)
        else:
            assert want <= got <= 1.02 * want, (key, got, want)


@pytest.mark.parametrize("rank", RANKS)
def test_the_proofs_walk_steps_layer_to_layer_by_what_layers_left(found, rank):
    """Under EP the hookless proof walks the later layers' decisions from layer to layer
    by what a layer was seen to leave on the device and to grow to its decision
    (runtime/routed_history.py `LayerSteps`), not by the deciding layer's growth, which on
    transformers' EP holds the exchanges' buffers that the layer frees at its end. Once
    every layer has its history (the last two of four calm steps of the same batches):
    never below the in-use the later layer decided at by more than one exchange buffer
    (the rows a rank sends, tokens x top-k x width x 4 B: 33 KiB here; identical steps
    decide with one more or one fewer alive, as gloo's thread and Python's collector let
    it go: seen 0 to 1 of them), and, summed, below the bound's overshoot without them by
    more than one such buffer (seen 1.5-36 KB against 62-143 KB a layer)."""
    got = found("walk", rank)
    sent_bytes = BATCH_TOKENS * 2 * 32 * 4   # top-2, width 32, float32
    over = {name: [p - actual for step in got[name][2:] for p, actual in step]
            for name in ("seen", "bound")}
    assert over["seen"] and min(over["seen"]) >= -sent_bytes, over
    assert sum(over["seen"]) < sum(over["bound"]) - sent_bytes, over


@pytest.mark.parametrize("rank", RANKS)
def test_adaptive_under_tight_budgets_is_bitwise_and_stays_under(found, rank):
    for frac, got in found("tight", rank).items():
        assert got["differ"] == [], (frac, got)
        assert got["peak"] <= got["budget"], (frac, got)


@pytest.mark.parametrize("rank", RANKS)
def test_ranks_deciding_differently_complete_bitwise(found, rank):
    got = found("mixed", rank)
    for mine in ("experts", "offload", "adaptive"):
        assert got[mine]["differ"] == [], (mine, got[mine])
    assert got["experts"]["decisions"]["recompute" if rank == 0 else "save"] == 4
    assert "policy 'full' must be every rank's" in got["full_one_rank"]


@pytest.mark.parametrize("rank", RANKS)
def test_once_every_rank_promises_the_later_layers_do_not_vote(found, rank):
    """A layer's vote on the whole-layer fallback is an all-gather, a sync point of the
    group (four of them 12 ms of a 330 ms calm step of qwen3_moe EP=2, CPU). Where every
    rank promises at a vote that no later layer of the micro-batch needs the fallback
    (runtime/window.py `promise`), the later layers cast none: from the second step on,
    one vote per micro-batch (2) instead of one per layer and micro-batch (2 x 2);
    gradients bitwise alike, nothing re-run; every step's peak within the budget by the
    independent meter (tests/meter.py, around each step, the model's state after attach
    as baseline, the guard's host memory apart), as well as by the guard's device."""
    got = found("votes", rank)
    assert got["every_layer"]["votes"] == [4, 4, 4], got
    # the budget held with experts calls hookless under the proof (runtime/hookless.py)
    assert sum(got["promised"]["hookless"]) > 0, got
    assert got["promised"]["votes"][1:] == [2, 2], got
    for name in ("promised", "every_layer"):
        assert got[name]["differ"] == [] and got[name]["reruns"] == 0, (name, got)
        assert got[name]["peak"] <= got[name]["budget"], (name, got)
        assert max(got[name]["meter_peaks"]) <= got[name]["budget"], (name, got)


@pytest.mark.parametrize("rank", RANKS)
def test_a_whole_layer_fallback_forced_on_one_rank_is_taken_by_both(found, rank):
    """Forced on rank 1's third step; rank 0's forwards run calm then and vote from their
    calm layers (runtime/layers.py): with no vote, or no whole layer where the group's
    carries, rank 0's backward would not re-issue the exchanges rank 1's recompute makes
    (seen: the job broken, "Connection reset by peer")."""
    got = found("fallback", rank)
    assert got["differ"] == []
    # layer 1 recomputed whole on both ranks, in both micro-batches; layer 0 kept
    assert got["decisions"] == {"save": 2, "recompute": 2, "offload": 0}
    # Rank 0's forwards of that step run calm, at least one: a calm forward left calm where
    # the device's figure passed the start walk's by a few bytes of gloo's own buffers
    # (CI, 12-07: 1 of 2; 2 of 2 alone here); since 2ef613f it stays within the walk's
    # room, but the assertion was kept. The vote and the whole layer are shown from a calm
    # layer in either case
    if rank == 0:
        assert got["calm"] >= 1, got


@pytest.mark.parametrize("rank", RANKS)
def test_a_2x_spike_on_one_rank_stays_under_the_budget_under_adaptive(found, rank):
    got = found("spike", rank)
    assert got["calm"]["peak"] <= got["budget"] and got["spike"]["peak"] <= got["budget"]
    assert got["spike"]["reruns"] == 0
    if rank == 0:   # the hot rank moved its spiked experts calls off the device
        assert got["spike"]["decisions"]["save"] < 4


def test_the_same_spike_kills_none_on_the_hot_rank_with_one_line(found):
    done = torchrun(found.out_dir, "spike_none")   # under the spike check's budget
    assert done.returncode != 0
    lines = [ln for ln in done.stderr.splitlines() if ln.startswith("spikeguard:")]
    assert len(lines) == 1 and "out of memory on rank 0" in lines[0], done.stderr[-3000:]
    assert "on a device of" in lines[0]
