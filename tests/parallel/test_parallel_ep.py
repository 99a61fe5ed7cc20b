"""Expert parallelism on real gloo process groups (spawned ranks, CPU).

E = experts in the model, L = experts per rank, R = ranks. Each rank runs one micro-batch,
its shard of one global batch of 8 sequences, under a scenario (a memory policy per rank),
and saves its gradients; the parent compares them with a single-process run of the same
model over the whole batch, and with the same layout's plain (unguarded) run.

    .venv/bin/python -m pytest tests/parallel/test_parallel_ep.py -q
"""

from __future__ import annotations

import pytest
import torch

import ep_workers
from spikeguard.model import build_model, model_config
from spikeguard.parallel.launch_utils import run_spawned

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]

SPAWN_TIMEOUT_S = 90           # a hung collective fails the test here, well inside 180 s
NUM_SEQUENCES = 8
HUGE = ep_workers.HUGE
POLICIES = ("none", "full", "experts", "offload", "adaptive")
# EP=4 needs E divisible by 4. The load-balancing loss is off where the whole-batch run
# is the reference: it is a product of batch means, so per-shard values do not add up to
# the whole batch's (the cross-entropy's means do, with equal shards).
OVERRIDES = {2: {"aux_loss_coef": 0.0}, 4: {"num_experts": 8, "aux_loss_coef": 0.0}}
# Float32 tolerance against the single process: the replicated gradients are sums of
# per-rank partial sums (all-reduced) instead of one reduction over the whole batch, so
# the rounding differs; measured differences are below 1e-7.
ATOL = RTOL = 1e-5
# A step here is one micro-batch through 2 layers of 5 planned operators each.
OPS_PER_STEP = 2 * 5


def _same(value, world: int) -> tuple:
    return (value,) * world


def _first_differs(first, others, world: int) -> tuple:
    return (first,) + (others,) * (world - 1)


def _policy_scenarios(world: int) -> list:
    return ([("plain", _same("plain", world), _same(None, world))]
            + [(p, _same(p, world), _same(HUGE, world)) for p in POLICIES]
            + [("tight", _same("adaptive", world), _same("tight", world))])


def _mixed_scenarios(world: int) -> list:
    # none / experts / offload first: "tight" budgets are resolved from their peaks.
    measure = [(p, _same(p, world), _same(HUGE, world)) for p in ("none", "experts", "offload")]
    return measure + [
        ("plain", _same("plain", world), _same(None, world)),
        ("mixed_tight", _first_differs("adaptive", "none", world),
         _first_differs("tight", HUGE, world)),
        ("mixed_full", _first_differs("full", "none", world), _same(HUGE, world)),
    ]


def _spawn(tmp_path_factory, name: str, world: int, overrides: dict, scenarios: list):
    out_dir = tmp_path_factory.mktemp(f"{name}{world}")
    run_spawned(ep_workers.step_worker, world,
                (str(out_dir), overrides, NUM_SEQUENCES, scenarios),
                store_path=out_dir / "store", timeout_s=SPAWN_TIMEOUT_S)
    return lambda scenario, rank: torch.load(out_dir / f"{scenario}_rank{rank}.pt")


@pytest.fixture(scope="module", params=[2, 4], ids=["ep2", "ep4"])
def ep_run(request, tmp_path_factory):
    world = request.param
    return world, _spawn(tmp_path_factory, "ep", world, OVERRIDES[world], _policy_scenarios(world))


@pytest.fixture(scope="module", params=[2, 4], ids=["ep2", "ep4"])
def mixed_run(request, tmp_path_factory):
    world = request.param
    # With the load-balancing loss on: same layout on both sides, so no reason to drop it.
    overrides = {"num_experts": OVERRIDES[world].get("num_experts", 4)}
    return world, _spawn(tmp_path_factory, "mixed", world, overrides, _mixed_scenarios(world))


def _single_process(world: int):
    cfg = model_config("tiny", **OVERRIDES[world])
    model = build_model(cfg, seed=0)
    tokens_BT = ep_workers.global_batch(NUM_SEQUENCES, cfg.seq_len, cfg.vocab_size)
    loss = model(tokens_BT[:, :-1], tokens_BT[:, 1:]).loss
    loss.backward()
    return cfg, loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def _assert_bitwise(expected: dict, actual: dict, what: str) -> None:
    assert expected.keys() == actual.keys()
    differ = [n for n in expected if actual[n] is None or not torch.equal(expected[n], actual[n])]
    assert not differ, f"{what}: gradients differ from the plain EP run: {differ}"


def test_ep_gradients_equal_single_process_over_whole_batch(ep_run):
    world, load = ep_run
    cfg, loss, reference = _single_process(world)
    num_local = cfg.num_experts // world
    total_loss = 0.0
    for rank in range(world):
        result = load("plain", rank)
        total_loss += result["loss"]
        assert result["grads"].keys() == reference.keys()
        for name, grad in result["grads"].items():
            expected = reference[name]
            if ".experts." in name:  # this rank's slice of the experts
                expected = expected[rank * num_local:(rank + 1) * num_local]
            assert grad is not None, f"rank {rank}: no gradient for {name}"
            assert grad.shape == expected.shape, name
            torch.testing.assert_close(grad, expected, atol=ATOL, rtol=RTOL,
                                       msg=lambda m: f"rank {rank}, {name}: {m}")
    # Each rank backpropagated loss / R: together they are the whole batch's mean loss.
    torch.testing.assert_close(total_loss, loss, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("scenario", POLICIES + ("tight",))
def test_ep_every_policy_gives_bitwise_the_plain_gradients(ep_run, scenario):
    world, load = ep_run
    for rank in range(world):
        plain, guarded = load("plain", rank), load(scenario, rank)
        _assert_bitwise(plain["grads"], guarded["grads"], f"{scenario}, rank {rank}")
        assert guarded["record"]["safety_net_reruns"] == 0
    if scenario == "tight":
        records = [load(scenario, r)["record"] for r in range(world)]
        assert all(r["decisions"]["recompute"] + r["decisions"]["offload"] > 0
                   for r in records), [r["decisions"] for r in records]
        assert all(r["peak_bytes"] <= r["budget_bytes"] for r in records)


def test_ep_ranks_deciding_differently_in_one_step_finish_with_plain_gradients(mixed_run):
    """Rank 0 plans under a tight budget (or recomputes every layer, collectives included
    in the region), the others keep everything. The collectives are never re-run by a
    recompute (checkpoint policies keep their outputs), so no rank waits on a collective
    its peers do not issue; reaching the asserts at all means no rank hung."""
    world, load = mixed_run
    for scenario, rank0_recompute in (("mixed_tight", None), ("mixed_full", OPS_PER_STEP)):
        records = [load(scenario, r)["record"] for r in range(world)]
        rank0 = records[0]["decisions"]
        assert rank0["recompute"] + rank0["offload"] > 0, rank0
        if rank0_recompute is not None:
            assert rank0["recompute"] == rank0_recompute
        for record in records[1:]:
            assert record["decisions"]["recompute"] + record["decisions"]["offload"] == 0
        for rank in range(world):
            _assert_bitwise(load("plain", rank)["grads"], load(scenario, rank)["grads"],
                            f"{scenario}, rank {rank}")


def test_ep_size_not_dividing_the_experts_is_refused_unchanged(ep_run):
    world, load = ep_run
    for rank in range(world):
        result = load("refused", rank)
        assert result["usage_error"], f"rank {rank}: {world} ranks, {world + 1} experts accepted"
        assert f"expert-parallel size {world} must divide" in result["message"]
        assert result["unchanged"]
