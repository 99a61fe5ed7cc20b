"""torchtitan's own activation checkpointing as rows of spikeguard.bench.titan_ratios:
which blocks each setting wraps (torchtitan's FullAC / SelectiveAC, applied as its
parallelize_fn applies them), that the model computes the same gradients under them
(bitwise) and gets its own blocks back, that a row past the budget reads `ran out`, and that
every row is in the bench's table with its spread and peak.

    .venv/bin/python -m pytest tests/integrations/test_integrations_titan_ac_rows.py -q
"""

from __future__ import annotations

import pytest

pytest.importorskip("torchtitan")

from titan_helpers import batches, bitwise, build, step  # noqa: E402

from spikeguard.bench.titan_ratios import (  # noqa: E402
    SETTINGS, TITAN_AC, apply_titan_ac, main, restore_blocks, table)

pytestmark = [pytest.mark.timeout(300), pytest.mark.filterwarnings("ignore:In CPU autocast")]


def _wrapped(model) -> list[str]:
    return [name for name, block in model.layers.named_children()
            if type(block).__name__ == "CheckpointWrapper"]


@pytest.mark.parametrize("setting, wrapped", [("titan-full", ["0", "1", "2"]),
                                              ("titan-op", ["0", "1", "2"]),
                                              ("titan-every-2", ["1"])])
def test_torchtitans_ac_gives_the_same_gradients_and_the_blocks_back(setting, wrapped):
    data = batches(3)
    reference = step(build(), data)
    model = build()
    blocks = dict(model.layers.named_children())
    originals = apply_titan_ac(model, setting)
    assert _wrapped(model) == wrapped
    assert bitwise(reference, step(model, data)), setting   # recompute: the same arithmetic
    restore_blocks(model, originals)
    assert dict(model.layers.named_children()) == blocks and _wrapped(model) == []


def test_an_ac_row_past_the_budget_ran_out():
    rows = [{"rep": rep, "setting": s, "s": 1.0 + rep / 10, "tokens": 100}
            for rep in range(3) for s in SETTINGS]
    mib = 1 << 20
    peaks = {s: 2 * mib for s in SETTINGS} | {"titan-op": 4 * mib}
    by = {line.split(" | ")[0].strip("| "): line for line in table(rows, peaks, 3 * mib)[2:]}
    assert "| ran out |" in by["titan-op"]
    assert all("ran out" not in by[s] for s in SETTINGS if s != "titan-op")


@pytest.mark.multiprocess
@pytest.mark.slow
def test_every_row_is_in_the_table_with_its_spread_and_peak(capsys):
    assert main(["--reps", "2", "--steps", "2"]) == 0
    out = capsys.readouterr().out
    budget_mib = float(out.split("budget ")[1].split(" MiB")[0])
    rows = {line.split(" | ")[0].strip("| "): line.strip("|").split(" | ")
            for line in out.splitlines() if line.startswith("| ") and "---" not in line}
    assert set(SETTINGS) <= set(rows)
    # the guard's rows count calm forwards among rank 0's 8 timed (2 rounds x 2 steps x 2
    # micro-batches); none's fresh guard runs each step's second forward calm at least
    calm_none = rows["none"][-1].strip()
    assert calm_none.endswith(" of 8") and int(calm_none.split()[0]) >= 2, rows["none"]
    for s in TITAN_AC:
        name, tokens, ratio, needed, cpu, peak, decisions, evicted, calm = \
            (c.strip() for c in rows[s])
        assert float(tokens) > 0 and needed.startswith("~") and calm == "-"
        if ratio != "ran out":   # rank 0's CPU: median [95% interval] (rounds for +-0.01)
            median, rest = cpu.split(" [")
            low, high = (float(v) for v in rest.split("]")[0].split("-"))
            assert low - 0.005 <= float(median) <= high + 0.005 and rest.endswith(")")
        peak_mib = float(peak.split(" MiB")[0])
        # The device counts the model and AdamW's state (0.77 MiB on this model), the
        # gradients (0.26 MiB) and the activations: 2.1-2.6 MiB measured; 1.0 without the
        # model and its state
        assert 1.6 < peak_mib
        if ratio == "ran out":
            assert peak_mib > budget_mib
        else:
            assert peak_mib <= budget_mib
            median, quartiles = ratio.split(" (")
            low, high = (float(q) for q in quartiles.rstrip(")").split("-"))
            assert low - 0.005 <= float(median) <= high + 0.005   # 2 decimals against 3
        assert (decisions, evicted) == ("-", "-")   # no guard
