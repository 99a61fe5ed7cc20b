"""`spikeguard bench` reads one typed configuration (issue 23 item 5): BenchConfig is built
once from the command line, the Namespace is left as argparse made it, and what every job
runs is read from the measurement pass's RunConfig (micro-batches and processes resolved
by train's own configuration, not re-derived by the bench)."""

from __future__ import annotations

import copy
import dataclasses

import pytest

from spikeguard import cli
from spikeguard.bench.bench_cli import _workload
from spikeguard.bench.bench_config import BenchConfig


def _args(argv: list[str]):
    args = cli._build_parser().parse_args(argv)
    args.argv = argv
    return args


def test_the_namespace_is_read_never_written(tmp_path):
    args = _args(["bench", "--preset", "tiny", "--pp", "2", "--ep", "2", "--steps", "4",
                  "--segments", "2", "--budget", "3MiB", "--work", str(tmp_path / "w")])
    before = copy.deepcopy(vars(args))
    cfg = BenchConfig.from_args(args)
    assert vars(args) == before
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.budget = 1
    assert cfg.budget == 3 << 20 and cfg.policies[0] == "ceiling"
    assert (cfg.layout.nproc, cfg.layout.pp, cfg.layout.ep) == (4, 2, 2)


def test_every_job_runs_what_train_resolved():
    """With a pipeline and no --micro-batches, train's configuration gives one micro-batch
    per stage; the jobs' arguments carry that figure and the processes pp x ep x dp."""
    cfg = BenchConfig.from_args(_args(["bench", "--preset", "tiny", "--pp", "2", "--ep", "2",
                                       "--dp", "1", "--steps", "4", "--segments", "1",
                                       "--num-layers", "4"]))
    argv = _workload(cfg)
    flags = dict(zip(argv[::2], argv[1::2]))
    assert flags["--micro-batches"] == str(cfg.run.train.micro_batches) == "2"
    assert flags["--nproc"] == "4" and flags["--pp"] == "2" and flags["--ep"] == "2"
    assert flags["--num-layers"] == "4" and flags["--preset"] == "tiny"
