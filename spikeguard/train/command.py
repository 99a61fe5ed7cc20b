"""`spikeguard train` and `spikeguard demo`: their arguments, and the RunConfig they build.

    .venv/bin/spikeguard train --preset tiny --steps 50 --log runs/tiny.jsonl
    .venv/bin/spikeguard train --config run.toml --steps 10     # flags override the file

The command line only fills a spikeguard.train.config.RunConfig (validated there, one line
and exit 2 on a mistake); spikeguard.train.run.run_training runs it, whatever the layout.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from spikeguard.errors import UsageError

DEMO_PRESET = "small"
# 30 steps of 8 x 128 tokens: a step stays well under a second on 2 CPU cores and the
# validation loss falls from ~5.6 (uniform over 256 bytes) to under 3.
DEMO_STEPS, DEMO_BATCH, DEMO_EVAL_EVERY = 30, 8, 10
# The demo's skew: a spike in every window of 10 steps (3 in 30), of 1.6x to 2x the hot
# rank's share (2x is everything on one of 2 ranks), so a newcomer sees several absorbed.
DEMO_SKEW = ("--skew", "rotating", "--spike-prob", "0.1", "--spike-max", "2.0")

# flag dest -> (section, key) of the run configuration
_MODEL = ("seq_len", "num_experts", "top_k", "d_model", "num_layers", "d_expert")
_TRAIN = ("steps", "batch_size", "micro_batches", "lr", "weight_decay", "grad_clip", "seed",
          "eval_every", "eval_batches")
_FLAGS: dict[str, tuple[str, str]] = {
    "preset": ("model", "preset"), "hf": ("model", "hf"), "titan": ("model", "titan"),
    **{k: ("model", k) for k in _MODEL}, **{k: ("train", k) for k in _TRAIN},
    "nproc": ("parallel", "nproc"), "ep": ("parallel", "ep"), "pp": ("parallel", "pp"),
    "schedule": ("parallel", "schedule"),
    "skew": ("skew", "pattern"), "skew_seed": ("skew", "seed"),
    "spike_prob": ("skew", "spike_prob"), "spike_max": ("skew", "spike_max"),
    "spike_from_layer": ("skew", "spike_from_layer"),
    "budget": ("guard", "budget"), "policy": ("guard", "policy"),
    "shared_policy": ("guard", "shared_policy"), "cost_rates": ("guard", "cost_rates"),
    "data": ("files", "data"), "log": ("files", "log"), "threads": ("files", "threads"),
    "record_trace": ("files", "record_trace"), "trace": ("files", "trace"),
    "checkpoint_dir": ("files", "checkpoint_dir"), "tensorboard": ("files", "tensorboard"),
    "wandb": ("files", "wandb"),
    "memory_snapshot": ("files", "memory_snapshot"),
    "checkpoint_every": ("files", "checkpoint_every"), "resume": ("files", "resume"),
    "skip_steps": ("files", "skip_steps"), "overwrite": ("files", "overwrite"),
}


def add_train_parser(commands) -> None:
    from spikeguard.names import PATTERNS, SCHEDULES, SHARED_POLICIES
    from spikeguard.runtime.policies import POLICIES

    train = commands.add_parser("train", help="train the built-in MoE transformer (or --hf)")
    train.add_argument("--config", default=None, metavar="FILE.toml",
                       help="a run configuration (sections model, parallel, train, guard, "
                            "skew, files); the flags given override it")
    train.add_argument("--preset", default=None, help="tiny, small or medium (default small)")
    train.add_argument("--hf", default=None, metavar="NAME_OR_JSON",
                       help="train a tiny Hugging Face transformers MoE model instead (a model "
                            "type such as mixtral, qwen3_moe, olmoe, or a config JSON; random "
                            "weights, nothing downloaded; needs spikeguard[hf]); see docs/hf.md")
    train.add_argument("--titan", default=None, metavar="NAME",
                       help="train a tiny torchtitan MoE model instead (deepseek_v3 or qwen3; random "
                            "weights; one process, or --nproc N --ep N under torchtitan's own "
                            "expert parallelism; needs spikeguard[titan]); see docs/titan.md")
    model = train.add_argument_group("model overrides")
    for flag in _MODEL:
        model.add_argument("--" + flag.replace("_", "-"), type=int, default=None)
    run = train.add_argument_group("training (defaults: spikeguard.train.TrainConfig)")
    run.add_argument("--steps", type=int, default=None)
    run.add_argument("--batch-size", type=int, default=None, help="sequences per micro-batch")
    run.add_argument("--micro-batches", type=int, default=None,
                     help="micro-batches per optimizer step (default 1; with --pp, --pp)")
    run.add_argument("--lr", type=float, default=None)
    run.add_argument("--weight-decay", type=float, default=None)
    run.add_argument("--grad-clip", type=float, default=None)
    run.add_argument("--seed", type=int, default=None)
    run.add_argument("--eval-every", type=int, default=None)
    run.add_argument("--eval-batches", type=int, default=None)
    add_io_args(train)
    par = train.add_argument_group("parallelism (torchrun, gloo on CPU)")
    par.add_argument("--nproc", type=int, default=None,
                     help="processes to start with torchrun on this machine (default 1)")
    par.add_argument("--ep", type=int, default=None,
                     help="expert-parallel size (default: --nproc; 1 with --pp); data "
                          "parallel is --nproc / (--pp x --ep)")
    par.add_argument("--pp", type=int, default=None,
                     help="pipeline stages (torch.distributed.pipelining; default 1)")
    par.add_argument("--schedule", default=None, choices=SCHEDULES,
                     help="pipeline schedule (default 1f1b; interleaved: 2 stages per rank)")
    par.add_argument("--skew", default=None,
                     choices=PATTERNS,
                     help="inject routing skew (spikeguard.routing.skew); default none")
    par.add_argument("--skew-seed", type=int, default=None)
    par.add_argument("--spike-prob", type=float, default=None,
                     help="probability of a spike step (default 0.029, the production rate)")
    par.add_argument("--spike-max", type=float, default=None,
                     help="largest spike, max/mean tokens per rank (default 2.6, at most --ep)")
    par.add_argument("--spike-from-layer", type=int, default=None, metavar="L",
                     help="spikes start at layer L: the layers before route calmly on a spike "
                          "step (default 0, every layer)")
    memory = train.add_argument_group("memory guard")
    memory.add_argument("--budget", default=None,
                        help="device memory budget: 24GiB, 500MB, a byte count, or 'auto' "
                             "(what a calm step needs with everything saved, plus 10%%)")
    memory.add_argument("--policy", default=None, choices=POLICIES,
                        help="activation policy (default adaptive when --budget is given)")
    memory.add_argument("--shared-policy", default=None, choices=SHARED_POLICIES,
                        help="shared experts and dense layers: keep (default) or recompute")
    memory.add_argument("--cost-rates", metavar="FILE", default=None,
                        help="plan with these stage and copy rates, frozen, instead of timing "
                             "this machine: the same plans on every run and rank "
                             "(spikeguard/plan/cost_rates.py documents the file)")
    runs = train.add_argument_group("traces and checkpoints (what spikeguard bench drives)")
    runs.add_argument("--record-trace", metavar="FILE", default=None,
                      help="write every step's per-layer, per-expert token counts "
                           "(spikeguard/routing/trace.py documents the format)")
    runs.add_argument("--trace", metavar="FILE", default=None,
                      help="replay a recorded trace: the routers reproduce its counts exactly")
    runs.add_argument("--checkpoint-dir", metavar="DIR", default=None,
                      help="save checkpoints here: torch.distributed.checkpoint (DCP) "
                           "folders step-N/, manifest.json written last (the commit point)")
    runs.add_argument("--tensorboard", metavar="DIR", default=None,
                      help="write each step's scalars (loss, tok/s, peak / budget / reserved "
                           "bytes, decisions, evictions, re-runs) as TensorBoard event files "
                           "here (rank 0; needs spikeguard[tensorboard])")
    runs.add_argument("--wandb", metavar="PROJECT", nargs="?", const="spikeguard", default=None,
                      help="log the same scalars to a W&B run of PROJECT (default spikeguard; "
                           "rank 0; needs spikeguard[wandb]). Offline unless W&B has a key "
                           "(WANDB_API_KEY or `wandb login`) or WANDB_MODE says otherwise: "
                           "never a login prompt; files under WANDB_DIR, else ./wandb")
    runs.add_argument("--memory-snapshot", metavar="DIR", default=None,
                      help="write a memory snapshot here at every out-of-memory, re-run or "
                           "fatal, named by step and rank (CUDA: the allocator's history, "
                           "for pytorch.org/memory_viz; CPU: the emulated device as JSON)")
    runs.add_argument("--checkpoint-every", type=int, default=None, metavar="N",
                      help="steps between checkpoints (default 50; also after the last step)")
    runs.add_argument("--resume", nargs="?", const=True, default=None, choices=(True, "auto"),
                      type=_resume_value, metavar="auto",
                      help="continue from the checkpoint in --checkpoint-dir (verified "
                           "against its manifest; into another EP / DP layout too, without "
                           "a pipeline); 'auto': start afresh when it holds none; "
                           "appends to an existing --log")
    runs.add_argument("--overwrite", action="store_true", default=None,
                      help="replace existing outputs (--log, --record-trace, a checkpoint "
                           "in --checkpoint-dir); without it they are refused")
    runs.add_argument("--skip-steps", default=None, metavar="LIST",
                      help="comma-separated steps to drop, e.g. the one a crash happened on")
    train.set_defaults(run=run_train)


def _resume_value(text: str):
    if text != "auto":
        raise argparse.ArgumentTypeError(f"takes nothing or 'auto', got {text!r}")
    return text


def add_demo_parser(commands) -> None:
    demo = commands.add_parser("demo", help=f"a short run of the {DEMO_PRESET} preset")
    demo.add_argument("--steps", type=int, default=DEMO_STEPS)
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--nproc", type=int, default=2,
                      help="expert-parallel processes (default 2, with routing spikes and the "
                           "adaptive guard); 1 trains one plain process")
    add_io_args(demo, with_data=False)
    demo.add_argument("--overwrite", action="store_true", help="replace an existing --log")
    demo.set_defaults(run=run_demo)


def add_io_args(parser: argparse.ArgumentParser, with_data: bool = True) -> None:
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads for torch (default: torch's choice); 1 is much "
                             "faster for small models on a machine shared with other jobs")
    if with_data:
        parser.add_argument("--data", default=None,
                            help="text file or folder (default: the Python standard library)")
    parser.add_argument("--log", default=None, metavar="FILE.jsonl",
                        help="write one JSON record per step")


def run_config(args: argparse.Namespace):
    """The RunConfig of `spikeguard train` arguments (a --config file under them)."""
    from spikeguard.parallel.launch import under_torchrun
    from spikeguard.train.config import RunConfig

    given: dict[str, dict[str, Any]] = {}
    for dest, (section, key) in _FLAGS.items():
        value = getattr(args, dest, None)
        if value is not None:
            given.setdefault(section, {})[key] = value
    if under_torchrun():
        # Started by torchrun (by us, or by hand on several nodes): the world is the
        # layout's process count, whatever --nproc (processes on this machine) says.
        given.setdefault("parallel", {})["nproc"] = int(os.environ["WORLD_SIZE"])
    argv = tuple(getattr(args, "argv", ()))
    if args.config is not None:
        return RunConfig.from_toml(args.config, overrides=given, argv=argv)
    return RunConfig.from_dict(given, argv=argv)


def run_train(args: argparse.Namespace) -> int:
    from spikeguard.train.run import run_training

    return run_training(run_config(args))


def run_demo(args: argparse.Namespace) -> int:
    """Two expert-parallel processes, routing spikes, an automatic budget: `train` with the
    demo's settings (its ranks are relaunched as that `train` command). --nproc 1 is the
    plain single-process run."""
    from spikeguard.train.config import RunConfig
    from spikeguard.train.run import run_training

    if args.nproc < 1:
        raise UsageError(f"--nproc must be a positive integer, got {args.nproc}")
    argv = ["train", "--preset", DEMO_PRESET, "--steps", str(args.steps), "--seed",
            str(args.seed), "--batch-size", str(DEMO_BATCH),
            "--eval-every", str(max(1, min(DEMO_EVAL_EVERY, args.steps)))]
    data: dict[str, dict[str, Any]] = {
        "model": {"preset": DEMO_PRESET},
        "train": {"steps": args.steps, "seed": args.seed, "batch_size": DEMO_BATCH,
                  "eval_every": max(1, min(DEMO_EVAL_EVERY, args.steps))},
        "files": {"log": args.log, "threads": args.threads,
                  "overwrite": bool(getattr(args, "overwrite", False))}}
    if args.nproc != 1:
        argv += ["--nproc", str(args.nproc), *DEMO_SKEW, "--budget", "auto", "--policy",
                 "adaptive"]
        flags = dict(zip(DEMO_SKEW[::2], DEMO_SKEW[1::2]))
        data["parallel"] = {"nproc": args.nproc}
        data["skew"] = {"pattern": flags["--skew"], "spike_prob": float(flags["--spike-prob"]),
                        "spike_max": float(flags["--spike-max"])}
        data["guard"] = {"budget": "auto", "policy": "adaptive"}
    for flag, value in (("--log", args.log), ("--threads", args.threads)):
        if value is not None:
            argv += [flag, str(value)]
    if getattr(args, "overwrite", False):
        argv.append("--overwrite")
    return run_training(RunConfig.from_dict(data, argv=tuple(argv)))
