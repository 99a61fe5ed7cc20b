"""`spikeguard bench --pp 2 --ep 2`: the pipeline through the same harness as the EP bench
(one trace replayed by every policy, `none` killed by the spikes and restarted from its
checkpoints), and a bad layout refused in one line, exit 2, before any process starts.

    .venv/bin/python -m pytest tests/bench/test_bench_pipeline.py -q

The real run is 6 jobs of 4 processes each: about 60 s on 2 idle CPU cores, 190 s on
2 cores shared with other jobs (hence the generous timeouts).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from spikeguard import cli
from spikeguard.bench.runner import read_log

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]

TINY_PIPELINE = ["--preset", "tiny", "--num-layers", "4", "--num-experts", "8",
                 "--pp", "2", "--ep", "2"]


@pytest.mark.parametrize("extra, match", [
    (["--pp", "3"], "must divide the 4 layers"),
    (["--num-experts", "6", "--ep", "4"], "must divide the number of experts"),
    (["--micro-batches", "3"], "multiple of --pp 2"),
    (["--schedule", "interleaved", "--num-layers", "2"], "must divide the 2 layers"),
    (["--dp", "0"], "--dp must be positive"),
])
def test_a_bad_layout_is_one_line_exit_2_before_any_process(tmp_path, capsys, extra, match):
    argv = ["bench", *TINY_PIPELINE, "--work", str(tmp_path / "w"), *extra]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and match in err[0], err
    assert not (tmp_path / "w").exists()


def test_a_short_real_pipeline_bench(tmp_path):
    work, out = tmp_path / "work", tmp_path / "bench.json"
    policies = ("ceiling", "none", "adaptive")
    proc = subprocess.run(
        [sys.executable, "-m", "spikeguard", "bench", *TINY_PIPELINE, "--steps", "4",
         "--segments", "1", "--checkpoint-every", "1", "--pattern", "one-hot-rank",
         "--spike-prob", "0.5", "--spike-max", "2", "--skew-seed", "9",  # one spike: step 3
         "--policies", ",".join(policies),
         "--work", str(work), "--json", str(out)],
        capture_output=True, text=True, timeout=560)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads(out.read_text())
    w = report["workload"]
    assert (w["pp"], w["ep"], w["dp"], w["nproc"], w["micro_batches"]) == (2, 2, 1, 4, 2)
    assert w["spike_steps"], "the seed must give at least one spike"
    pol = report["policies"]
    assert report["order"] == list(policies)
    for name in policies:
        f = pol[name]
        assert f["tokens_per_s"] > 0 and f["relative_to_ceiling"] > 0, name
        assert f["peak_bytes"] > 0 and f["effective_relative_to_ceiling"] is not None, name
    assert pol["none"]["oom_events"] >= 1 and pol["none"]["restarts"] == pol["none"]["oom_events"]
    assert pol["none"]["lost_seconds"] > 0
    assert pol["adaptive"]["oom_events"] == 0 and pol["adaptive"]["overruns"] == 0
    assert pol["adaptive"]["peak_bytes"] <= report["budget_bytes"]
    assert sum(pol["adaptive"]["decisions"].values()) > 0
    # every job ran the pipeline on 4 processes, and rank 0 (stage 0) received the same
    # routed copies per layer and micro-batch in every one, the measurement pass included
    received: dict = {}
    for log in sorted((work / "logs").glob("*.jsonl")):
        if ".rank" in log.name:   # the other ranks' own logs
            continue
        for r in read_log(log):
            if r.get("skipped"):
                continue
            assert r["stages"] == [0] and len(r.get("rank_peak_bytes", [0] * 4)) == 4, log
            seen = tuple((e["layer"], e["micro_batch"], e["received"]) for e in r["routing"])
            received.setdefault(r["step"], set()).add(seen)
    assert len(received) == 4 and all(len(s) == 1 for s in received.values()), received
    assert "OOM + restarts" in proc.stdout
