"""The oracle bench (spikeguard/bench/oracle_bench.py): bad input, and the oracle's plan run
for real on `tiny`: the per-layer plans it chose are the ones the executor applied, the
layers it evicts go to host and come back, the gradients are bitwise the plain model's,
and the device stays under the budget it was solved for.

    .venv/bin/python -m pytest tests/bench/test_bench_oracle.py
"""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

import spikeguard
from spikeguard.bench import oracle_bench
from spikeguard.bench.runtime_ratios import plain_step
from spikeguard.bench.spread import cell, needed, spread
from spikeguard.data.corpus import load_corpus
from spikeguard.model import build_model, model_config
from spikeguard.plan.catalogue import OPS
from spikeguard.plan.oracle_evict import solve_evict

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("extra, match", [
    (["--fractions", "0.85,0"], "--fractions must each be in"),
    (["--fractions", "0.8;0.7"], "--fractions must be numbers"),
    (["--fractions", "nan"], "--fractions must each be in"),
    (["--reps", "0"], "--reps must be positive"),
    (["--threads", "100000000"], r"\[1, 4096\]"),
    (["--preset", "huge"], "unknown preset"),
])
def test_bad_input_is_one_line_exit_2(capsys, extra, match):
    import re

    assert oracle_bench.main(extra) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and re.search(match, err), err


def test_an_existing_json_needs_overwrite(tmp_path, capsys):
    old = tmp_path / "old.json"
    old.write_text("{}")
    assert oracle_bench.main(["--json", str(old)]) == 2
    assert "--overwrite" in capsys.readouterr().err and old.read_text() == "{}"


def _setup(fraction: float):
    torch.manual_seed(0)
    cfg = model_config("tiny")
    gen = torch.Generator().manual_seed(0)
    corpus = load_corpus(None)
    batches = [corpus.get_batch("train", 4, cfg.seq_len, gen) for _ in range(2)]
    peak, seen = oracle_bench.probe(cfg, 0, batches)
    budget = int(fraction * peak)
    adaptive = spikeguard.attach(build_model(cfg, seed=0), budget=budget, policy="adaptive")
    adaptive.run_step(lambda: plain_step(adaptive.model, batches))
    problems = oracle_bench.oracle_problems(seen, adaptive, budget)
    return cfg, batches, budget, problems, adaptive.cost.offload_s_for_bytes


@pytest.mark.slow
def test_the_oracle_plan_runs_for_real_bitwise_and_under_its_budget():
    cfg, batches, budget, problems, evict_s = _setup(0.7)
    solutions = {mb: solve_evict(p, evict_s) for mb, p in problems.items()}
    assert all(s.feasible for s in solutions.values())
    choices = {(mb, i): problems[mb].layers[i].options[c].label
               for mb, s in solutions.items() for i, c in enumerate(s.choices)}
    evict_at = {(mb, i): n for mb, s in solutions.items() for i, n in enumerate(s.evict_at)}
    assert len({c.plan for c in choices.values()}) > 1, "a cut that changes nothing tests nothing"
    guard = spikeguard.attach(build_model(cfg, seed=0), budget=budget, policy="none")
    guard.decide = oracle_bench.PlanTable(guard, choices, evict_at).decide
    guard.run_step(lambda: plain_step(guard.model, batches))
    plain = build_model(cfg, seed=0)
    plain_step(plain, batches)
    for (name, p), q in zip(guard.model.named_parameters(), plain.parameters()):
        assert torch.equal(p.grad, q.grad), name
    record = guard.history[-1]
    assert record["peak_bytes"] <= budget and record["safety_net_reruns"] == 0
    want = Counter(a.value for c in choices.values() for a in c.plan.actions)
    assert {k: v for k, v in record["decisions"].items() if v} == dict(want)
    planned = sum(evict_at.values())
    assert planned > 0, "the 0.7x cut of tiny plans evictions: they are tested here"
    assert record["evicted_bytes"] >= planned   # whole tensors: at least what was asked
    assert record["prefetched_bytes"] >= record["evicted_bytes"]


@pytest.mark.slow
def test_the_bench_on_tiny_writes_every_row(tmp_path, capsys):
    out = tmp_path / "oracle.json"
    assert oracle_bench.main(["--preset", "tiny", "--reps", "2", "--fractions", "0.7",
                              "--batch-size", "4", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    (budget,) = result["budgets"]
    ran = set(budget["policies"]) | set(budget["not_run"])
    assert ran == {"ceiling", "full", "none", "experts", "offload", "oracle", "adaptive"}
    assert "adaptive/oracle" in printed and "static in hindsight" in printed
    assert budget["policies"]["oracle"]["overruns"] == 0
    # Every ratio with its quartiles and the rounds a +-0.01 would need (bench/spread.py).
    assert "| vs ceiling | rounds for +-0.01 |" in printed
    for name, row in budget["policies"].items():
        vs = row["vs_ceiling"]
        assert vs["n"] == 2 and vs == spread([vs["min"], vs["max"]])   # the shared helper's
        if name != "ceiling":
            assert f"| {cell(vs)} | {needed(vs)} |" in printed
    ao = budget["adaptive_over_oracle"]
    assert f"adaptive/oracle {cell(ao)}" in printed and f"{needed(ao)} rounds" in printed
    # The cost model's figures (the oracle re-solved on adaptive's byte and cost model as
    # the run ended: its calibration moved since the oracle's plans were solved).
    pred = budget["predicted"]
    assert "on the cost model" in printed
    assert pred["adaptive_s"] >= 0 and pred["oracle_s"] >= 0 and pred["oracle_run_s"] >= 0


@pytest.mark.slow
def test_the_tally_costs_adaptive_last_step_as_the_planner_does():
    cfg, batches, budget, _, _ = _setup(0.7)
    guard = spikeguard.attach(build_model(cfg, seed=0), budget=budget, policy="adaptive")
    tally = oracle_bench.Tally(guard)
    guard.decide = tally.decide
    for _ in range(2):
        guard.run_step(lambda: plain_step(guard.model, batches))
    assert len(tally.last) == cfg.num_layers * len(batches) - guard.history[-1]["full_layers"]
    counted = Counter(a.value for plan, _ in tally.last for a in plan.actions)
    counted["recompute"] += guard.history[-1]["full_layers"] * len(OPS)   # whole layers
    assert {k: v for k, v in guard.history[-1]["decisions"].items() if v} == \
        {k: v for k, v in counted.items() if v}


def test_the_ep_bench_outside_torchrun_is_one_line_exit_2(capsys):
    from spikeguard.bench import oracle_ep

    assert oracle_ep.main(["--preset", "tiny"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "under torchrun" in err, err


@pytest.mark.multiprocess
@pytest.mark.slow
def test_the_ep_bench_on_two_ranks_keeps_every_rank_under_its_own_budget(tmp_path):
    """spikeguard/bench/oracle_ep.py on 2 gloo ranks (tiny, 2 rounds): every row on both
    ranks, each rank's budget the fraction of its own true peak, every row that ran under
    it on every rank, and the oracle run for real on each rank: a plan for every layer
    and micro-batch, no overrun, no re-run."""
    import subprocess
    import sys

    out = tmp_path / "ep.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", "-m", "spikeguard.bench.oracle_ep", "--preset", "tiny", "--reps", "2",
           "--batch-size", "4", "--fractions", "0.85,0.7", "--json", str(out)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    except subprocess.TimeoutExpired:
        pytest.fail("the 2-rank oracle bench did not finish in 240 s (hang)")
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    cfg = model_config("tiny")
    assert result["ep"] == 2 and result["tokens_per_step"] == 2 * 4 * 2 * cfg.seq_len
    assert [b["fraction"] for b in result["budgets"]] == [0.85, 0.7]
    for b in result["budgets"]:
        assert set(b["policies"]) | set(b["not_run"]) == {
            "ceiling", "full", "none", "experts", "offload", "oracle", "adaptive"}
        assert "oracle" in b["policies"] and "adaptive_over_oracle" in b, b["not_run"]
        assert len(b["ranks"]) == 2
        # Each rank on its own data: its own true peak, and its budget that share of it.
        assert b["ranks"][0]["true_peak_bytes"] != b["ranks"][1]["true_peak_bytes"]
        for r in b["ranks"]:
            assert r["budget_bytes"] == int(b["fraction"] * r["true_peak_bytes"])
            assert set(r["policies"]) == set(b["policies"])   # the same rows on every rank
            for name, row in r["policies"].items():
                if name != "ceiling":
                    assert row["peak_bytes"] <= r["budget_bytes"], (name, row)
                    assert row["overruns"] == 0, (name, row)
            oracle = r["policies"]["oracle"]
            assert oracle["safety_net_reruns"] == 0
            assert sum(oracle["decisions"].values()) == cfg.num_layers * 2 * len(OPS)
            assert r["predicted"]["oracle_s"] is not None
    assert "adaptive/oracle" in done.stdout and "rank 1: on the cost model" in done.stdout


def test_the_ep_table_says_why_an_oracle_that_had_plans_did_not_run():
    """oracle_ep's table: an oracle row that every rank had plans for but that ran out of
    memory shows that note (it showed an empty cell: only 'no combination' notes were
    kept, the `medium` 0.7x run of docs/oracle.md)."""
    from spikeguard.bench import oracle_ep

    spread_1 = {"median": 1.0, "q1": 1.0, "q3": 1.0, "min": 1.0, "max": 1.0, "n": 2}
    mem = {"peak_bytes": 10, "overruns": 0, "safety_net_reruns": 0, "decisions": {},
           "evicted_bytes": None, "prefetched_bytes": None, "note": ""}
    predicted = {"oracle_s": 0.1, "adaptive_s": 0.1, "adaptive_full_layers": 0}
    oom = "out of memory: rank 0 ran out of memory in forward of micro-batch 1, layer 5"
    ranks = [{"budget_bytes": 100, "true_peak_bytes": 140, "predicted": predicted,
              "oracle": oom, "policies": {"ceiling": dict(mem)}} for _ in range(2)]
    result = {"preset": "tiny", "ep": 2, "reps": 2, "tokens_per_step": 100, "budgets": [{
        "fraction": 0.7, "static_in_advance": None, "static_in_hindsight": "full",
        "policies": {"ceiling": {"median_s": 1.0, "vs_ceiling": spread_1}},
        "not_run": {"oracle": oom}, "gap_closed": float("nan"), "ranks": ranks}]}
    row = next(line for line in oracle_ep.table_lines(result) if line.startswith("| oracle |"))
    assert oom in row, row


@pytest.mark.slow
def test_layers_recomputed_whole_are_noted_and_costed_at_least_their_expert_path():
    """The cost model's line costs adaptive's whole-layer fallbacks (they were left out,
    "not costed": `medium` at 0.7x read 0.88x the oracle's with one such layer) at least
    at their expert paths' recompute, for the routed counts the probe saw there. Forced
    here as in tests/runtime/test_runtime_layer_fallback.py: host copies priced dear, a
    budget between full recompute's peak and offload's."""
    cfg = model_config("tiny", num_layers=3)
    gen = torch.Generator().manual_seed(0)
    batches = [load_corpus(None).get_batch("train", 8, cfg.seq_len, gen) for _ in range(2)]
    _, seen = oracle_bench.probe(cfg, 0, batches)

    def peak(policy):
        g = spikeguard.attach(build_model(cfg, seed=0), budget="1GiB", policy=policy)
        g.run_step(lambda: plain_step(g.model, batches))
        return g.history[-1]["peak_bytes"]

    budget = (peak("full") + peak("offload")) // 2
    guard = spikeguard.attach(build_model(cfg, seed=0), budget=budget, policy="adaptive")
    guard.cost.d2h_s_per_byte = guard.cost.h2d_s_per_byte = 1e-3
    guard.cost.freeze()
    guard.planner.refresh()
    tally = oracle_bench.Tally(guard)
    guard.decide = tally.decide
    for _ in range(3):
        guard.run_step(lambda: plain_step(guard.model, batches))
    record = guard.history[-1]
    assert record["safety_net_reruns"] == 0 and record["full_layers"] > 0
    assert len(tally.whole) == record["full_layers"]
    assert len(tally.last) + len(tally.whole) == cfg.num_layers * len(batches)
    routed = {(mb, layer): n for mb, layer, _, n, *_ in seen}
    p = oracle_bench.predicted(oracle_bench.oracle_problems(seen, guard, budget, tally.room),
                               seen, guard, tally, None)
    expected = sum(guard.planner.whole_recompute_s(routed[w]) for w in tally.whole)
    assert p["adaptive_full_layers"] == record["full_layers"]
    assert p["adaptive_whole_s"] == expected > 0
    line = oracle_bench.predicted_line(dict(p, oracle_s=p["adaptive_s"] or 1.0))
    assert f"at least {expected * 1e3:.1f} ms more" in line, line
