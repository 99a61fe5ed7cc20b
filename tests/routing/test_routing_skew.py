"""Skew schedule statistics and patterns; the injector reaching its target on the tiny model.

T = tokens, E = experts, K = top-k, R = expert-parallel ranks, H = experts per rank.

    .venv/bin/python -m pytest tests/bench/test_bench_skew.py -q
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from spikeguard.routing.skew import SkewConfig, SkewInjector, SkewSchedule, bias_for_hot_copies
from spikeguard.data.corpus import load_corpus
from spikeguard.errors import UsageError
from spikeguard.model import build_model, model_config

NUM_DRAWS = 20_000
BATCH, SEQ = 8, 32  # T = 256 tokens, 512 routed copies per layer


def _draws(schedule: SkewSchedule, n: int = NUM_DRAWS):
    return [(schedule.is_spike(s), *schedule.target(s)) for s in range(n)]


# ---------------------------------------------------------------- schedule, no model


@pytest.mark.parametrize("pattern", ["production", "one-hot-rank", "rotating", "burst"])
def test_spike_fraction_matches_probability(pattern):
    p = 0.029
    draws = _draws(SkewSchedule(SkewConfig(seed=7, spike_probability=p, pattern=pattern), 4))
    fraction = sum(spike for spike, _, _ in draws) / NUM_DRAWS
    # Binomial(20000, 0.029): sd = sqrt(p(1-p)/n) = 0.00119; 5 sd = 0.0059 (a false failure
    # about once in 2e6 seeds). rotating/burst are exact up to rounding p to 1/window:
    # 1/34 = 0.0294 and 4/138 = 0.0290.
    tol = 5 * math.sqrt(p * (1 - p) / NUM_DRAWS)
    assert abs(fraction - p) < tol, f"{pattern}: {fraction:.4f} vs {p} +- {tol:.4f}"


def test_ratios_fill_their_ranges():
    cfg = SkewConfig(seed=1, spike_probability=0.2)
    draws = _draws(SkewSchedule(cfg, 4))
    calm = [r for spike, _, r in draws if not spike]
    spikes = [r for spike, _, r in draws if spike]
    assert all(1.0 <= r < cfg.calm_max_ratio for r in calm)
    assert all(cfg.spike_min_ratio <= r <= cfg.spike_max_ratio for r in spikes)
    # uniform draws: both ends reached, mean at the middle (sd of the mean < 0.001 here)
    assert min(calm) < 1.002 and max(calm) > 1.198
    assert min(spikes) < 1.21 and max(spikes) > 2.59
    assert sum(calm) / len(calm) == pytest.approx(1.1, abs=0.005)
    assert sum(spikes) / len(spikes) == pytest.approx(1.9, abs=0.02)


def test_production_hot_rank_is_uniform_and_one_hot_rank_is_fixed():
    prod = _draws(SkewSchedule(SkewConfig(seed=2, spike_probability=0.5), 4))
    ranks = [hot for spike, hot, _ in prod if spike]
    for r in range(4):  # ~2500 per rank, sd ~43
        assert abs(ranks.count(r) / len(ranks) - 0.25) < 0.02
    one = _draws(SkewSchedule(SkewConfig(seed=2, pattern="one-hot-rank", hot_rank=3), 4))
    assert {hot for spike, hot, _ in one if spike} == {3}


def test_rotating_hot_rank_advances_by_one_each_spike():
    cfg = SkewConfig(seed=3, pattern="rotating", hot_rank=2, spike_probability=0.1)
    ranks = [hot for spike, hot, _ in _draws(SkewSchedule(cfg, 4), 2000) if spike]
    assert len(ranks) == 200
    assert ranks == [(2 + i) % 4 for i in range(len(ranks))]


@pytest.mark.parametrize("burst_length", [1, 3, 6])
def test_burst_runs_have_burst_length_and_one_rank(burst_length):
    cfg = SkewConfig(seed=4, pattern="burst", burst_length=burst_length, spike_probability=0.1)
    draws = _draws(SkewSchedule(cfg, 4), 5000)
    runs, current = [], []
    for spike, hot, _ in draws + [(False, 0, 1.0)]:
        if spike:
            current.append(hot)
        elif current:
            runs.append(current)
            current = []
    assert len(runs) > 20
    assert all(len(run) == burst_length for run in runs[:-1])  # the last may be cut at the end
    assert all(len(set(run)) == 1 for run in runs)
    assert len({run[0] for run in runs}) == 4  # bursts land on every rank


@pytest.mark.parametrize("pattern", ["production", "rotating", "burst"])
def test_schedule_is_a_pure_function_of_seed_and_step(pattern):
    cfg = SkewConfig(seed=11, pattern=pattern, spike_probability=0.1)
    forward = [SkewSchedule(cfg, 4).target(s) for s in range(3000)]
    steps = list(range(3000))
    random.Random(0).shuffle(steps)
    other = SkewSchedule(cfg, 4)
    shuffled = {s: other.target(s) for s in steps}
    assert [shuffled[s] for s in range(3000)] == forward
    assert SkewSchedule(cfg, 4).target(10**12) == other.target(10**12)  # any step, O(1)
    reseeded = SkewSchedule(SkewConfig(seed=12, pattern=pattern, spike_probability=0.1), 4)
    assert [reseeded.target(s) for s in range(3000)] != forward


@pytest.mark.parametrize("kwargs", [
    {"seed": 1.5}, {"seed": True}, {"spike_probability": -0.1}, {"spike_probability": 1.5},
    {"spike_probability": float("nan")}, {"calm_max_ratio": 1.0}, {"calm_max_ratio": 1.3},
    {"spike_min_ratio": 2.0, "spike_max_ratio": 1.5}, {"pattern": "zipf"}, {"hot_rank": -1},
    {"burst_length": 0}, {"pattern": "burst", "burst_length": 4, "spike_probability": 0.9},
    {"pattern": "rotating", "spike_probability": 0.0}, {"spike_max_ratio": "2.6"},
])
def test_bad_config_raises_usage_error(kwargs):
    with pytest.raises(UsageError, match=next(iter(kwargs))):
        SkewConfig(**kwargs)


def test_bad_schedule_arguments_raise_usage_error():
    with pytest.raises(UsageError, match="one rank cannot be skewed"):
        SkewSchedule(SkewConfig(), 1)
    with pytest.raises(UsageError, match="unreachable with ep_size 2"):  # 2.6x on 2 ranks
        SkewSchedule(SkewConfig(), 2)
    with pytest.raises(UsageError, match="hot_rank 4 must be < ep_size 4"):
        SkewSchedule(SkewConfig(hot_rank=4), 4)
    with pytest.raises(UsageError, match="step must be a non-negative integer"):
        SkewSchedule(SkewConfig(), 4).target(-1)


# ---------------------------------------------------------------- the bias solver


@pytest.mark.parametrize("num_experts, top_k, hot, forced", [
    (8, 2, slice(2, 4), 0),   # H = 2 = K: 0..2 hot copies per token
    (8, 3, slice(6, 8), 0),   # H < K: at most 2 of 3 copies hot
    (4, 3, slice(0, 2), 1),   # 2 cold experts < K = 3: one hot copy per token is forced
])
def test_bias_for_hot_copies_reaches_every_count_exactly(num_experts, top_k, hot, forced):
    gen = torch.Generator().manual_seed(0)
    scores_TE = torch.softmax(torch.randn(48, num_experts, generator=gen), dim=-1)
    num_hot = min(top_k, hot.stop - hot.start)
    for want in range(48 * num_hot + 1):
        bias_E = torch.zeros(num_experts)
        bias_E[hot] = bias_for_hot_copies(scores_TE, hot, top_k, want)
        idx_TK = torch.topk(scores_TE + bias_E, top_k, dim=-1).indices
        got = int(((idx_TK >= hot.start) & (idx_TK < hot.stop)).sum())
        assert got == max(want, 48 * forced), f"asked {want} hot copies, got {got}"


# ---------------------------------------------------------------- injector on the tiny model


def _model(**overrides):
    return build_model(model_config("tiny", **{"num_experts": 8, **overrides}), seed=0)


def _batch(kind: str, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if kind == "random":
        return torch.randint(0, 256, (BATCH, SEQ), generator=gen)
    return load_corpus(None).get_batch("train", BATCH, SEQ, gen)[0]


def _fixed_spike(ratio: float, hot_rank: int, ep_size: int, **extra) -> SkewSchedule:
    cfg = SkewConfig(spike_probability=1.0, pattern="one-hot-rank", hot_rank=hot_rank,
                     spike_min_ratio=ratio, spike_max_ratio=ratio, **extra)
    return SkewSchedule(cfg, ep_size)


def _ratios_from_dispatch(model, ep_size: int) -> list[float]:
    """max/mean per rank from the counts the dispatcher really produced (not the hook's)."""
    out = []
    for block in model.moe_blocks():
        per_rank = len(block.last_tokens_per_expert) // ep_size
        counts_R = [sum(block.last_tokens_per_expert[r * per_rank:(r + 1) * per_rank])
                    for r in range(ep_size)]
        out.append(max(counts_R) * ep_size / sum(counts_R))
    return out


@pytest.mark.parametrize("ep_size, ratio", [(2, 1.5), (2, 2.0), (4, 1.25), (4, 1.5), (4, 2.0), (4, 2.6)])
@pytest.mark.parametrize("data", ["text", "random"])
def test_spike_reaches_target_ratio_on_every_layer(ep_size, ratio, data):
    model, idx_BT = _model(), _batch(data)
    one_copy = ep_size / (BATCH * SEQ * 2)
    for hot_rank in range(ep_size):
        injector = SkewInjector(_fixed_spike(ratio, hot_rank, ep_size), ep_size).attach(model)
        injector.set_step(0)
        model(idx_BT)
        achieved = _ratios_from_dispatch(model, ep_size)
        assert injector.last_ratios == pytest.approx(achieved, abs=1e-12)
        for block in model.moe_blocks():  # the hot rank holds the max, up to the tolerance
            per_rank = 8 // ep_size
            counts_R = [sum(block.last_tokens_per_expert[r * per_rank:(r + 1) * per_rank])
                        for r in range(ep_size)]
            assert counts_R[hot_rank] >= max(counts_R) - 2, f"hot rank {hot_rank}: {counts_R}"
        injector.detach()
        # rounding the target to whole copies costs half a copy; tied gaps of identical
        # tokens can move copies in pairs: two copies = 0.8% (R=2) / 1.6% (R=4) of the mean
        assert achieved == pytest.approx([ratio] * len(achieved), abs=2 * one_copy + 1e-9), \
            f"hot rank {hot_rank}: {achieved}"


def test_calm_step_keeps_natural_routing_bit_for_bit_when_already_calm():
    model, idx_BT = _model(), _batch("text")
    reference = model(idx_BT).logits_BTV
    natural = _ratios_from_dispatch(model, 4)  # 1.48 and 1.40 for this model and batch
    cfg = SkewConfig(spike_probability=0.0, calm_max_ratio=1.6, spike_min_ratio=1.6,
                     spike_max_ratio=2.0)
    injector = SkewInjector(SkewSchedule(cfg, 4), 4).attach(model)
    injector.set_step(0)
    assert torch.equal(model(idx_BT).logits_BTV, reference)
    assert injector.last_ratios == natural
    injector.detach()


def test_calm_steps_pull_a_naturally_skewed_router_under_calm_max():
    model, plain = _model(), _model()
    schedule = SkewSchedule(SkewConfig(seed=5, spike_probability=0.0), 4)
    injector = SkewInjector(schedule, 4).attach(model)
    worst_natural = 0.0
    for step in range(12):
        idx_BT = _batch("text", seed=step)
        plain(idx_BT)
        worst_natural = max(worst_natural, *_ratios_from_dispatch(plain, 4))
        injector.set_step(step)
        model(idx_BT)
        assert max(injector.last_ratios) < 1.2, f"step {step}: {injector.last_ratios}"
    injector.detach()
    assert worst_natural > 1.3  # otherwise this test would not exercise the pull-down


def test_calm_target_stays_under_calm_max_after_rounding_to_whole_copies():
    # 8 tokens, 16 copies, ep 2: a mean of 8 per rank, and calm_max 1.1 = 8.8 copies. A drawn
    # calm ratio of 1.07 rounds to 9 copies = 1.125x; the injector must settle for 8.
    model, plain = _model(), _model()
    cfg = SkewConfig(seed=5, spike_probability=0.0, calm_max_ratio=1.1, spike_min_ratio=1.1,
                     spike_max_ratio=2.0)
    injector = SkewInjector(SkewSchedule(cfg, 2), 2).attach(model)
    pulled = 0
    for step in range(20):
        idx_BT = load_corpus(None).get_batch("train", 1, 8, torch.Generator().manual_seed(step))[0]
        plain(idx_BT)
        pulled += max(_ratios_from_dispatch(plain, 2)) >= 1.1
        injector.set_step(step)
        model(idx_BT)
        assert max(injector.last_ratios) < 1.1, f"step {step}: {injector.last_ratios}"
    injector.detach()
    assert pulled >= 10


def test_detach_restores_bias_and_outputs_bit_for_bit():
    model, idx_BT = _model(router_bias=True), _batch("text")
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for block in model.moe_blocks():
            block.router.expert_bias_E.copy_(0.05 * torch.randn(8, generator=gen))
    own = [b.router.expert_bias_E.clone() for b in model.moe_blocks()]
    reference = model(idx_BT).logits_BTV
    injector = SkewInjector(_fixed_spike(2.6, 1, 4), 4).attach(model)
    injector.set_step(0)
    skewed = model(idx_BT).logits_BTV
    assert not torch.equal(skewed, reference)
    # between router calls the buffer already holds the router's own bias
    assert all(torch.equal(b.router.expert_bias_E, o) for b, o in zip(model.moe_blocks(), own))
    injector.detach()
    assert all(torch.equal(b.router.expert_bias_E, o) for b, o in zip(model.moe_blocks(), own))
    assert torch.equal(model(idx_BT).logits_BTV, reference)
    assert not any(r._forward_pre_hooks or r._forward_hooks
                   for r in (b.router for b in model.moe_blocks()))


def test_injected_routing_backpropagates_over_two_micro_batches():
    model = _model()
    gen = torch.Generator().manual_seed(0)
    batches = [load_corpus(None).get_batch("train", BATCH, SEQ, gen) for _ in range(2)]
    injector = SkewInjector(_fixed_spike(2.0, 0, 4), 4).attach(model)
    losses = []
    for step, (idx_BT, targets_BT) in enumerate(batches):  # both forwards before backward
        injector.set_step(step)
        losses.append(model(idx_BT, targets_BT).loss)
    sum(losses).backward()
    injector.detach()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert model.moe_blocks()[0].router.gate.weight.grad.abs().sum() > 0


def test_injector_usage_errors():
    model = _model()
    injector = SkewInjector(_fixed_spike(2.0, 0, 4), 4).attach(model)
    with pytest.raises(UsageError, match=r"set_step\(step\) before the forward"):
        model(_batch("random"))
    with pytest.raises(UsageError, match="already attached"):
        injector.attach(model)
    injector.detach()
    with pytest.raises(UsageError, match="ep_size 2 differs from the schedule's 4"):
        SkewInjector(_fixed_spike(2.0, 0, 4), 2)
    with pytest.raises(UsageError, match="6 experts cannot be split over ep_size 4"):
        SkewInjector(_fixed_spike(2.0, 0, 4), 4).attach(_model(num_experts=6))
    # H = 1 < K = 2: the hot rank holds at most 2.0x
    with pytest.raises(UsageError, match="2.6 is unreachable: with top_k 2"):
        SkewInjector(_fixed_spike(2.6, 0, 4), 4).attach(_model(num_experts=4))


def test_a_spike_from_a_later_layer_leaves_the_layers_before_it_calm():
    """`spike_from_layer` 2 of tiny's 4 layers (num_layers overridden): on a spike step
    layers 0-1 route exactly as with no injector (their natural routing is calm), layers
    2-3 reach the target; 0 is every layer, as before."""
    model, idx_BT = _model(num_layers=4), _batch("text")
    model(idx_BT)
    natural = _ratios_from_dispatch(model, 2)
    assert max(natural[:2]) < 1.2, natural   # calm by nature: so left as they are
    late = SkewInjector(_fixed_spike(2.0, 0, 2), 2, spike_from_layer=2).attach(model)
    late.set_step(0)
    model(idx_BT)
    achieved = _ratios_from_dispatch(model, 2)
    late.detach()
    assert achieved[:2] == natural[:2]
    assert achieved[2:] == pytest.approx([2.0, 2.0], abs=2 * 2 / (BATCH * SEQ * 2) + 1e-9)
    every = SkewInjector(_fixed_spike(2.0, 0, 2), 2).attach(model)
    every.set_step(0)
    model(idx_BT)
    every.detach()
    assert _ratios_from_dispatch(model, 2) == pytest.approx([2.0] * 4, abs=2 * 2 / (BATCH * SEQ * 2) + 1e-9)
    for bad in (-1, 1.5, True):
        with pytest.raises(UsageError, match="spike_from_layer must be an integer >= 0"):
            SkewInjector(_fixed_spike(2.0, 0, 2), 2, spike_from_layer=bad)
