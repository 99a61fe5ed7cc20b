"""The per-rank decisions of the step line and the end-of-run memory summary.

    .venv/bin/python -m pytest tests/train/test_train_log_summary.py -q
"""

from __future__ import annotations

import pytest

from spikeguard.memory.budget import format_bytes
from spikeguard.train.log import memory_summary, step_line

BASE = {"step": 3, "loss": 2.5, "tokens_per_s": 1000.0, "imbalance": 1.5,
        "peak_bytes": 900, "budget_bytes": 1000}


def _d(save, rec=0, off=0):
    return {"save": save, "recompute": rec, "offload": off}


def test_step_line_gives_decisions_per_rank():
    record = {**BASE, "decisions": _d(8), "rank_decisions": [_d(5, 2, 1), _d(8)]}
    assert step_line(record, 10).endswith("save 5+8 rec 2+0 off 1+0")
    assert step_line({**BASE, "decisions": _d(8, 1)}, 10).endswith("save 8 rec 1 off 0")


def test_memory_summary_counts_overruns_reruns_and_spike_decisions():
    records = [
        {**BASE, "max_peak_bytes": 950, "skew_spike": False, "rank_decisions": [_d(4), _d(4)]},
        {**BASE, "max_peak_bytes": 1010, "skew_spike": True, "safety_net_reruns": 1,
         "rank_decisions": [_d(1, 2, 1), _d(4)]},
        {**BASE, "max_peak_bytes": 990, "skew_spike": True, "rank_decisions": [_d(2, 0, 2), _d(4)]},
    ]
    text = memory_summary(records)
    assert "peak 1010.00 B / 1000.00 B" in text
    assert "| 1 steps over |" in text and "1 safety-net re-runs" in text
    assert "2 spike steps: save 11 rec 2 off 3" in text
    assert "1 calm steps: save 8 rec 0 off 0" in text


def test_memory_summary_is_empty_without_a_guard():
    assert memory_summary([{"step": 1, "loss": 1.0}]) == ""


MIB = 1 << 20


def test_step_line_shows_evictions_only_when_there_are_some():
    record = {**BASE, "decisions": _d(8), "evicted_bytes": int(61.3 * MIB),
              "prefetched_bytes": int(61.3 * MIB)}
    assert step_line(record, 10).endswith("save 8 rec 0 off 0 | evict 61.3 MiB back 61.3 MiB")
    # Evicted and not (yet) brought back: the step line says so rather than assume it.
    assert step_line({**record, "prefetched_bytes": 0}, 10).endswith("evict 61.3 MiB back 0")
    assert "evict" not in step_line({**BASE, "decisions": _d(8), "evicted_bytes": 0}, 10)
    assert "evict" not in step_line({**BASE, "decisions": _d(8)}, 10)
    with_val = step_line({**record, "val_loss": 2.0}, 10)
    assert with_val.endswith("| evict 61.3 MiB back 61.3 MiB | val 2.000")


def test_step_line_evictions_per_rank_or_named_as_one_rank():
    per_rank = {**BASE, "rank_decisions": [_d(8), _d(8)],
                "rank_evicted_bytes": [0, int(61.3 * MIB)],
                "rank_prefetched_bytes": [0, int(60 * MIB)]}
    assert step_line(per_rank, 10).endswith(
        "save 8+8 rec 0+0 off 0+0 | evict 0+61.30 MiB back 0+60.00 MiB")
    # A cluster record without every rank's figure: its own is shown as that rank's.
    own = {**BASE, "rank": 0, "rank_decisions": [_d(8), _d(8)], "evicted_bytes": 2 * MIB}
    assert step_line(own, 10).endswith("| evict 2 MiB r0 back 0")


def test_memory_summary_totals_evictions():
    records = [{**BASE, "decisions": _d(8), "evicted_bytes": 3 * MIB, "prefetched_bytes": 3 * MIB},
               {**BASE, "decisions": _d(8), "evicted_bytes": 0},
               {**BASE, "decisions": _d(8), "evicted_bytes": 1 * MIB}]
    assert memory_summary(records).endswith(
        "0 safety-net re-runs | evicted 4 MiB on 2 steps, 3 MiB back")
    assert "evicted" not in memory_summary([{**BASE, "evicted_bytes": 0}])
    cluster = [{**BASE, "rank_evicted_bytes": [MIB, 2 * MIB], "rank_decisions": [_d(1), _d(1)],
                "rank_prefetched_bytes": [MIB, MIB]}]
    assert "| evicted 3 MiB on 1 steps, 2 MiB back" in memory_summary(cluster)


def test_a_run_that_evicts_says_so_in_its_step_lines_summary_and_json_log(tmp_path, capsys):
    """A real run (transformers' tiny Mixtral at its auto budget evicts earlier layers'
    saved tensors every step, seen: 0.5-1.9 MiB): its JSON records carry `evicted_bytes`,
    and the step lines and the summary show the same figures."""
    import json

    pytest.importorskip("transformers")
    from spikeguard import cli

    log = tmp_path / "run.jsonl"
    assert cli.main(["train", "--hf", "mixtral", "--steps", "2", "--threads", "1",
                     "--log", str(log)]) == 0
    out = capsys.readouterr().out
    records = [json.loads(line) for line in log.read_text().splitlines()]
    evicted = [r["evicted_bytes"] for r in records if "evicted_bytes" in r]
    assert len(evicted) == 2 and sum(evicted) > 0, records
    back = [r["prefetched_bytes"] for r in records if "evicted_bytes" in r]
    assert back == evicted, records   # backward reads every evicted tensor
    lines = [line for line in out.splitlines() if line.startswith("step ")]
    for line, num_bytes in zip(lines, evicted):
        assert (f"| evict {format_bytes(num_bytes)} back {format_bytes(num_bytes)}" in line) \
            == bool(num_bytes), line
    assert (f"| evicted {format_bytes(sum(evicted))} on {sum(1 for b in evicted if b)} steps, "
            f"{format_bytes(sum(back))} back") in out
