"""The one spread helper of the benches (spikeguard/bench/spread.py) on hand-made numbers,
and every bench's table showing a ratio's spread and the rounds a +-0.01 would need.

    .venv/bin/python -m pytest tests/bench/test_bench_spread.py -q
"""

from __future__ import annotations

import json

import pytest

from spikeguard.bench import spread
from spikeguard.bench.runtime_ratios import print_table, summarize_ratios


def test_quartiles_range_and_rounds_for_0_01_by_hand():
    s = spread.spread([1.02, 0.98, 1.00])
    # Inclusive quartiles of 0.98, 1.00, 1.02: halfway between neighbours.
    assert (s["median"], s["q1"], s["q3"]) == pytest.approx((1.00, 0.99, 1.01))
    assert (s["min"], s["max"], s["n"]) == (0.98, 1.02, 3)
    assert s["sd"] == pytest.approx(0.02)
    # ceil((1.96 x 1.2533 x 0.02 / 0.01)^2) = ceil(4.9129^2) = ceil(24.137) = 25
    assert s["n_for_0.01"] == 25
    # sd 0.005: ceil((1.96 x 1.2533 x 0.5)^2) = ceil(1.2282^2) = ceil(1.509) = 2
    assert spread.rounds_for(0.005) == 2
    assert spread.rounds_for(0.0) == 1   # no spread seen: one round says it
    assert spread.cell(s) == "1.000 (0.99-1.01)"
    assert spread.needed(s) == "~25"
    assert spread.rounds_text(s) == "3 rounds, range 0.98-1.02, ~25 resolve +-0.01"


def test_quartiles_stay_inside_the_range_and_one_round_has_no_n():
    two = spread.spread([1.0, 2.0])
    assert 1.0 <= two["q1"] <= two["q3"] <= 2.0
    assert (two["q1"], two["q3"]) == pytest.approx((1.25, 1.75))
    one = spread.spread([0.9])
    assert (one["q1"], one["median"], one["q3"], one["sd"], one["n_for_0.01"]) == \
        (0.9, 0.9, 0.9, None, None)
    assert spread.needed(one) == "-"
    assert spread.of([]) is None
    with pytest.raises(ValueError):
        spread.spread([])


def test_the_ratio_is_per_round_the_ceilings_seconds_over_the_policys():
    # Round 1: the policy took 2 s against the ceiling's 1 s (0.5); round 2: 4 s vs 1 s.
    s = spread.ratio_spread([2.0, 4.0], [1.0, 1.0])
    assert (s["min"], s["max"], s["median"]) == pytest.approx((0.25, 0.5, 0.375))
    with pytest.raises(ValueError):
        spread.ratio_spread([1.0], [1.0, 2.0])


def test_runtime_ratios_table_shows_each_ratio_with_its_spread_and_rounds(capsys):
    # Hand-made seconds per round (no guards: every row's memory is the ceiling's).
    times = {"ceiling": [1.0, 1.0, 1.0, 1.0], "full": [1.25, 1.6, 1.5, 1.4],
             "adaptive": [1.02, 1.0, 1.05, 1.1]}
    result = summarize_ratios(times, {}, 1000, 100, 85, "hand")
    full = spread.ratio_spread(times["full"], times["ceiling"])
    assert result["policies"]["full"]["vs_ceiling"] == full
    assert result["full_over_ceiling"] == full["median"]
    print_table(result)
    out = capsys.readouterr().out
    assert "quartiles" in out and "rounds for +-0.01" in out
    for name in ("full", "adaptive"):
        s = result["policies"][name]["vs_ceiling"]
        row = next(line for line in out.splitlines() if line.strip("│ ").startswith(name))
        cells = [c.strip() for c in row.strip().strip("│").split("│")]
        assert cells[2:5] == [f"{s['median']:.3f}", f"{s['q1']:.2f}-{s['q3']:.2f}",
                              spread.needed(s)]


def test_titan_table_shows_each_ratio_with_its_spread_and_rounds():
    from spikeguard.bench.runtime_ratios import moved_of
    from spikeguard.bench.titan_ratios import SETTINGS, table

    seconds = {"ceiling": [9.0, 1.0, 1.0, 1.0], "none": [9.0, 1.1, 1.0, 1.2],
               "full": [9.0, 2.0, 1.8, 1.6], "adaptive": [9.0, 1.1, 1.3, 1.2]}
    mib = 1 << 20
    # Adaptive's segments, as moved_of sums them from a guard's history: rep 0 (warm-up)
    # evicted too, and is not counted.
    moved = moved_of([{"decisions": {"save": 7, "offload": 1}, "evicted_bytes": mib,
                       "prefetched_bytes": mib}, {"decisions": {"save": 8}}])
    assert moved == {"decisions": {"save": 15, "recompute": 0, "offload": 1},
                     "evicted_bytes": mib, "prefetched_bytes": mib}
    cpu = {"ceiling": [5.0, 1.0, 1.0, 1.0], "none": [5.0, 1.05, 1.0, 1.1],
           "full": [5.0, 1.5, 1.6, 1.4], "adaptive": [5.0, 1.1, 1.0, 1.2]}
    rows = [{"rep": rep, "setting": s, "s": seconds[s][rep], "cpu_s": cpu[s][rep],
             "tokens": 100, "steps": 2,
             **(moved | {"calm": rep % 2} if s == "adaptive" else {})}
            for rep in range(4) for s in seconds]
    lines = table(rows, {s: 2**20 for s in SETTINGS})
    assert "rounds for +-0.01" in lines[0] and "evicted" in lines[0] and "CPU" in lines[0]
    by = {line.split(" | ")[0].strip("| "): line for line in lines[2:]}
    for s in ("none", "full", "adaptive"):   # rep 0 is the warm-up, dropped
        want = spread.ratio_spread(seconds[s][1:], seconds["ceiling"][1:])
        on_cpu = spread.ratio_spread(cpu[s][1:], cpu["ceiling"][1:])
        lo, hi = on_cpu["ci95"]
        assert f"| {spread.cell(want)} | {spread.needed(want)} | {on_cpu['median']:.3f} " \
               f"[{lo:.2f}-{hi:.2f}] ({spread.needed(on_cpu)}) |" in by[s]
    # 3 timed rounds of 2 steps, 2 micro-batches each: 12 forwards, reps 1 and 3 one calm
    assert by["adaptive"].endswith("| 45 / 0 / 3 | 3 MiB (3 MiB back) | 2 of 12 |")
    assert by["ceiling"].endswith("| - | - | 1.00 MiB | - | - | - |")   # no rounds, no CPU


def test_the_medians_interval_is_the_order_statistics_of_a_binomial_by_hand():
    # n = 100: 50 -+ 1.96 x 10 / 2 = 40.2 .. 60.8 (+1): the 40th and the 61st value.
    values = [i / 100 for i in range(1, 101)]
    s = spread.spread(values)
    assert s["ci95"] == [0.40, 0.61] and json.loads(json.dumps(s)) == s   # JSON as it is
    assert spread.interval(s) == "0.400-0.610"
    assert spread.median_interval([0.1, 0.2, 0.3]) == (0.1, 0.3)   # few rounds: all of them
    assert spread.spread([0.9])["ci95"] == [0.9, 0.9]


def test_the_medians_interval_covers_the_true_median_95_times_in_100():
    import random
    rng = random.Random(7)
    for n in (11, 30, 120):
        covered = sum(lo <= 0.0 <= hi for lo, hi in (
            spread.median_interval(sorted(rng.gauss(0.0, 1.0) for _ in range(n)))
            for _ in range(1500)))
        assert covered / 1500 >= 0.94, (n, covered)
        assert covered / 1500 < 1.0, n   # an interval of the whole range would cover always
