"""What tests/test_readme_examples.py does with each command line the pages show.

The key is the command as the page prints it, whitespace collapsed and `.venv/bin/`
dropped. A command the pages show that is not here fails the examples test, so adding an
example means adding its line here: a `Run` (with its cap, if it takes minutes), or a
`Listed` reason why it cannot run on this machine. Times are of this machine (2 cores
shared with other jobs, load 4-5), cap applied.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass(frozen=True)
class Run:
    """Run the command; `cap` overrides or adds flags (minutes -> seconds), `files`
    writes inputs first ({path: text, or (page, text its block contains)}), `before`
    commands run first, `expect` are substrings of its output, `exits` its exit code (a
    page's `<!-- example: exits N -->` marker wins), `xfail` why it fails today, `made`
    the files it must leave."""
    cap: dict = field(default_factory=dict)
    files: dict = field(default_factory=dict)
    before: tuple = ()
    expect: tuple = ()
    exits: int = 0
    stderr_lines: Optional[int] = None
    runs: tuple = ()     # for a synopsis ("[--nproc 2]"): the command lines it stands for
    timeout_s: int = 120
    long: bool = False
    xfail: str = ""
    made: tuple = ()     # files the command must have written (relative to its folder)


@dataclass(frozen=True)
class Listed:
    """Not run here, and why."""
    reason: str


DONE = ("done: ",)
EP = ("spikeguard train --preset tiny --num-experts 8 --nproc 2 --steps 6 --batch-size 8 "
      "--skew one-hot-rank --spike-prob 0.5 --spike-max 2 --budget auto --policy adaptive")
PP = ("spikeguard train --preset tiny --num-layers 4 --num-experts 8 --nproc 4 --pp 2 --ep 2 "
      "--micro-batches 4 --batch-size 2 --steps 3 --threads 1 --skew one-hot-rank "
      "--spike-prob 1 --spike-max 2 --budget 1.5MiB --policy adaptive")
HF = "spikeguard train --hf qwen3_moe --steps 10 --eval-every 5 --threads 1"
CK_SAVE = ("spikeguard train --preset tiny --num-experts 8 --nproc 2 --steps 4 "
           "--checkpoint-dir ck --checkpoint-every 2")
HF_EP = "spikeguard train --hf qwen3_moe --nproc 2 --ep 2 --steps 10 --threads 1"
BENCH = ("spikeguard bench --json docs/bench.json --plots docs/img/bench --docs docs/bench.md "
         "--overwrite")
BENCH_PP = ("spikeguard bench --pp 2 --ep 2 --steps 48 --batch-size 4 --segments 3 "
            "--checkpoint-every 8 --spike-prob 0.08 --json docs/bench_pp.json "
            "--plots docs/img/bench_pp --docs docs/bench_pp.md --overwrite")
SIM_1T = ("spikeguard simulate --preset 1t --calibrate-mfu 0.246 --scaling --json sim.json "
          "--plots docs/img --overwrite")
NAME = "the command's name in a sentence, not a command line"

EXAMPLES: dict = {
    # ---- README.md ----------------------------------------------------------------------
    "make demo": Run(expect=DONE, timeout_s=180),   # ~25 s: 2 ranks, 30 steps
    "spikeguard demo": Listed("`make demo`'s recipe (test_make_targets_run_what_the_pages_say), "
                              "which runs"),
    "spikeguard demo --nproc 1": Run(cap={"--steps": 10}, expect=DONE),   # 30 steps: 23 s
    "make test": Listed("the whole suite, this test among it"),
    "make test-fast": Listed("a subset of the suite, this test not among it (multiprocess)"),
    "spikeguard train --preset tiny --steps 50 --budget 4MiB --policy adaptive --log run.jsonl":
        Run(cap={"--steps": 20}, expect=("memory: peak ",) + DONE),   # 50 steps: 23 s loaded
    "pip install 'spikeguard[tensorboard]'": Listed("installs into an environment: the venv "
                                                    "has tensorboard's pin already (Makefile)"),
    "spikeguard train --preset tiny --steps 3 --budget 4MiB --tensorboard runs/tb":
        Run(expect=("memory: peak ",) + DONE),   # ~5 s; its scalars: tests/train/test_train_metrics.py
    "pip install 'spikeguard[wandb]'": Listed("installs into an environment: the venv has "
                                              "wandb's pin already (Makefile, the dev extra)"),
    "WANDB_MODE='offline' .venv/bin/spikeguard train --preset tiny --steps 3 --budget 4MiB "
    "--wandb my-project": Run(expect=("wandb: Run data is saved locally in ",) + DONE),
    # ~8 s; its scalars read back: tests/train/test_train_wandb.py
    "spikeguard train --preset tiny --steps 2 --budget 1MiB --policy none --memory-snapshot "
    "runs/snapshots": Run(exits=3, expect=("spikeguard: out of memory: forward of micro-batch 0",),
                          made=("runs/snapshots/step000000-rank0-oom.json",)),
    EP: Run(expect=("memory: budget auto = ",) + DONE, timeout_s=180),
    "SPIKEGUARD_ARGV='[\"train\", \"--ep\", \"8\", \"--budget\", \"60GiB\"]' torchrun --nnodes 2 "
    "--node-rank K --rdzv-backend c10d --rdzv-endpoint HOST:29500 --nproc-per-node 4 -m spikeguard":
        Listed("two machines and a rendezvous host; SPIKEGUARD_ARGV under torchrun by hand is "
               "tests/test_cli_input.py's"),
    "python -m spikeguard.parallel.quiet_torchrun": Listed(
        "a launcher named in a sentence, used with the several-machines form above; "
        "tests/parallel/test_parallel_by_hand.py runs it by hand, failing on purpose"),
    # The plan follows the cost model's timings: on a loaded machine about 1 run in 8 takes
    # one safety-net re-run (4 of 32 here, beside one busy core; the README says why), and
    # never a step over its budget.
    PP: Run(expect=("0 steps over",) + DONE, timeout_s=180),
    "spikeguard train --titan deepseek_v3 [--nproc 2 --ep 2]":
        Run(runs=("spikeguard train --titan deepseek_v3",
                  "spikeguard train --titan deepseek_v3 --nproc 2 --ep 2"),
            cap={"--steps": 3}, expect=DONE, timeout_s=180),
    "spikeguard train --hf mixtral": Run(cap={"--steps": 3}, expect=DONE),
    "spikeguard train --hf qwen3_moe --nproc 2 --ep 2":
        Listed(f"docs/hf.md's '{HF_EP}' is this command with a step count, and runs"),
    "spikeguard train --config run.toml --steps 10":
        Run(cap={"--steps": 2}, files={"run.toml": ("README.md", 'preset = "tiny"')},
            expect=DONE, timeout_s=180, long=True),
    "spikeguard train": Listed(NAME),
    # "Installing into your own environment": pip into the user's environment; what they
    # do is tested by tests/test_packaging.py (wheel into a fresh venv beside torch) and
    # tests/test_extras.py (the extras' one-line messages)
    "pip install .": Listed("installs into an environment: tests/test_packaging.py installs "
                            "the wheel it builds into a fresh venv"),
    "pip install '.[plots,sim,hf]'": Listed("installs into an environment: the venv has these "
                                            "extras' pins already (`.[dev]`)"),
    "pip install -c constraints.txt '.[dev]'": Listed("what `make` runs to build .venv"),
    "spikeguard report": Listed(NAME),
    "spikeguard bench": Listed(NAME),
    "make bench": Run(cap={"--steps": 4, "--segments": 1, "--checkpoint-every": 2},
                      expect=("adaptive", "evicted"), timeout_s=300, long=True),   # 200: 5.9 min
    BENCH: Listed("`make bench`'s recipe (test_make_targets_run_what_the_pages_say), run capped"),
    # the README's short run; uncapped 2.4 min at load 8-9
    "spikeguard bench --steps 24 --segments 4 --batch-size 2 --pattern one-hot-rank "
    "--spike-prob 0.1 --checkpoint-every 6":
        Run(cap={"--steps": 4, "--segments": 1, "--checkpoint-every": 2},
            expect=("segments for +-0.01", "adaptive"), timeout_s=300, long=True),
    # README "Spikes that start mid-depth" (pages bench-late, bench-late-every: ~5 min each)
    "spikeguard bench --steps 80 --segments 4 --spike-prob 0.1 --budget 114MiB "
    "--spike-from-layer 2 --json bench.json":
        Run(cap={"--steps": 4, "--segments": 1}, expect=("segments for +-0.01", "adaptive"),
            made=("bench.json",), timeout_s=300, long=True),
    "spikeguard bench --steps 80 --segments 4 --spike-prob 0.1 --budget 114MiB --json bench.json":
        Run(cap={"--steps": 4, "--segments": 1}, expect=("segments for +-0.01", "adaptive"),
            made=("bench.json",), timeout_s=300, long=True),
    "spikeguard bench --help": Run(expect=("--restart-cost",)),
    "spikeguard report RUN.jsonl --plots DIR":
        Run(before=(".venv/bin/spikeguard train --preset tiny --steps 3 "
                    "--budget 4MiB --log RUN.jsonl",)),
    "spikeguard simulate --preset 1t --calibrate-mfu 0.246 --json sim.json --plots docs/img "
    "--overwrite": Run(cap={"--steps": 10}, expect=("adaptive",), long=True),   # 100 steps: 42 s
    "python -m spikeguard.bench.runtime_ratios --preset small --reps 15":
        Run(cap={"--reps": 1}, expect=("evicted", "adaptive"), long=True),
    "python -m spikeguard.bench.oracle_bench --preset small --reps 11":
        Run(cap={"--reps": 1, "--fractions": "0.7"}, expect=("adaptive/oracle", "evicted"),
            long=True),
    "python -m spikeguard.bench.oracle_bench --preset medium --batch-size 4 --reps 3":
        Listed("`medium` steps take seconds each here (one round about 2 min at load 4): "
               "the same code as the `small` line above, which is run capped"),
    "python -m torch.distributed.run --standalone --nproc-per-node 2 -m "
    "spikeguard.bench.oracle_ep --preset small --reps 11":
        Run(cap={"--reps": 1, "--fractions": "0.7"}, expect=("adaptive/oracle", "evicted"),
            timeout_s=300, long=True),
    "python -m torch.distributed.run --standalone --nproc-per-node 2 -m "
    "spikeguard.bench.oracle_ep --preset medium --batch-size 4 --reps 2":
        Listed("two `medium` ranks for 15 min here (about 9 GB each): the same module as the "
               "`small` line above it, which tests/bench/test_bench_oracle.py runs under "
               "torchrun on `tiny`"),
    "python -m torch.distributed.run --standalone --nproc-per-node 2 "
    "scripts/adaptive_ep_row.py --preset medium --batch-size 4 --reps 8 --fraction 0.7":
        Listed("two `medium` ranks for minutes here (about 9 GB each); the entry term it "
               "shows is held on `small` by tests/runtime/test_runtime_entry_exchange.py"),
    "torchrun --nproc-per-node 4 scripts/flag_point_cost.py --reps 40":   # 40 rounds: ~1 min
        Run(cap={"--reps": 1, "--iters": 2}, expect=("| flag point |", "| job notes |"),
            timeout_s=180, long=True),
    "torchrun --nproc-per-node 2 scripts/hf_ep_span_cost.py --reps 7":
        Run(cap={"--reps": 1}, expect=("recording on", "recording every"), timeout_s=300,
            long=True),
    "make bench-pp": Run(cap={"--steps": 2, "--segments": 1, "--checkpoint-every": 1},
                         expect=("adaptive",), timeout_s=300, long=True),   # 48 steps: 2.2 min
    "python -m spikeguard.plan.room": Run(expect=("per decision",)),
    CK_SAVE: Run(expect=DONE, made=("ck/manifest.json",), timeout_s=240, long=True),
    "spikeguard train --preset tiny --num-experts 8 --nproc 4 --steps 8 --checkpoint-dir ck "
    "--resume": Run(before=(".venv/bin/" + CK_SAVE,), timeout_s=300, long=True,
                    expect=DONE + ("resharded into pp 1 x dp 1 x ep 4",)),
    # ---- docs/bench.md, docs/bench_pp.md ------------------------------------------------
    BENCH_PP: Listed("`make bench-pp`'s recipe (test_make_targets_run_what_the_pages_say), "
                     "run capped"),
    # ---- docs/hf.md ---------------------------------------------------------------------
    "pip install 'spikeguard[hf]'": Listed("installs into an environment: the venv has the "
                                           "extra's pins already"),
    HF: Run(expect=("memory: budget",) + DONE),
    "spikeguard train --hf path/to/config.json --budget 16MiB --policy experts":
        Run(cap={"--steps": 3}, files={"path/to/config.json": '{"model_type": "mixtral"}'},
            expect=DONE),
    HF_EP: Run(expect=("expert parallel: transformers' own",) + DONE, timeout_s=180),
    "python -m spikeguard.bench.hf_bench --hf mixtral --reps 11":
        Run(cap={"--reps": 1}, long=True),
    "python -m torch.distributed.run --standalone --nproc-per-node 2 -m spikeguard.bench.hf_bench "
    "--hf qwen3_moe --ep 2 --reps 15": Run(
        cap={"--reps": 1}, timeout_s=180, long=True),
    "python -m spikeguard.bench.trainer_bench --reps 5":   # 5 rounds: ~3 min here
        Run(cap={"--reps": 1, "--steps": 2}, expect=("adaptive  / ceiling",), timeout_s=180,
            long=True),
    "python -m torch.distributed.run --standalone --nproc-per-node 2 -m "
    "spikeguard.bench.trainer_bench --reps 3 --ep 2": Run(
        cap={"--reps": 1, "--steps": 2}, expect=("adaptive  / ceiling",), timeout_s=240,
        long=True),
    "torchrun --nproc-per-node 2": Listed("the launcher the Python lines above it run under "
                                          "(needs a saved model): a fragment"),
    # ---- docs/pipeline.md ---------------------------------------------------------------
    "spikeguard train --pp": Listed(NAME),
    "spikeguard bench --pp 2 --ep 2": Listed("names the layout of `make bench-pp`, which runs "
                                             "capped"),
    # ---- docs/simulator.md --------------------------------------------------------------
    SIM_1T: Run(cap={"--steps": 10, "--scaling": "128,12288", "--scaling-steps": 5},
                expect=("adaptive",), long=True),   # --scaling-steps 20, 100 steps: 104 s
    "spikeguard simulate --preset 188b --devices 2048 --pp 4 --steps 500":
        Run(cap={"--steps": 100}, expect=("adaptive",)),
    "spikeguard simulate --config my_cluster.toml --set device.host_bytes_per_s=5e10":
        Run(cap={"--steps": 10},
            files={"my_cluster.toml": ("docs/simulator.md", 'name = "my-moe"')},
            expect=("adaptive",)),
    SIM_1T.replace("--scaling", "--scaling --scaling-steps 300"): Listed("the command above with the scaling's own step "
                                            "count, run capped above"),
    "python -m spikeguard.sim.validate --steps 3 --reps 15 --pp-ep":
        Listed("minutes even at --reps 1 (its --help: 'a few minutes' for --pp-ep alone); the "
               "same comparison, every policy, is tests/sim/test_sim_validation.py's"),
    "python -m spikeguard.sim.bench --reps 3":   # 188b alone at 100 steps: a few s
        Run(cap={"--reps": 1, "--steps": 100, "--presets": "188b"}, expect=("188b",)),
    "python -m spikeguard.sim.bench --reps 3 --before /tmp/sim-before":
        Listed("needs the checkout `git worktree add` makes (the line above it); the same "
               "bench without --before is "
               "run capped above (its --before path: tests/sim/test_sim_speed.py's reference "
               "figures are that commit's)"),
    "spikeguard simulate": Listed(NAME),
    "spikeguard train --preset small --nproc 4 --pp 2 --ep 2 --skew production --spike-prob 0.5 "
    "--spike-max 2 --batch-size 4": Run(cap={"--steps": 2}, expect=DONE, timeout_s=240, long=True),
    # ---- docs/titan.md ------------------------------------------------------------------
    "pip install 'spikeguard[titan]'": Listed("installs into an environment: `make test` "
                                              "installs torchtitan's pins --no-deps"),
    "spikeguard train --titan deepseek_v3 --steps 20 --budget auto":
        Run(cap={"--steps": 3}, expect=DONE),   # 20 steps: 35 s loaded
    "spikeguard train --titan deepseek_v3 --nproc 2 --ep 2 --steps 20 --budget auto":
        Run(cap={"--steps": 5}, expect=DONE, timeout_s=180),
    # 0.85x of `none`'s peak: the loss outside the model, calm steps with no re-run
    "spikeguard train --titan deepseek_v3 --steps 6 --policy adaptive --budget 15666016":
        Run(expect=DONE + ("0 safety-net re-runs",), timeout_s=180),
    "torchrun -m torchtitan.train": Listed("torchtitan's entry point named in a sentence, "
                                           "not a command line"),
    "torchrun --nproc-per-node 8 -m torchtitan.train --module my_pkg --config my_run "
    "--spikeguard.budget 60GiB": Listed("a user's config module and 8 GPUs; the same entry "
                                        "point on CPU is test_integrations_titan_train.py's"),
    "python -m spikeguard.bench.titan_ratios --reps 21 --steps 8":
        Run(cap={"--reps": 2, "--steps": 2}, timeout_s=240, long=True),   # --reps >= 2
}

# Variants the pages describe in prose ("with `--policy none` the same command dies ..."):
# (the page's command, flags changed, what the page says follows).
VARIANTS = [
    (EP, {"--policy": "none"}, Run(
        exits=3, stderr_lines=2, timeout_s=180,
        # forward or backward of the head, run to run (gloo's rows held at the peak)
        expect=("spikeguard: out of memory on rank 0: rank 0 ran out of memory in ",
                "of micro-batch 0, the output head (an allocation would have put ",
                "spikeguard: rank 0 ran out of memory (exit 3, its message is above)"))),
    (HF, {"--policy": "none"}, Run(
        exits=3, stderr_lines=1,
        expect=("spikeguard: out of memory: forward of micro-batch 0, the output head",))),
]
