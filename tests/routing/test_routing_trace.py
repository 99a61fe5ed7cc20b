"""Routing traces: recorded counts are what the routers did; a replay reproduces them exactly,
under every policy with bitwise-equal gradients; malformed or mismatched traces are refused.

T = tokens per micro-batch, K = top-k, E = experts, R = expert-parallel ranks.

    .venv/bin/python -m pytest tests/bench/test_bench_trace.py -q
"""

from __future__ import annotations

import contextlib
import io
import json

import numpy as np
import pytest
import torch
from rich.console import Console

import spikeguard
from spikeguard.routing.trace import (TraceRecorder, TraceReplayer, TraceWriter, forced_topk,
                                    load_trace, make_header)
from spikeguard.data import load_corpus
from spikeguard.errors import UsageError
from spikeguard.model import build_model, model_config
from spikeguard.train import TrainConfig, train

pytestmark = pytest.mark.timeout(120)
CFG = model_config("tiny")


def _random_counts(rng, num_experts: int, total: int, most: int) -> np.ndarray:
    """Counts summing to `total`, each at most `most`, deliberately skewed."""
    while True:
        c = rng.multinomial(total, rng.dirichlet(np.full(num_experts, 0.3)))
        if c.max() <= most:
            return c


@pytest.mark.parametrize("ep", [1, 2, 4])
def test_forced_topk_reproduces_counts_with_distinct_experts(ep):
    rng = np.random.default_rng(ep)
    tokens, top_k, experts = 24, 3, 8
    for _ in range(50):
        counts = _random_counts(rng, experts, ep * tokens * top_k, ep * tokens)
        total = np.zeros(experts, dtype=np.int64)
        for rank in range(ep):
            idx = forced_topk(counts, rank, ep, tokens, top_k)
            assert idx.shape == (tokens, top_k)
            assert all(len(set(row)) == top_k for row in idx.tolist())
            total += np.bincount(idx.reshape(-1).numpy(), minlength=experts)
        assert (total == counts).all()


def _header(**over):
    shape = dict(num_layers=CFG.num_layers, num_experts=CFG.num_experts, top_k=CFG.top_k, ep=1,
                 micro_batches=2, tokens_per_micro_batch=4 * CFG.seq_len)
    return make_header(**{**shape, **over})


def _write_trace(path, steps: int, seed: int = 0, **over):
    header = _header(**over)
    rng = np.random.default_rng(seed)
    t = header["ep"] * header["tokens_per_micro_batch"]
    writer = TraceWriter(path, header)
    all_counts = []
    for step in range(1, steps + 1):
        counts = [[_random_counts(rng, header["num_experts"], t * header["top_k"], t).tolist()
                   for _ in range(header["num_layers"])] for _ in range(header["micro_batches"])]
        writer.write_step(step, counts)
        all_counts.append(counts)
    writer.close()
    return np.asarray(all_counts)


@pytest.fixture(scope="module")
def corpus():
    return load_corpus(max_bytes=2 * 2**20)


def _train(corpus, *, observers=(), steps=3, guard_factory=None, seed=0):
    model = build_model(CFG, seed=seed)
    cfg = TrainConfig(steps=steps, batch_size=4, micro_batches=2, eval_every=steps,
                      eval_batches=1)
    seen = []

    class Watch:
        """Reads each block's counts right after each micro-batch's forward."""

        def before_step(self, step):
            seen.append([])

        def after_step(self, step, record):
            pass

    def hook(module, args, output):
        if torch.is_grad_enabled():
            seen[-1].append([b.last_tokens_per_expert for b in model.moe_blocks()])

    model.register_forward_hook(hook)
    observers = [Watch(), *(o(model) for o in observers)]
    records = train(model, CFG, cfg, corpus, observers=observers,
                    guard_factory=guard_factory, console=Console(file=io.StringIO()))
    return model, records, np.asarray(seen)


def test_replay_forces_every_micro_batch_and_layer(corpus, tmp_path):
    path = tmp_path / "t.jsonl"
    expected = _write_trace(path, steps=3)
    trace = load_trace(path)
    _, _, seen = _train(corpus, observers=[lambda m: TraceReplayer(m, trace)])
    assert (seen == expected).all()


def test_record_then_replay_round_trip(corpus, tmp_path):
    path = tmp_path / "rec.jsonl"

    def recorder(model):
        return TraceRecorder(model, micro_batches=2, writer=TraceWriter(path, _header()))

    _, _, natural = _train(corpus, observers=[recorder], seed=0)
    trace = load_trace(path)
    assert (trace.counts == natural).all()
    # A different model routes differently by nature; the replay makes it route as recorded.
    _, _, other = _train(corpus, seed=5)
    assert not (other == natural).all()
    _, _, replayed = _train(corpus, observers=[lambda m: TraceReplayer(m, trace)], seed=5)
    assert (replayed == natural).all()


def _grads_one_step(trace, policy=None, budget=None):
    model = build_model(CFG, seed=0)
    replayer = TraceReplayer(model, trace)
    guard = spikeguard.attach(model, budget=budget, policy=policy) if policy else None
    gen = torch.Generator().manual_seed(3)
    replayer.set_step(1)
    with guard.step() if guard else contextlib.nullcontext():
        for _ in range(2):
            tokens = torch.randint(0, CFG.vocab_size, (4, CFG.seq_len + 1), generator=gen)
            model(tokens[:, :-1], tokens[:, 1:]).loss.backward()
    counts = [b.last_tokens_per_expert for b in model.moe_blocks()]
    return {n: p.grad.clone() for n, p in model.named_parameters()}, counts, guard


def test_replay_gradients_bitwise_equal_under_every_policy(tmp_path):
    path = tmp_path / "t.jsonl"
    expected = _write_trace(path, steps=1, seed=7)
    trace = load_trace(path)
    plain, counts, _ = _grads_one_step(trace)
    assert counts == expected[0, 1].tolist()
    for policy in ("none", "experts", "offload", "full"):
        grads, counts, _ = _grads_one_step(trace, policy, "1GiB")
        assert counts == expected[0, 1].tolist(), policy
        differ = [n for n in plain if not torch.equal(plain[n], grads[n])]
        assert not differ, f"{policy}: {differ}"
    # adaptive under a budget tight enough that it must recompute or offload something
    _, _, ref = _grads_one_step(trace, "none", "1GiB")
    tight = int(ref.history[-1]["peak_bytes"] * 0.85)
    grads, _, guard = _grads_one_step(trace, "adaptive", tight)
    assert guard.history[-1]["peak_bytes"] <= tight
    decided = guard.history[-1]["decisions"]
    assert decided["recompute"] + decided["offload"] > 0, decided
    differ = [n for n in plain if not torch.equal(plain[n], grads[n])]
    assert not differ, f"adaptive: {differ}"


def _lines(path, *records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.mark.parametrize("mutate, message", [
    (lambda h, s: ("not json\n", s), "not JSON"),
    (lambda h, s: ({**h, "format": "x"}, s), "not a spikeguard trace"),
    (lambda h, s: ({**h, "version": 9}, s), "version 9"),
    (lambda h, s: ({**h, "num_layers": 0}, s), "num_layers must be a positive integer"),
    (lambda h, s: ({**h, "ep": 3}, s), "does not divide"),
    (lambda h, s: (h, [{**s[0], "step": 2}]), "expected step 1"),
    (lambda h, s: (h, [{"step": 1, "counts": "x"}]), "list of integers"),
    (lambda h, s: (h, [{"step": 1, "counts": s[0]["counts"][:1]}]), "counts have shape"),
    (lambda h, s: (h, [{"step": 1, "counts": [[[1] * 4] * 2] * 2}]), "do not sum"),
    (lambda h, s: (h, []), "no steps"),
])
def test_malformed_traces_are_clear_errors(tmp_path, mutate, message):
    good = tmp_path / "good.jsonl"
    _write_trace(good, steps=1)
    header, *steps = [json.loads(line) for line in good.read_text().splitlines()]
    header, steps = mutate(header, steps)
    bad = tmp_path / "bad.jsonl"
    text = header if isinstance(header, str) else json.dumps(header) + "\n"
    bad.write_text(text + "".join(json.dumps(s) + "\n" for s in steps))
    with pytest.raises(UsageError, match=message):
        load_trace(bad)


def test_missing_empty_and_mismatched(tmp_path):
    with pytest.raises(UsageError, match="does not exist"):
        load_trace(tmp_path / "nope.jsonl")
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(UsageError, match="empty"):
        load_trace(tmp_path / "empty.jsonl")
    _write_trace(tmp_path / "t.jsonl", steps=2)
    trace = load_trace(tmp_path / "t.jsonl")
    trace.check_matches(num_layers=CFG.num_layers, ep=1, steps=2)
    with pytest.raises(UsageError, match="num_layers is 2 but this run has 3"):
        trace.check_matches(num_layers=3)
    with pytest.raises(UsageError, match="holds 2 steps but 5"):
        trace.check_matches(steps=5)
    with pytest.raises(UsageError, match="steps 1..2"):
        TraceReplayer(build_model(CFG, seed=0), trace).set_step(3)
