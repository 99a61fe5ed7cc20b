"""Every feature in every layout: one loop (spikeguard.train.run) for one process, EP=2,
DP=2 x EP=2 without a pipeline, and PP=2 x EP=2, each through the real command line
(real torchrun processes, gloo).

Per layout, four runs of the same tiny model, all under `--budget auto`:
  record   natural routing, writes trace T;
  straight replays T for 4 steps under adaptive, recording T2;
  prefix   replays T for 2 steps under "full", checkpointing at step 2;
  resumed  resumes that checkpoint under adaptive and replays T to step 4.
A traced run replays bitwise (T2 == T); the policies give bitwise the same training
(prefix's losses are straight's, and a run that changed policy at the checkpoint ends
where straight does); resume is bitwise (resumed's steps 3-4 are straight's); the
automatic budget holds (every step's peak, the worst rank's, within it).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from spikeguard import cli

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]

BASE = ["train", "--preset", "tiny", "--num-layers", "4", "--num-experts", "8",
        "--batch-size", "2", "--micro-batches", "2", "--eval-every", "4",
        "--eval-batches", "1", "--threads", "1", "--budget", "auto"]
LAYOUTS = {
    "one process": [],
    "ep2": ["--nproc", "2"],
    "dp2 x ep2": ["--nproc", "4", "--ep", "2"],
    "pp2 x ep2": ["--nproc", "4", "--pp", "2", "--ep", "2"],
}


def _train(args: list[str], layout: list[str]) -> None:
    argv = BASE + layout + args
    if not layout:   # one process: in this process, through the same main()
        assert cli.main(argv) == 0
        return
    done = subprocess.run([sys.executable, "-m", "spikeguard", *argv], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def _records(path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, path.read_text().splitlines())}


def _counts(path) -> list:
    return [json.loads(line)["counts"] for line in path.read_text().splitlines()[1:]]


@pytest.fixture(scope="module", params=list(LAYOUTS), ids=list(LAYOUTS))
def layout_runs(request, tmp_path_factory):
    layout = LAYOUTS[request.param]
    d = tmp_path_factory.mktemp(request.param.replace(" ", ""))
    trace, ck = d / "t.jsonl", d / "ck"
    _train(["--steps", "4", "--policy", "adaptive", "--record-trace", str(trace)], layout)
    _train(["--steps", "4", "--policy", "adaptive", "--trace", str(trace),
            "--record-trace", str(d / "t2.jsonl"), "--log", str(d / "straight.jsonl")], layout)
    _train(["--steps", "2", "--policy", "full", "--trace", str(trace),
            "--checkpoint-dir", str(ck), "--checkpoint-every", "2",
            "--log", str(d / "prefix.jsonl")], layout)
    _train(["--steps", "4", "--policy", "adaptive", "--trace", str(trace),
            "--checkpoint-dir", str(ck), "--resume", "--log", str(d / "resumed.jsonl")], layout)
    return d


def test_a_traced_run_replays_its_trace_bitwise(layout_runs):
    expected = _counts(layout_runs / "t.jsonl")
    assert len(expected) == 4
    assert _counts(layout_runs / "t2.jsonl") == expected


def test_policies_and_resume_give_bitwise_the_straight_run(layout_runs):
    straight = _records(layout_runs / "straight.jsonl")
    prefix = _records(layout_runs / "prefix.jsonl")
    resumed = _records(layout_runs / "resumed.jsonl")
    assert sorted(prefix) == [1, 2] and sorted(resumed) == [3, 4]
    for step in (1, 2):   # "full" against adaptive: the same training, to the bit
        assert prefix[step]["loss"] == straight[step]["loss"], step
        assert prefix[step]["grad_norm"] == straight[step]["grad_norm"], step
    for step in (3, 4):   # resumed (after a "full" prefix) against straight
        assert resumed[step]["loss"] == straight[step]["loss"], step
        assert resumed[step]["grad_norm"] == straight[step]["grad_norm"], step
    assert resumed[4]["val_loss"] == straight[4]["val_loss"]


def test_the_automatic_budget_holds_on_every_step(layout_runs):
    for name in ("straight", "prefix", "resumed"):
        for record in _records(layout_runs / f"{name}.jsonl").values():
            budget = record["budget_bytes"]
            assert budget > 0
            assert record.get("max_peak_bytes", record["peak_bytes"]) <= budget, (name, record)


@pytest.mark.parametrize("extra,match", [
    (["--hf", "mixtral", "--nproc", "2", "--pp", "2", "--ep", "1"],
     "--pp is not available with --hf"),
    (["--skew", "rotating"], "--skew needs expert parallelism"),
    (["--nproc", "2", "--skew", "rotating", "--trace", "x.jsonl"], "cannot be combined with --skew"),
    (["--schedule", "interleaved"], "needs a pipeline"),
    (["--nproc", "2", "--pp", "2", "--micro-batches", "3"], "multiple of --pp"),
])
def test_what_still_cannot_combine_is_one_line(extra, match, capsys):
    assert cli.main(BASE[:-2] + ["--steps", "1"] + extra) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and match in err[0], err
