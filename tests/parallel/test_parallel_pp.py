"""Pipeline parallelism (torch.distributed.pipelining) composed with data and expert
parallelism, on real gloo process groups (spawned ranks, CPU, emulated device).

S = data shards (dp x ep), M = micro-batches per shard (4), B = sequences per micro-batch
(2). Each rank runs one step per scenario and saves its gradients; the parent compares
them with a single process running the same S x M micro-batches through the whole model
(gradient accumulation, loss / (S*M) each), and with the same layout's plain run.

    .venv/bin/python -m pytest tests/parallel/test_parallel_pp.py -q
"""

from __future__ import annotations

import pytest
import torch
from torch.multiprocessing import ProcessRaisedException

import pp_workers
from spikeguard.model import build_model, model_config
from spikeguard.parallel.launch_utils import run_spawned

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]

SPAWN_TIMEOUT_S = 150          # a hung collective fails the test here
MICRO_BATCHES, BATCH = 4, 2
HUGE = pp_workers.HUGE
# Float32 tolerance against the single process: the pipeline accumulates micro-batch
# gradients in another order, divides by M once at the end instead of scaling each loss,
# DDP averages shards, and the aux loss enters through its own backward; the largest
# difference measured on PP=2 was 1.8e-7.
ATOL = RTOL = 1e-5
# 4 layers: 2 per stage under 1F1B, 1 per stage (4 stages, 2 per rank) interleaved.
CFG = {"num_layers": 4}
CFG_EP = {"num_layers": 4, "num_experts": 8, "seq_len": 64}


def _s(name, policy, budget=HUGE, **extra) -> dict:
    return {"name": name, "policy": policy, "budget": budget, **extra}


PP_SCENARIOS = [
    _s("plain", "plain"), _s("calm", "none"), _s("full", "full"), _s("experts", "experts"),
    _s("offload", "offload"), _s("adaptive", "adaptive"),
    _s("tight", "adaptive", "range*0.5"),
    _s("i_plain", "plain", schedule="interleaved"), _s("i_full", "full", schedule="interleaved"),
    _s("i_tight", "adaptive", "range*0.5", schedule="interleaved"),
]
PP_EP_SCENARIOS = [
    _s("plain", "plain"), _s("calm", "none", calm=True, meter=True), _s("full", "full"),
    _s("tight", "adaptive", "range*0.5", meter=True),
    # The spike: stage 0's first micro-batch (warm-up) sends every token to ep rank 0.
    _s("spike_plain", "plain", spike=0),
    # On the device's true figure the warm-up spike moves rank 0's peak by ~8% at 64
    # tokens a sequence (~1% at 32, inside the run-to-run spread of one pipeline send
    # buffer, ~16 KiB): at exactly the calm peak keeping everything dies, adaptive not.
    _s("spike_adaptive", "adaptive", "calm*1.0", spike=0, meter=True),
    # An allocation no plan foresees, on rank 0 (stage 0) in micro-batch 1, once: the
    # micro-batch net re-runs it inside the stage's forward, with its EP peer. (Twice,
    # the net's own re-run fails too: under a pipeline that ends the job, agreed by the
    # stage's EP group; the launcher ends the other stages: test_parallel_pp_cli.py.)
    _s("squeeze1", "adaptive", "range*0.5", squeeze=(1, 1)),
    # Once, in backward on rank 2 (stage 1, the last): the step, on every rank of the job.
    _s("squeeze_bwd", "adaptive", "range*0.5", squeeze_backward=(2, 1)),
    # In the schedule's last backward (micro-batch 3), where the replicated gradients'
    # reduction used to be under way in DDP's buckets: it now waits for the step's end.
    _s("squeeze_last_bwd", "adaptive", "range*0.5", squeeze_backward=(2, 3)),
    # Calm, under a budget keeping everything fits in (1.25x `calm`'s true peak), four
    # steps: the layer peaks are calibrated after each, from a pipeline's device.
    _s("calm_adaptive", "adaptive", "calm*1.25", calm=True, steps=4, meter=True),
    _s("spike_none", "none", "calm*1.0", spike=0),  # last: rank 0 dies of it
]
PP_DP_SCENARIOS = [_s("plain", "plain"), _s("calm", "none"), _s("full", "full"),
                   _s("tight", "adaptive", "range*0.5"),
                   _s("squeeze_last_bwd", "adaptive", "range*0.5", squeeze_backward=(2, 3))]


def _spawn(tmp_path_factory, name, world, runs, expect_failure=None):
    """expect_failure: the file the dying rank saves before it raises (its peers may exit
    with a connection error first, so the spawn's own message is not checked)."""
    out_dir = tmp_path_factory.mktemp(name)
    args = (str(out_dir), MICRO_BATCHES, BATCH, runs)
    try:
        run_spawned(pp_workers.pp_worker, world, args, store_path=out_dir / "store",
                    timeout_s=SPAWN_TIMEOUT_S)
    except ProcessRaisedException:
        if expect_failure is None or not (out_dir / expect_failure).exists():
            raise
    else:
        assert expect_failure is None, f"no rank failed; expected {expect_failure}"
    return lambda scenario, rank: torch.load(out_dir / f"{scenario}_rank{rank}.pt")


@pytest.fixture(scope="module")
def pp2(tmp_path_factory):
    runs = [{"prefix": "", "pp": 2, "ep": 1, "cfg": CFG, "scenarios": PP_SCENARIOS}]
    return 2, _spawn(tmp_path_factory, "pp2", 2, runs)


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    """One spawn of 4 ranks for both 4-process layouts (process start-up dominates on 2
    cores); PP=2 x EP=2 last, since its final scenario kills rank 0 on purpose."""
    runs = [{"prefix": "dp_", "pp": 2, "ep": 1, "cfg": CFG, "scenarios": PP_DP_SCENARIOS},
            {"prefix": "ep_", "pp": 2, "ep": 2, "cfg": CFG_EP, "scenarios": PP_EP_SCENARIOS}]
    return _spawn(tmp_path_factory, "four", 4, runs, expect_failure="ep_spike_none_rank0.pt")


@pytest.fixture(scope="module")
def pp2ep2(four_ranks):
    return 4, lambda scenario, rank: four_ranks(f"ep_{scenario}", rank)


@pytest.fixture(scope="module")
def pp2dp2(four_ranks):
    return 4, lambda scenario, rank: four_ranks(f"dp_{scenario}", rank)


def _single_process(cfg_overrides: dict, num_shards: int) -> dict:
    cfg = model_config("tiny", **cfg_overrides)
    model = build_model(cfg, seed=0)
    num_mb = num_shards * MICRO_BATCHES
    tokens = pp_workers.global_batch(num_mb * BATCH, cfg.seq_len, cfg.vocab_size)
    for mb in tokens.chunk(num_mb):
        (model(mb[:, :-1], mb[:, 1:]).loss / num_mb).backward()
    return {n: p.grad for n, p in model.named_parameters()}


def _assert_close_to_single_process(world: int, load, scenario: str, reference: dict) -> None:
    seen = set()
    for rank in range(world):
        for name, (grad, expert_slice) in load(scenario, rank)["grads"].items():
            expected = reference[name]
            if expert_slice is not None:
                expected = expected[expert_slice[0]:expert_slice[1]]
            assert grad is not None, f"rank {rank}: no gradient for {name}"
            torch.testing.assert_close(grad, expected, atol=ATOL, rtol=RTOL,
                                       msg=lambda m: f"{scenario}, rank {rank}, {name}: {m}")
            seen.add(name)
    assert seen == set(reference), set(reference) ^ seen


def _assert_bitwise(world: int, load, base: str, scenario: str) -> None:
    for rank in range(world):
        expected, actual = load(base, rank)["grads"], load(scenario, rank)["grads"]
        assert expected.keys() == actual.keys()
        differ = [n for n in expected if not torch.equal(expected[n][0], actual[n][0])]
        assert not differ, f"{scenario}, rank {rank}: gradients differ from {base}: {differ}"


# ---- PP=2 ------------------------------------------------------------------------------
@pytest.mark.parametrize("plain", ["plain", "i_plain"], ids=["1f1b", "interleaved"])
def test_pp_gradients_equal_single_process(pp2, plain):
    world, load = pp2
    _assert_close_to_single_process(world, load, plain, _single_process(CFG, 1))


@pytest.mark.parametrize("scenario", ["calm", "full", "experts", "offload", "adaptive", "tight"])
def test_pp_every_policy_gives_bitwise_the_plain_gradients(pp2, scenario):
    world, load = pp2
    _assert_bitwise(world, load, "plain", scenario)
    for rank in range(world):
        record = load(scenario, rank)["records"][0]
        assert record["safety_net_reruns"] == 0
        assert record["peak_bytes"] <= record["budget_bytes"]
        if scenario == "calm":   # none: every forward after the first runs calm
            assert record["calm_forwards"] == MICRO_BATCHES - 1, (rank, record)
    if scenario == "tight":  # the budget really cut something on some stage
        decisions = [load(scenario, r)["records"][0]["decisions"] for r in range(world)]
        assert any(d["recompute"] + d["offload"] > 0 for d in decisions), decisions


@pytest.mark.parametrize("scenario", ["i_full", "i_tight"])
def test_pp_interleaved_policies_give_bitwise_the_plain_gradients(pp2, scenario):
    world, load = pp2
    _assert_bitwise(world, load, "i_plain", scenario)
    for rank in range(world):
        result = load(scenario, rank)
        assert result["stage_ids"] == [rank, rank + 2]
        for record in result["records"]:
            assert record["peak_bytes"] <= record["budget_bytes"]
            assert record["micro_batches"] == MICRO_BATCHES


def test_pp_static_shapes_mean_no_extra_forward(pp2):
    """The stage's first step runs exactly M forwards: no shape-inference forward that the
    guard would count as a micro-batch."""
    world, load = pp2
    for rank in range(world):
        result = load("calm", rank)
        assert result["forwards"] == MICRO_BATCHES
        assert result["records"][0]["micro_batches"] == MICRO_BATCHES


def test_pp_residency_follows_the_1f1b_schedule(pp2):
    """Stage s of p holds up to p - s micro-batches: stage 0 reserves one more at its first
    forward, the last stage none; micro-batch 1 on stage 0 finds micro-batch 0 resident."""
    world, load = pp2
    log0 = load("tight", 0)["residency"][0]
    first = log0[0]
    assert (first["micro_batch"], first["phase"], first["resident"], first["to_add"]) == \
        (0, "warmup", 0, 1) and first["reserved_bytes"] > 0
    second = next(e for e in log0 if e["micro_batch"] == 1)
    assert (second["resident"], second["to_add"]) == (1, 0)
    log1 = load("tight", 1)["residency"][0]
    assert all(e["to_add"] == 0 and e["resident"] == 0 for e in log1), log1


def test_pp_adaptive_runs_every_layer_without_the_hook_when_everything_fits(pp2):
    """Under a pipeline adaptive runs hookless where it proves that no later decision of
    the stage can want a layer's saved tensors: its own later layers and every layer of
    the forwards the schedule runs before its backward (runtime/hookless.py); with
    everything fitting, that is every layer of every micro-batch on both stages (the
    bitwise test above holds the gradients). The first layer of a step's first
    micro-batch runs its attention hooked: it measures what the covered ones model. The
    ends (runtime/hookless_ends.py), measured on the first micro-batch, run hookless
    after it on both stages: stage 0's embedding (token ids, under the evictor's 16 KiB)
    and its end after the last layer (nothing), stage 1's start (nothing) and its head,
    where the stage runs no forward before the micro-batch's backward (the last stage
    under 1F1B: nothing can evict it). The bitwise test above holds the gradients."""
    world, load = pp2
    layers_per_stage = CFG["num_layers"] // 2
    for rank in range(world):
        for record in load("adaptive", rank)["records"]:
            assert record["hookless_layers"] == layers_per_stage * MICRO_BATCHES, (rank, record)
            assert record["hookless_ends"] == 2 * (MICRO_BATCHES - 1), (rank, record)


# ---- PP=2 x EP=2 -----------------------------------------------------------------------
def test_pp_ep_gradients_equal_single_process(pp2ep2):
    world, load = pp2ep2
    _assert_close_to_single_process(world, load, "plain", _single_process(CFG_EP, 2))


@pytest.mark.parametrize("scenario", ["full", "tight"])
def test_pp_ep_policies_give_bitwise_the_plain_gradients(pp2ep2, scenario):
    world, load = pp2ep2
    _assert_bitwise(world, load, "plain", scenario)


def test_pp_ep_warmup_spike_none_dies_adaptive_stays_under_budget(pp2ep2):
    """The spike (stage 0, micro-batch 0, all tokens to ep rank 0) under a per-rank budget
    of exactly what a calm step needs with everything saved (its true peak)."""
    world, load = pp2ep2
    died = load("spike_none", 0)
    assert died["stage_ids"] == [0] and died["oom"], died
    for rank in range(world):
        result = load("spike_adaptive", rank)
        record = result["records"][0]
        assert record["peak_bytes"] <= record["budget_bytes"], (rank, record)
        assert record["safety_net_reruns"] == 0, (rank, record)
        assert record["micro_batches"] == MICRO_BATCHES
    _assert_bitwise(world, load, "spike_plain", "spike_adaptive")
    # The first warm-up decision on the spiked rank already reserved the micro-batch the
    # schedule adds before its first backward (the spike itself is micro-batch 0).
    first = load("spike_adaptive", 0)["residency"][0][0]
    assert (first["micro_batch"], first["layer"], first["phase"], first["to_add"]) == \
        (0, 0, "warmup", 1)
    assert first["reserved_bytes"] > 0
    hot = load("spike_adaptive", 0)["records"][0]["decisions"]
    assert hot["recompute"] + hot["offload"] > 0, hot


def test_pp_ep_calm_adaptive_saves_everywhere_when_keeping_everything_fits(pp2ep2):
    """Adaptive pays for no memory it does not need: on calm steps under a budget that
    `none` fits in, once the layer peaks are measured on the device (from the second step
    on; the first plans on the shapes' guess), every rank keeps every tensor: no
    recompute, offload, eviction or layer recomputed whole. Before the layer peaks were
    read net of the micro-batches the schedule runs in between, stage 0's calibrated
    backward slope counted the next micro-batch's bytes, which the forecast reserves
    again: its second step recomputed 20 operators, 4 layers whole, and evicted. (Its
    last step's peak is the meter's: the test below.)"""
    world, load = pp2ep2
    layers = CFG_EP["num_layers"] // 2 * MICRO_BATCHES
    for rank in range(world):
        steps = load("calm_adaptive", rank)["steps"]
        assert len(steps) == 4
        calm = []
        for step, records in enumerate(steps):
            for record in records:
                assert record["peak_bytes"] <= record["budget_bytes"], (rank, step, record)
                assert record["safety_net_reruns"] == 0, (rank, step, record)
                if step == 0:
                    continue
                d = record["decisions"]
                where = (rank, step, d, record["evicted_bytes"], record["full_layers"],
                         record["hookless_layers"], record["calm_forwards"])
                assert d["recompute"] == d["offload"] == 0 and d["save"] > 0, where
                assert record["evicted_bytes"] == record["full_layers"] == 0, where
                # ... and, proven so, runs every layer without the saved-tensor hook
                # (runtime/hookless.py) from the third step on: every layer has the
                # forwards behind it that predict its counts, the later forwards' too
                # (hookless_walk.py). Stage 0 ran 6-7 of 8 while the walk of a later
                # forward read the deciding micro-batch's bytes as they were at its
                # decision, not as that forward finds them (2-3 of 8 at the forecast's
                # bound before that). On the second step, rank 1's second forward follows a
                # calm first one (its start within the first step's room: calm_forward.py
                # `_Seen`), and its walk of its later forward falls short where it held
                # after a hooked first one: one layer of 8 runs hooked, keeping everything
                # (not traced: the calm forward's one ledger entry, 800,640 B, is no
                # smaller than the hooked one's layers, 792,544 B)
                if step >= 2:
                    assert record["hookless_layers"] == layers, where
                    calm.append(record["calm_forwards"])
        # From the third step every guard has seen each starting point kept whole, and its
        # forwards run calm (runtime/calm_forward.py), modelled in the ledger for the
        # residency: every one on some step, and all but two over the last two. Not every
        # one on every step: the device's figure at a forward's start moves with what the
        # process group's thread has sent and freed, and a start walked higher can fall
        # short (seen once in about a dozen runs: 2 of 4 on a step of stage 1). Compared to the
        # byte, one forward of four ran hooked under CI's load
        assert MICRO_BATCHES in calm and sum(calm) >= 2 * MICRO_BATCHES - 2, (rank, calm)


def test_pp_ep_none_runs_every_layer_without_the_hook(pp2ep2):
    """Policy none never offloads or evicts, under a pipeline neither: every layer of every
    micro-batch on every stage runs without the saved-tensor hook (runtime/hookless.py),
    and the ends too once the first micro-batch measured them (runtime/hookless_ends.py).
    Nothing of a pipeline's residency can then take a layer of an older micro-batch, so
    each forward after the first (same shapes) runs calm, as the plain model's
    (runtime/calm_forward.py); the tests above hold its gradients bitwise and its peak to
    the meter's."""
    world, load = pp2ep2
    layers_per_stage = CFG_EP["num_layers"] // 2
    for rank in range(world):
        for record in load("calm", rank)["records"]:
            assert record["hookless_layers"] == layers_per_stage * MICRO_BATCHES, (rank, record)
            assert record["hookless_ends"] == 2 * (MICRO_BATCHES - 1), (rank, record)
            assert record["calm_forwards"] == MICRO_BATCHES - 1, (rank, record)


@pytest.mark.parametrize("scenario", ["calm", "tight", "spike_adaptive", "calm_adaptive"])
def test_pp_ep_each_ranks_device_peak_is_the_meters(pp2ep2, scenario):
    """PP=2 x EP=2, every rank: the guard's reported peak is the independent meter's
    (tests/meter.py) within 2%, calm (none, its forwards after the first calm), tight
    (adaptive cutting), the warm-up spike (adaptive) and adaptive's third calm step (the
    last stage's forwards calm). The device may see more, never less: gloo's and the
    pipeline's allocations on their own threads and scratch inside one op are the meter's
    blind spots: on stage 0 when adaptive cuts, the device's peak is a fixed 24.75 KiB above the
    meter's (25,344 bytes, the same with DDP's buckets and without: a scratch inside one
    op of the stage's backward), so the bound is 2% or 32 KiB, the larger."""
    world, load = pp2ep2
    for rank in range(world):
        result = load(scenario, rank)
        seen, device = result["meter_peak"], result["records"][0]["peak_bytes"]
        assert seen <= device <= seen + max(0.02 * seen, 32 * 1024), (
            rank, device, seen, device / seen)


# ---- PP=2 x DP=2 -----------------------------------------------------------------------
def test_pp_dp_gradients_equal_single_process(pp2dp2):
    world, load = pp2dp2
    _assert_close_to_single_process(world, load, "plain", _single_process(CFG, 2))


@pytest.mark.parametrize("scenario", ["calm", "full", "tight"])
def test_pp_dp_policies_give_bitwise_the_plain_gradients(pp2dp2, scenario):
    world, load = pp2dp2
    _assert_bitwise(world, load, "plain", scenario)


def test_pp_ep_safety_net_inside_a_stage_keeps_counts_and_gradients(pp2ep2):
    """A micro-batch net re-run inside a stage's forward (rank 0's unforeseen allocation):
    the EP group re-runs it together, no rank hangs, no step is re-run, the re-run keeps
    its micro-batch number (so the residency reads the right schedule position), and the
    gradients are still bitwise the plain run's."""
    world, load = pp2ep2
    results = [load("squeeze1", r) for r in range(world)]
    # The forced one at least; under a loaded machine the cost model's timings may pick a
    # plan whose own micro-batch also re-runs (seen once in a full suite: 2), which the
    # checks below hold for just the same.
    assert results[0]["records"][0]["safety_net_reruns"] >= 1, results[0]["records"]
    for r in results:
        record = r["records"][0]
        assert record["safety_net"] == [], record["safety_net"]
        assert record["micro_batches"] == MICRO_BATCHES
        assert record["peak_bytes"] <= record["budget_bytes"], record
        assert sorted({e["micro_batch"] for e in r["residency"][0]}) == list(range(MICRO_BATCHES))
    _assert_bitwise(world, load, "plain", "squeeze1")



@pytest.mark.parametrize("layout, scenario, micro_batch", [
    ("pp2ep2", "squeeze_bwd", 1), ("pp2ep2", "squeeze_last_bwd", 3),
    ("pp2dp2", "squeeze_last_bwd", 3)])
def test_pp_backward_oom_on_a_stage1_rank_reruns_the_step_on_every_rank(
        request, layout, scenario, micro_batch):
    """Rank 2 (stage 1) alone is refused in the backward of a micro-batch: it plays the
    rest of the schedule as a ghost, its EP peer learns at its next flag point, the other
    stage runs on; at the step's end every rank of the job holds the same notes and
    re-runs the step with full recompute, within the budget, bitwise the plain run's. In
    the schedule's last backward too, where a reduction of the replicated gradients
    launched during backward (DDP's buckets) would be left half issued by the ghost: the
    replicas reduce only after the step's agreement (PipelineRank._reduce_grads)."""
    world, load = request.getfixturevalue(layout)
    reasons = set()
    for rank in range(world):
        record = load(scenario, rank)["records"][0]
        assert [r["scope"] for r in record["safety_net"]] == ["step"], (rank, record)
        reasons.add(record["safety_net"][0]["reason"])
        assert record["micro_batches"] == MICRO_BATCHES
        assert record["peak_bytes"] <= record["budget_bytes"], (rank, record)
        assert record["decisions"]["save"] == 0, record["decisions"]   # every layer whole
    assert len(reasons) == 1, reasons          # one agreed line on every rank
    assert next(iter(reasons)).startswith(
        f"rank 2 ran out of memory in backward of micro-batch {micro_batch}")
    _assert_bitwise(world, load, "plain", scenario)
