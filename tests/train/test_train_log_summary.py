"""The per-rank decisions of the step line and the end-of-run memory summary.

    .venv/bin/python -m pytest tests/train/test_train_log_summary.py -q
"""

from __future__ import annotations

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
