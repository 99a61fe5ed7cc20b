"""Bad input, as a new user types it: one line `spikeguard: error: ...`, exit 2, no
traceback, input files untouched; under torchrun printed once. Issue 15, parts 4 and 5;
issue 22's bad inputs (wrongly typed TOML, unwritable checkpoints and outputs, a
malformed SPIKEGUARD_ARGV, simulate's sizes, non-regular --data).

    .venv/bin/python -m pytest tests/test_cli_input.py -q

Most cases run `cli.main` in this process (each would otherwise pay an interpreter and
torch start-up); a representative handful, and the torchrun cases, run the real command.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from spikeguard import cli

from one_line import check_exit_3_line, check_one_line, digests, immutable, unwritable

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]

NINES = "9" * 400
TINY = ["train", "--preset", "tiny", "--steps", "2", "--batch-size", "2"]

# (argv with "{tmp}" for the test's folder, a fragment of the one line). Each was a
# traceback, a wrong message, or silently accepted before issue 15.
CASES = {
    "budget of 400 nines": (TINY + ["--budget", NINES], "beyond any device"),
    "budget nan": (TINY + ["--budget", "nan"], "cannot read budget 'nan'"),
    "budget -1GiB as a flag": (TINY + ["--budget", "-1GiB"], "--flag=VALUE"),
    "budget=-1GiB": (TINY + ["--budget=-1GiB"], "budget must be positive"),
    "lr nan": (TINY + ["--lr", "nan"], "train.lr must be a positive number"),
    "grad-clip inf": (TINY + ["--grad-clip", "inf"], "train.grad_clip"),
    "steps of 40 digits": (TINY + ["--steps", "9" * 40], "train.steps must be at most"),
    "seed of 40 digits": (TINY + ["--seed", "9" * 40], "train.seed must be at most"),
    "threads 0": (TINY + ["--threads", "0"], "--threads must be a positive integer"),
    "cost-rates missing": (TINY + ["--budget", "1GiB", "--cost-rates", "{tmp}/absent.json"],
                           "absent.json: no such file"),
    "cost-rates a folder": (TINY + ["--policy", "full", "--cost-rates", "{tmp}"], "is a folder"),
    "cost-rates without a guard": (TINY + ["--cost-rates", "{tmp}/r.json"],
                                   "give --budget or --policy"),
    "threads 10**8 (segfaulted)": (TINY + ["--threads", "100000000"], "at most 4096"),
    "spike-prob 5": (TINY + ["--spike-prob", "5"], "--spike-prob is a probability"),
    "spike-from-layer without --skew": (TINY + ["--spike-from-layer", "1"],
                                        "--spike-from-layer 1 needs --skew"),
    "spike-from-layer -1": (TINY + ["--spike-from-layer", "-1"],
                            "--spike-from-layer must be an integer >= 0"),
    "d-model 10000000": (TINY + ["--d-model", "10000000"], "parameters: training it needs"),
    "batch of 10**8 sequences": (TINY + ["--batch-size", "100000000"],
                                 "of one micro-batch's activations"),
    "skip-steps past steps": (TINY + ["--skip-steps", "1000"], "--skip-steps 1000: the run has 2"),
    "abbreviated --step": (["train", "--preset", "tiny", "--step", "2"],
                           "unrecognized arguments: --step"),
    "abbreviated simulate --cap": (["simulate", "--cap", "80GiB"], "unrecognized arguments"),
    "binary --trace": (TINY + ["--trace", "{tmp}/binary.dat"], "is not a trace file"),
    "text --trace": (TINY + ["--trace", "{tmp}/run.toml"], "is not a trace file"),
    "folder --trace": (TINY + ["--trace", "{tmp}/folder"], "is a folder, not a trace file"),
    "binary train --config": (["train", "--config", "{tmp}/binary.dat"], "is not a config file"),
    "toml with nan budget": (["train", "--config", "{tmp}/nan.toml"], "finite"),
    "simulate capacity of 400 nines": (["simulate", "--capacity", NINES], "--capacity '999"),
    "simulate capacity nan": (["simulate", "--capacity", "nan"], "--capacity 'nan'"),
    "simulate binary --config": (["simulate", "--config", "{tmp}/binary.dat"],
                                 "is not a config file"),
    "simulate folder --config": (["simulate", "--config", "{tmp}/folder"], "is a folder"),
    "simulate binary --trace": (["simulate", "--trace", "{tmp}/binary.dat"],
                                "is not a trace file"),
    "simulate efficiency nan": (["simulate", "--efficiency", "nan"], "device.efficiency"),
    "simulate restart-s inf": (["simulate", "--restart-s", "inf"], "run.restart_s"),
    # issue 22
    "checkpoint-dir under a file": (TINY + ["--checkpoint-dir", "{tmp}/run.toml/ck"],
                                    "cannot be created: "),
    "checkpoint-dir inside --data": (TINY + ["--data", "{tmp}/corpus", "--checkpoint-dir",
                                             "{tmp}/corpus/ck"], "inside the --data folder"),
    "checkpoint-dir is --data": (TINY + ["--data", "{tmp}/corpus", "--checkpoint-dir",
                                         "{tmp}/corpus"], "inside the --data folder"),
    "memory-snapshot under a file": (TINY + ["--memory-snapshot", "{tmp}/run.toml/s"],
                                     "run.toml/s cannot be created: "),
    "memory-snapshot inside --data": (TINY + ["--data", "{tmp}/corpus", "--memory-snapshot",
                                              "{tmp}/corpus/s"], "inside the --data folder"),
    "toml: memory_snapshot a number": (["train", "--config", "{tmp}/snapshot.toml"],
                                       "files.memory_snapshot must be a path"),
    "wandb project W&B refuses": (TINY + ["--wandb", "team:run"], "Invalid project name"),
    "toml: wandb a number": (["train", "--config", "{tmp}/wandb.toml"],
                             "files.wandb must be a string"),
    "log ending in /": (TINY + ["--log", "{tmp}/newdir/"], "ends in '/'"),
    "data /dev/zero": (TINY + ["--data", "/dev/zero"], "is not a regular file"),
    "simulate 10**12 steps": (["simulate", "--steps", "1000000000000"], "steps fit"),
    "simulate policies twice": (["simulate", "--policies", "none,adaptive,none"],
                                "lists none more than once"),
    "simulate model name a number": (["simulate", "--config", "{tmp}/sim_name.toml"],
                                     "model.name must be a string"),
}

# Wrongly typed or shaped TOML (issue 22): each was a traceback or silently accepted.
TOML_SHAPES = {
    "section not a table": ("parallel = 3\n", "[parallel] must be a table"),
    "model section a string": ("model = 'tiny'\n", "[model] must be a table"),
    "pp a string": ("[parallel]\npp = '2'\n", "parallel.pp must be an integer, got str"),
    "router_bias a string": ("[model]\nrouter_bias = 'yes'\n",
                             "model.router_bias must be true or false"),
    "num_shared_experts a string": ("[model]\nnum_shared_experts = '1'\n",
                                    "model.num_shared_experts must be an integer"),
    "aux_loss_coef a string": ("[model]\naux_loss_coef = '1'\n",
                               "model.aux_loss_coef must be a number"),
    "data path a number": ("[files]\ndata = 3\n", "files.data must be a path"),
    "log path a number": ("[files]\nlog = 3\n", "files.log must be a path"),
    "checkpoint_dir a list": ("[files]\ncheckpoint_dir = [1]\n",
                              "files.checkpoint_dir must be a path"),
    "trace a number": ("[files]\ntrace = 3\n", "files.trace must be a path"),
    "checkpoint_every a bool": ("[files]\ncheckpoint_every = true\n",
                                "files.checkpoint_every must be an integer"),
    "threads a string": ("[files]\nthreads = '2'\n", "files.threads must be an integer, got str"),
    "skip_steps a number": ("[files]\nskip_steps = 5\n", "files.skip_steps must be a list"),
    "spike_prob a string": ("[skew]\nspike_prob = '0.5'\n", "skew.spike_prob must be a number"),
    "spike_from_layer a string": ("[skew]\nspike_from_layer = 'x'\n",
                                  "skew.spike_from_layer must be an integer"),
}
for _name, (_text, _says) in TOML_SHAPES.items():
    CASES[f"toml: {_name}"] = (["train", "--config", f"{{tmp}}/shapes/{len(CASES)}.toml",
                                "--preset", "tiny", "--steps", "1"], _says)
    TOML_SHAPES[_name] = (_text, _says, Path(CASES[f"toml: {_name}"][0][2]).name)

# Run through the real interpreter: the contract is about what a terminal shows.
SUBPROCESS_CASES = ("budget of 400 nines", "binary --trace", "simulate capacity of 400 nines",
                    "toml: pp a string", "checkpoint-dir under a file")


def _inputs(tmp: Path) -> list[Path]:
    (tmp / "folder").mkdir(exist_ok=True)
    (tmp / "binary.dat").write_bytes(bytes(range(256)) * 16)   # 0x80.. are not UTF-8
    (tmp / "run.toml").write_text("[train]\nsteps = 2\n")
    (tmp / "nan.toml").write_text("[model]\npreset = 'tiny'\n[guard]\nbudget = nan\n")
    (tmp / "corpus").mkdir(exist_ok=True)
    (tmp / "corpus" / "text.txt").write_text("the quick brown fox jumps. " * 40)
    (tmp / "shapes").mkdir(exist_ok=True)
    (tmp / "sim_name.toml").write_text("[model]\nname = 3\n")
    (tmp / "snapshot.toml").write_text("[model]\npreset = 'tiny'\n[files]\nmemory_snapshot = 3\n")
    (tmp / "wandb.toml").write_text("[model]\npreset = 'tiny'\n[files]\nwandb = 3\n")
    for text, _, name in TOML_SHAPES.values():
        (tmp / "shapes" / name).write_text(text)
    return [tmp / n for n in ("binary.dat", "run.toml", "nan.toml", "corpus/text.txt")]


def _argv(case: str, tmp: Path) -> list[str]:
    return [a.replace("{tmp}", str(tmp)) for a in CASES[case][0]]


@pytest.mark.parametrize("case", CASES)
def test_bad_input_is_one_line_and_exit_2(case, tmp_path, capsys):
    inputs = _inputs(tmp_path)
    before = digests(inputs)
    code = cli.main(_argv(case, tmp_path))
    check_one_line(code, capsys.readouterr().err, CASES[case][1])
    assert digests(inputs) == before


def test_bad_input_through_the_real_command(tmp_path):
    inputs = _inputs(tmp_path)
    before = digests(inputs)
    for case in SUBPROCESS_CASES:
        proc = subprocess.run([sys.executable, "-m", "spikeguard", *_argv(case, tmp_path)],
                              capture_output=True, text=True, timeout=120, cwd=tmp_path)
        check_one_line(proc.returncode, proc.stderr, CASES[case][1])
    assert digests(inputs) == before


def test_version_is_the_package_version():
    from importlib.metadata import version

    proc = subprocess.run([sys.executable, "-m", "spikeguard", "--version"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == f"spikeguard {version('spikeguard')}"


def test_every_command_refuses_abbreviations():
    parser = cli._build_parser()
    parsers = [parser] + [p for a in parser._actions if hasattr(a, "choices")
                          and isinstance(a.choices, dict) for p in a.choices.values()]
    assert len(parsers) > 5 and all(not p.allow_abbrev for p in parsers)


# ---- under torchrun: once, exit 2 ------------------------------------------------------
def test_rank_input_errors_are_found_before_torchrun(tmp_path):
    """What each rank would find (a corpus too short for --seq-len) is found by the
    launcher: one line, exit 2, and no torchrun started (fast)."""
    data = tmp_path / "short.txt"
    data.write_text("abc" * 20)
    proc = subprocess.run([sys.executable, "-m", "spikeguard", *TINY, "--nproc", "2",
                           "--data", str(data)], capture_output=True, text=True, timeout=120)
    check_one_line(proc.returncode, proc.stderr, "too little data")


@pytest.mark.timeout(300)
def test_a_usage_error_in_every_rank_is_printed_once_with_exit_2(tmp_path):
    """Past the launcher's checks (launch_job called directly), both ranks refuse their
    --data: the launcher prints the line once and exits 2 (it was once per rank, exit 3)."""
    argv = TINY + ["--nproc", "2", "--data", str(tmp_path / "missing.txt")]
    script = ("import sys; from spikeguard.parallel.launch import launch_job; "
              f"sys.exit(launch_job(2, {json.dumps(argv)}))")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=280)
    check_one_line(proc.returncode, proc.stderr, "data path does not exist")


def test_the_launcher_maps_a_rank_exit_2_to_2():
    from spikeguard.parallel.quiet_torchrun import usage_or_oom

    assert usage_or_oom({2, 1}) == 2 and usage_or_oom({2, -15}) == 2
    assert usage_or_oom({3, 1}) == 3 and usage_or_oom({1}) == 1


def test_an_error_line_is_one_write(monkeypatch):
    """Two ranks share a terminal: a line written in two parts (print's text, then its
    newline) lets another rank's line land between them."""
    writes = []

    class Stream:
        def write(self, text):
            writes.append(text)

        def flush(self):
            pass

    monkeypatch.setattr(sys, "stderr", Stream())
    cli._stderr_line("spikeguard: out of memory on rank 1: ...")
    assert writes == ["spikeguard: out of memory on rank 1: ...\n"]


# ---- issue 22: bad input that once got past the checks ----------------------------------
SAVE_FAILS = "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"


def test_a_checkpoint_save_that_fails_mid_file_is_one_line_exit_3(tmp_path, capsys,
                                                                  monkeypatch):
    """A full disk in the middle of torch.save (which DCP's writer calls per tensor) is
    torch's RuntimeError (torch 2.13, seen with /dev/full), not an OSError: it was a
    traceback, exit 1. The checkpoint of the step before stays whole and resumable, and
    nothing of the failed save is left."""
    import torch

    real, calls, fail_at = torch.save, [0], [None]

    def save(obj, f, *args, **kwargs):
        calls[0] += 1
        if calls[0] == fail_at[0]:
            f.write(b"half a checkpoint")
            raise RuntimeError(SAVE_FAILS)
        return real(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    assert cli.main(TINY + ["--steps", "1", "--checkpoint-dir", str(tmp_path / "one")]) == 0
    fail_at[0], calls[0] = calls[0] + 2, 0   # two calls into the second save below
    ck = tmp_path / "ck"
    capsys.readouterr()
    code = cli.main(TINY + ["--checkpoint-dir", str(ck), "--checkpoint-every", "1"])
    check_exit_3_line(code, capsys.readouterr().err, "cannot write checkpoint")
    assert json.loads((ck / "manifest.json").read_text())["step"] == 1
    assert sorted(p.name for p in ck.iterdir()) == ["manifest.json", "step-1"]
    monkeypatch.undo()
    assert cli.main(TINY + ["--checkpoint-dir", str(ck), "--resume"]) == 0


def test_a_checkpoint_dir_that_cannot_be_written_is_refused_before_the_run(tmp_path, capsys):
    (tmp_path / "ro").mkdir()
    with unwritable(tmp_path / "ro"):
        for folder, says in ((tmp_path / "ro", "is not writable"),
                             (tmp_path / "ro" / "ck", "cannot be created")):
            code = cli.main(TINY + ["--checkpoint-dir", str(folder)])
            err = capsys.readouterr()
            check_one_line(code, err.err, says)
            assert "step" not in err.out   # refused before the run


@pytest.mark.parametrize("entry", ["a string", 3, None, [1], {"bytes": "12", "sha256": "x"},
                                   {"bytes": 12}])
def test_a_manifest_file_entry_that_is_not_an_object_is_one_line(tmp_path, capsys, entry):
    ck = tmp_path / "ck"
    assert cli.main(TINY + ["--checkpoint-dir", str(ck)]) == 0
    manifest = json.loads((ck / "manifest.json").read_text())
    manifest["files"]["step-2/__0_0.distcp"] = entry
    (ck / "manifest.json").write_text(json.dumps(manifest))
    capsys.readouterr()
    code = cli.main(TINY + ["--steps", "3", "--checkpoint-dir", str(ck), "--resume"])
    check_one_line(code, capsys.readouterr().err, "no valid entry for 'step-2/__0_0.distcp'")


def test_overwrite_of_a_log_that_cannot_be_replaced_is_refused_before_the_run(tmp_path,
                                                                              capsys):
    """It trained the whole run, then died on the rename, leaving a temporary file."""
    log = tmp_path / "old.jsonl"
    log.write_text('{"step": 1}\n')
    with immutable(log):
        code = cli.main(TINY + ["--log", str(log), "--overwrite"])
        err = capsys.readouterr()
        check_one_line(code, err.err, "the file is immutable")
        assert "step" not in err.out
    assert log.read_text() == '{"step": 1}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.jsonl"]
    with unwritable(tmp_path):
        code = cli.main(TINY + ["--log", str(log), "--overwrite"])
        check_one_line(code, capsys.readouterr().err, "is not writable")


@pytest.mark.parametrize("value", ['["train", "--preset"', '{"train": 1}', '"train"',
                                   '["train", 3]', ""])
def test_a_malformed_spikeguard_argv_under_torchrun_is_one_line(value):
    """torchrun by hand on several machines: SPIKEGUARD_ARGV is typed by the user."""
    import os

    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", SPIKEGUARD_ARGV=value)
    proc = subprocess.run([sys.executable, "-m", "spikeguard"], capture_output=True,
                          text=True, timeout=120, env=env)
    check_one_line(proc.returncode, proc.stderr, "SPIKEGUARD_ARGV")


def test_report_plots_into_an_unwritable_folder_is_exit_2(tmp_path, capsys):
    log = tmp_path / "a.jsonl"
    assert cli.main(TINY + ["--log", str(log)]) == 0
    (tmp_path / "plots").mkdir()
    capsys.readouterr()
    with unwritable(tmp_path / "plots"):
        for folder in ("plots", "plots/sub"):
            code = cli.main(["report", str(log), "--plots", str(tmp_path / folder)])
            check_one_line(code, capsys.readouterr().err, "cannot write plots to")
    assert list((tmp_path / "plots").iterdir()) == []


def test_data_that_is_not_a_regular_file_is_refused(tmp_path, capsys):
    import os

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)   # reading it would block for ever
    code = cli.main(TINY + ["--data", str(fifo)])
    check_one_line(code, capsys.readouterr().err, "is not a regular file")
