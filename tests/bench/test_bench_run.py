"""`spikeguard bench`: bad input before any job, the figures' arithmetic on known jobs, and
one real (short) run: same trace for every policy, `none` dies and is restarted from its
checkpoint with the time it lost measured, `adaptive` stays under the budget.

    .venv/bin/python -m pytest tests/bench/test_bench_run.py -q
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from spikeguard import cli
from spikeguard.bench import results
from spikeguard.bench.bench_cli import _segments
from spikeguard.bench.runner import Job, PolicyRun, read_log

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(400)]


@pytest.mark.parametrize("extra, match", [
    (["--policies", "none,sometimes"], "--policies"),
    (["--policies", "none,none"], "--policies"),
    (["--segments", "9", "--steps", "4"], "exceeds"),
    (["--ep", "1"], "at least 2"),
    (["--steps", "0"], "positive"),
    (["--restart-cost", "-1"], ">= 0"),
    (["--budget", "lots"], "byte size"),
    (["--preset", "huge"], "unknown preset"),
    (["--json", "{tmp}/no/such/dir/x.json"], "does not exist"),
    (["--json", "{tmp}/afile"], "exists; pass --overwrite"),
    (["--restart-cost", "nan"], "finite"),
    (["--restart-cost", "inf"], "finite"),
    (["--plots", "{tmp}/afile"], "is a file"),
    (["--work", "{tmp}"], "not empty"),
])
def test_bad_input_is_one_line_exit_2_before_any_job(tmp_path, capsys, extra, match):
    (tmp_path / "afile").write_text("keep me")
    argv = ["bench", "--work", str(tmp_path / "w")] + [a.replace("{tmp}", str(tmp_path)) for a in extra]
    # (a later --work wins over the first)
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and match in err[0], err
    assert not (tmp_path / "w").exists()
    assert (tmp_path / "afile").read_text() == "keep me"


def _rec(step, seconds=1.0, tokens=100, **extra):
    return {"step": step, "step_time_s": seconds, "tokens": tokens, **extra}


def test_lost_time_is_redone_steps_plus_the_crashed_jobs_overhead():
    run = PolicyRun("none")
    # job 1 trains 1..3 (checkpoint at 2), dies on 4 after 10 s of wall time
    run.jobs.append(Job("none", 1, 6, 10.0, 4, [_rec(1), _rec(2), _rec(3, seconds=2.0)]))
    run.dropped.add(4)
    # the restart resumes at 3 (from the step-2 checkpoint), re-does 3, skips 4, trains 5..6
    run.jobs.append(Job("none", 3, 6, 9.0, None,
                        [_rec(3, seconds=2.5), {"step": 4, "skipped": True, "tokens": 0,
                                                 "step_time_s": 0.0}, _rec(5), _rec(6)]))
    lost, redone, crashes = results.lost_seconds(run)
    assert crashes == 1 and redone == 2.0
    assert lost == pytest.approx(2.0 + (10.0 - 4.0))   # re-done step 3 + overhead beyond steps
    f = results.policy_figures(run, budget=1000, segments=[(1, 6)], restart_cost_s=284.0)
    assert f["tokens"] == 500 and f["train_seconds"] == pytest.approx(6.5)   # steps 1,2,3,5,6
    assert f["dropped_steps"] == [4] and f["oom_events"] == f["restarts"] == 1
    assert f["effective_tokens_per_s"] == pytest.approx(500 / (6.5 + 8.0))
    assert f["effective_tokens_per_s_at_restart_cost"] == pytest.approx(500 / (6.5 + 2.0 + 284))
    records = run.final_records()
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert records[2]["step_time_s"] == 2.5 and records[3]["crashed"]


def test_safe_static_is_the_fastest_survivor_and_segments_cover_the_steps():
    figs = {"none": {"oom_events": 2, "tokens_per_s": 9.0},
            "experts": {"oom_events": 0, "tokens_per_s": 7.0},
            "full": {"oom_events": 0, "tokens_per_s": 5.0},
            "adaptive": {"oom_events": 0, "tokens_per_s": 8.0}}
    assert results.pick_safe_static(figs) == "experts"
    assert results.pick_safe_static({"none": {"oom_events": 1, "tokens_per_s": 1.0}}) is None
    assert _segments(10, 3) == [(1, 3), (4, 7), (8, 10)]
    assert _segments(200, 4)[-1] == (151, 200)


def test_a_short_real_bench(tmp_path):
    work, out = tmp_path / "work", tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "spikeguard", "bench", "--preset", "tiny", "--steps", "4",
         "--segments", "1", "--checkpoint-every", "1", "--pattern", "one-hot-rank",
         "--spike-prob", "0.5", "--spike-max", "2", "--skew-seed", "9",  # one spike: step 3
         "--policies", "ceiling,none,adaptive",
         "--work", str(work), "--json", str(out)],
        capture_output=True, text=True, timeout=380)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["workload"]["spike_steps"], "the seed must give at least one spike"
    pol = report["policies"]
    for name in ("ceiling", "none", "adaptive"):
        for key in ("tokens_per_s", "relative_to_ceiling", "peak_bytes", "budget_bytes",
                    "oom_events", "restarts", "lost_seconds", "effective_tokens_per_s",
                    "decisions"):
            assert key in pol[name], (name, key)
    assert pol["none"]["oom_events"] >= 1 and pol["none"]["restarts"] == pol["none"]["oom_events"]
    assert pol["none"]["lost_seconds"] > 0
    assert pol["adaptive"]["oom_events"] == 0 and pol["adaptive"]["overruns"] == 0
    assert pol["adaptive"]["peak_bytes"] <= report["budget_bytes"]
    assert "safe-static" not in pol     # `none` was the only static policy and it crashed
    # every job replayed the same trace: the cluster's tokens per rank match step by step
    logs = sorted((work / "logs").glob("*.jsonl"))
    loads = {}
    for log in logs:
        for r in read_log(log):
            if "rank_imbalance" in r:
                loads.setdefault(r["step"], []).append(r["rank_imbalance"])
    assert all(all(x == per_step[0] for x in per_step) for per_step in loads.values())
    assert "OOM + restarts" in proc.stdout
    # Reused processes, real deaths: every crash killed its worker (torchrun and both
    # ranks) and a fresh one ran the restart; between crashes one worker ran many jobs.
    workers = sorted((work / "workers").glob("worker*"))
    crashes = sum(f["oom_events"] for n, f in pol.items())
    assert len(workers) == len(report["worker_startups_s"]) == crashes + 1
    jobs = [sorted(w.glob("job*.json")) for w in workers]
    assert sum(map(len, jobs)) == len(list((work / "logs").glob("*.out")))
    assert len(jobs[0]) >= 2   # the measurement pass, the ceiling and none's first part
    for worker in workers[:-1]:   # each ended in its last job: no rank finished it
        last = len(list(worker.glob("job*.json")))
        assert not list(worker.glob(f"job{last:04d}.rank*.done")), worker
    crashed_err = [e.read_text() for e in (work / "logs").glob("*-none.err")]
    assert sum("ran out of memory (exit 3" in e for e in crashed_err) == crashes


def test_ratios_are_ratios_of_totals_discounted_by_lost_time():
    def fig(tps, segs, lost=0.0, redone=0.0, crashes=0, tokens=1000.0):
        seconds = tokens / tps
        return {"tokens_per_s": tps, "train_seconds": seconds, "segment_tokens_per_s": segs,
                "lost_seconds": lost, "redone_seconds": redone, "oom_events": crashes,
                "restart_cost_s": 284.0,
                "effective_tokens_per_s": tokens / (seconds + lost),
                "effective_tokens_per_s_at_restart_cost":
                    tokens / (seconds + redone + crashes * 284.0)}

    figs = {"ceiling": fig(100.0, [100.0, 50.0, 80.0]),
            "none": fig(80.0, [90.0, 50.0, 60.0], lost=12.5, redone=1.0, crashes=1)}
    results.add_ratios(figs)
    assert figs["ceiling"]["relative_to_ceiling"] == 1.0
    # the ratio of totals (80 / 100), not the median of per-segment ratios (0.9)
    assert figs["none"]["relative_to_ceiling"] == pytest.approx(0.8)
    assert figs["none"]["segment_ratios"] == pytest.approx([0.9, 1.0, 0.75])
    assert figs["none"]["effective_relative_to_ceiling"] == pytest.approx(1000 / 25 / 100)
    assert figs["none"]["effective_relative_at_restart_cost"] == pytest.approx(
        1000 / (12.5 + 1 + 284) / 100)
    assert results.pick_safe_static(figs) is None   # `none` crashed


def test_the_table_shows_the_ratio_with_its_spread_over_segments():
    from spikeguard.bench.table import table_rows

    base = {"peak_bytes": 0, "overruns": 0, "oom_events": 0, "lost_seconds": 0.0,
            "redone_seconds": 0.0, "restart_cost_s": 284.0, "train_seconds": 1.0,
            "decisions": {"save": 0, "recompute": 0, "offload": 0}}
    figs = {"ceiling": {**base, "tokens_per_s": 100.0, "effective_tokens_per_s": 100.0,
                        "effective_tokens_per_s_at_restart_cost": 100.0,
                        "segment_tokens_per_s": [100.0, 50.0, 80.0]},
            "none": {**base, "tokens_per_s": 80.0, "effective_tokens_per_s": 80.0,
                     "effective_tokens_per_s_at_restart_cost": 80.0,
                     "segment_tokens_per_s": [90.0, 50.0, 60.0]}}
    results.add_ratios(figs)
    report = {"order": ["ceiling", "none"], "policies": figs,
              "workload": {"restart_cost_s": 284.0}}
    ceiling, none = table_rows(report)
    assert ceiling[2] == "1.000" and none[2] == "0.800 (0.75-1.00)"


def test_evictions_are_counted_in_the_figures_and_shown_in_the_table(tmp_path):
    from spikeguard.bench.table import table_header, table_rows

    mib = 1 << 20
    dec = {"save": 8, "recompute": 0, "offload": 0}
    run = PolicyRun("adaptive")
    run.jobs.append(Job("adaptive", 1, 3, 5.0, None, [
        _rec(1, decisions=dec, rank_decisions=[dec, dec], rank=0, evicted_bytes=3 * mib,
             prefetched_bytes=3 * mib),
        _rec(2, decisions=dec, rank_decisions=[dec, dec], rank=0, evicted_bytes=0),
        _rec(3, decisions=dec, rank_decisions=[dec, dec], rank=0, evicted_bytes=mib)]))
    f = results.policy_figures(run, budget=1000, segments=[(1, 3)], restart_cost_s=284.0)
    assert f["evicted_bytes"] == 4 * mib and f["evicted_steps"] == 2
    assert f["evicted_whose"] == "r0"   # rank 0's log: the cluster record has no per-rank figure
    assert f["prefetched_bytes"] == 3 * mib   # step 3's eviction did not come back in its log
    per_rank = PolicyRun("adaptive")
    per_rank.jobs.append(Job("adaptive", 1, 1, 1.0, None, [
        _rec(1, decisions=dec, rank_decisions=[dec, dec], rank_evicted_bytes=[mib, 2 * mib],
             rank_prefetched_bytes=[mib, mib])]))
    g = results.policy_figures(per_rank, budget=1000, segments=[(1, 1)], restart_cost_s=284.0)
    assert (g["evicted_bytes"], g["evicted_steps"], g["evicted_whose"]) == (3 * mib, 1, "")
    assert g["prefetched_bytes"] == 2 * mib

    f["tokens_per_s"] = f["effective_tokens_per_s"] = 100.0
    results.add_ratios({"adaptive": f})
    report = {"order": ["adaptive"], "policies": {"adaptive": f},
              "workload": {"restart_cost_s": 284.0}}
    row = dict(zip(table_header(report), table_rows(report)[0]))
    assert row["evicted"] == "4 MiB on 2 steps, 3 MiB back (r0)" and row["save/rec/off"] == "48/0/0"
    f.update(segment_tokens_per_s=[100.0], lost_seconds=0.0)
    f2 = {**f, "evicted_bytes": 0}
    assert dict(zip(table_header(report), table_rows(
        {**report, "policies": {"adaptive": f2}})[0]))["evicted"] == "0"


def test_runtime_ratios_table_shows_adaptive_evictions(capsys):
    from types import SimpleNamespace

    from spikeguard.bench import runtime_ratios

    mib = 1 << 20

    def rec(evicted, dec):
        return {"peak_bytes": 80 * mib, "budget_bytes": 97 * mib, "safety_net_reruns": 0,
                "decisions": dec, "evicted_bytes": evicted, "prefetched_bytes": evicted // 2}

    guards = {"full": SimpleNamespace(history=[rec(0, {"save": 0, "recompute": 40, "offload": 0})] * 3),
              "adaptive": SimpleNamespace(history=[rec(int(61.3 * mib), {"save": 40, "recompute": 0,
                                                                           "offload": 0})] * 3)}
    times = {p: [1.0, 1.0] for p in ("ceiling", "full", "adaptive")}
    result = runtime_ratios.summarize_ratios(times, guards, 1000, 115 * mib, 97 * mib, "small")
    assert result["policies"]["adaptive"]["evicted_bytes"] == int(61.3 * mib)
    assert result["policies"]["adaptive"]["prefetched_bytes"] == int(61.3 * mib) // 2
    assert result["policies"]["full"]["evicted_bytes"] == 0
    assert result["policies"]["ceiling"]["evicted_bytes"] is None
    runtime_ratios.print_table(result)
    out = capsys.readouterr().out
    assert "evicted" in out
    adaptive_row = next(line for line in out.splitlines() if "adaptive" in line and "40 / 0 / 0" in line)
    assert "61.3 MiB (30.6 MiB back)" in adaptive_row
