"""`spikeguard simulate` end to end: table, JSON with the issue's keys, plots, scaling."""

import json

import pytest

from spikeguard.cli import main


@pytest.mark.slow
def test_simulate_writes_json_and_plots(tmp_path, capsys):
    out = tmp_path / "sim.json"
    code = main(["simulate", "--preset", "188b", "--devices", "256", "--global-batch", "128",
                 "--steps", "30", "--scaling", "128,256,100", "--json", str(out),
                 "--plots", str(tmp_path)])
    text = capsys.readouterr().out
    assert code == 0
    assert "adaptive" in text and "scaling" in text
    data = json.loads(out.read_text())
    for name in ("ceiling", "none", "experts", "offload", "full", "safe-static", "adaptive"):
        row = data["policies"][name]
        for key in ("mfu", "tokens_per_s", "flops_per_s", "crashes", "lost_seconds", "peak_bytes"):
            assert key in row, (name, key)
        assert len(row["peak_bytes"]) == 8   # one per pipeline stage
    rows = {r["devices"]: r for r in data["scaling"]}
    assert "error" in rows[100] and "policies" in rows[128]
    for png in ("sim_peaks.png", "sim_mfu.png", "sim_scaling.png"):
        assert (tmp_path / png).stat().st_size > 1000


def test_json_to_a_missing_folder_is_a_usage_error(tmp_path, capsys):
    code = main(["simulate", "--preset", "small", "--json", str(tmp_path / "no" / "x.json")])
    assert code == 2
    assert "does not exist" in capsys.readouterr().err
