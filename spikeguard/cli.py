"""The `spikeguard` command: `train` and `demo`.

    .venv/bin/spikeguard demo
    .venv/bin/spikeguard train --preset tiny --steps 50 --log runs/tiny.jsonl

Exit codes: 0 done, 2 usage error (bad argument, file, or setting; one line on stderr),
3 out of memory (one line on stderr), 130 interrupted. User mistakes never print a
traceback: every argparse error goes through the same one-line path as a UsageError.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Optional, Sequence

from spikeguard.errors import DeviceOutOfMemory, UsageError
from spikeguard.runtime.policies import POLICIES
DEMO_PRESET = "small"
# 30 steps of 8 x 128 tokens: a step stays well under a second on 2 CPU cores and the
# validation loss falls from ~5.6 (uniform over 256 bytes) to under 3.
DEMO_STEPS, DEMO_BATCH, DEMO_EVAL_EVERY = 30, 8, 10
# The demo's skew: a spike in every window of 10 steps (3 in 30), of 1.6x to 2x the hot
# rank's share (2x is everything on one of 2 ranks), so a newcomer sees several absorbed.
DEMO_SKEW = ("--skew", "rotating", "--spike-prob", "0.1", "--spike-max", "2.0")


class _ArgumentParser(argparse.ArgumentParser):
    """argparse prints usage plus a message; we want the one-line contract of UsageError."""

    def error(self, message: str):  # type: ignore[override]
        raise UsageError(f"{message} (see '{self.prog} --help')")


def _build_parser() -> argparse.ArgumentParser:
    parser = _ArgumentParser(
        prog="spikeguard",
        description="Keep MoE training under the device memory limit through routing spikes.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    train = commands.add_parser("train", help="train the built-in MoE transformer")
    train.add_argument("--preset", default="small", help="tiny, small or medium (default small)")
    train.add_argument("--hf", default=None, metavar="NAME_OR_JSON",
                       help="train a tiny Hugging Face transformers MoE model instead (a model "
                            "type such as mixtral, qwen3_moe, olmoe, or a config JSON; random "
                            "weights, nothing downloaded; needs spikeguard[hf]); see docs/hf.md")
    model = train.add_argument_group("model overrides")
    for flag in ("--seq-len", "--num-experts", "--top-k", "--d-model", "--num-layers",
                 "--d-expert"):
        model.add_argument(flag, type=int, default=None)
    run = train.add_argument_group("training (defaults: spikeguard.train.TrainConfig)")
    run.add_argument("--steps", type=int, default=None)
    run.add_argument("--batch-size", type=int, default=None, help="sequences per micro-batch")
    run.add_argument("--micro-batches", type=int, default=None,
                     help="micro-batches accumulated per optimizer step")
    run.add_argument("--lr", type=float, default=None)
    run.add_argument("--weight-decay", type=float, default=None)
    run.add_argument("--grad-clip", type=float, default=None)
    run.add_argument("--seed", type=int, default=None)
    run.add_argument("--eval-every", type=int, default=None)
    run.add_argument("--eval-batches", type=int, default=None)
    _add_io_args(train)
    par = train.add_argument_group("expert parallelism (torchrun, gloo on CPU)")
    par.add_argument("--nproc", type=int, default=1,
                     help="processes to start with torchrun on this machine (default 1)")
    par.add_argument("--ep", type=int, default=None,
                     help="expert-parallel size (default: --nproc; 1 with --pp)")
    par.add_argument("--pp", type=int, default=1,
                     help="pipeline stages (torch.distributed.pipelining); data parallel is "
                          "--nproc / (--pp x --ep)")
    par.add_argument("--schedule", default="1f1b", choices=("1f1b", "interleaved"),
                     help="pipeline schedule (default 1f1b; interleaved: 2 stages per rank)")
    par.add_argument("--skew", default=None,
                     choices=("production", "one-hot-rank", "rotating", "burst"),
                     help="inject routing skew (spikeguard.routing.skew); default none")
    par.add_argument("--skew-seed", type=int, default=0)
    par.add_argument("--spike-prob", type=float, default=None,
                     help="probability of a spike step (default 0.029, the production rate)")
    par.add_argument("--spike-max", type=float, default=None,
                     help="largest spike, max/mean tokens per rank (default 2.6, at most --ep)")
    memory = train.add_argument_group("memory guard")
    memory.add_argument("--budget", default=None,
                        help="device memory budget: 24GiB, 500MB, a byte count, or 'auto' "
                             "(what a calm step needs with everything saved, plus 10%%)")
    memory.add_argument("--policy", default=None, choices=POLICIES,
                        help="activation policy (default adaptive when --budget is given)")
    runs = train.add_argument_group("traces and checkpoints (what spikeguard bench drives)")
    runs.add_argument("--record-trace", metavar="FILE", default=None,
                      help="write every step's per-layer, per-expert token counts "
                           "(spikeguard/routing/trace.py documents the format)")
    runs.add_argument("--trace", metavar="FILE", default=None,
                      help="replay a recorded trace: the routers reproduce its counts exactly")
    runs.add_argument("--checkpoint-dir", metavar="DIR", default=None,
                      help="save a checkpoint per rank here (atomically: write, then rename)")
    runs.add_argument("--checkpoint-every", type=int, default=50, metavar="N",
                      help="steps between checkpoints (default 50; also after the last step)")
    runs.add_argument("--resume", action="store_true",
                      help="continue from the checkpoint in --checkpoint-dir")
    runs.add_argument("--skip-steps", default=None, metavar="LIST",
                      help="comma-separated steps to drop, e.g. the one a crash happened on")
    train.set_defaults(run=_run_train)

    demo = commands.add_parser("demo", help=f"a short run of the {DEMO_PRESET} preset")
    demo.add_argument("--steps", type=int, default=DEMO_STEPS)
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--nproc", type=int, default=2,
                      help="expert-parallel processes (default 2, with routing spikes and the "
                           "adaptive guard); 1 trains one plain process")
    _add_io_args(demo, with_data=False)
    demo.set_defaults(run=_run_demo)
    from spikeguard.bench.bench_cli import add_parser as add_bench_parser
    add_bench_parser(commands)
    from spikeguard.bench.report_cli import add_parser as add_report_parser
    add_report_parser(commands)
    from spikeguard.sim.cli import add_parser as add_simulate_parser
    add_simulate_parser(commands)
    return parser


def _add_io_args(parser: argparse.ArgumentParser, with_data: bool = True) -> None:
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads for torch (default: torch's choice); 1 is much "
                             "faster for small models on a machine shared with other jobs")
    if with_data:
        parser.add_argument("--data", default=None,
                            help="text file or folder (default: the Python standard library)")
    parser.add_argument("--log", default=None, metavar="FILE.jsonl",
                        help="write one JSON record per step")


def _given(**values: Any) -> dict[str, Any]:
    return {k: v for k, v in values.items() if v is not None}


def _run_train(args: argparse.Namespace) -> int:
    if args.hf is not None:
        from spikeguard.train.hf_train import run_from_cli
        return run_from_cli(args)
    from spikeguard.memory.budget import parse_bytes
    from spikeguard.model.config import model_config
    from spikeguard.parallel.launch import under_torchrun
    from spikeguard.train.loop import TrainConfig

    if under_torchrun():
        # Started by torchrun (by us, or by hand on several nodes): the world is the
        # layout's process count, whatever --nproc (processes on this machine) says.
        args.nproc = int(os.environ["WORLD_SIZE"])
    model_cfg = model_config(
        args.preset, seq_len=args.seq_len, num_experts=args.num_experts, top_k=args.top_k,
        d_model=args.d_model, num_layers=args.num_layers, d_expert=args.d_expert)
    train_cfg = TrainConfig(**_given(
        steps=args.steps, batch_size=args.batch_size, micro_batches=args.micro_batches,
        lr=args.lr, weight_decay=args.weight_decay, grad_clip=args.grad_clip, seed=args.seed,
        eval_every=args.eval_every, eval_batches=args.eval_batches))
    # Read here, not in the guard factory, so a bad --budget fails before any work.
    args.budget_bytes = parse_bytes(args.budget) if args.budget not in (None, "auto") else None
    use_guard = args.budget is not None or args.policy is not None
    _check_run_files(args, model_cfg, train_cfg)
    if args.pp != 1:
        from spikeguard.train.pipeline_train import run_pipeline_train
        return run_pipeline_train(args, model_cfg, train_cfg)
    if args.nproc != 1 or args.ep not in (None, 1) or args.skew is not None:
        from spikeguard.parallel.launch import check_layout, launch_job

        ep = args.ep if args.ep is not None else args.nproc
        check_layout(args.nproc, ep, model_cfg.num_experts)
        if ep < 2 and args.skew is not None:
            raise UsageError("--skew needs expert parallelism: use --nproc 2 or more")
        args.skew_config = _skew_config(args, ep)
        if args.skew_config is not None:
            from spikeguard.routing.skew import SkewSchedule
            SkewSchedule(args.skew_config, ep)  # its checks (e.g. a spike above ep) fail here
        if not under_torchrun():
            return launch_job(args.nproc, args.argv)
    return _run(args.preset, model_cfg, train_cfg, data=args.data, log=args.log,
                threads=args.threads, guard_args=args if use_guard else None,
                parallel_args=args if hasattr(args, "skew_config") else None, run_args=args)


def _check_run_files(args: argparse.Namespace, model_cfg, train_cfg) -> None:
    """Traces, checkpoints and skipped steps: every mistake before any process starts."""
    from pathlib import Path

    args.skip_step_set = frozenset()
    if args.skip_steps is not None:
        try:
            args.skip_step_set = frozenset(int(v) for v in args.skip_steps.split(",") if v.strip())
        except ValueError:
            raise UsageError(f"--skip-steps must be comma-separated step numbers, "
                             f"got {args.skip_steps!r}") from None
        if any(v < 1 for v in args.skip_step_set):
            raise UsageError("--skip-steps are step numbers, from 1")
    if args.checkpoint_every <= 0:
        raise UsageError(f"--checkpoint-every must be a positive integer, got {args.checkpoint_every}")
    if args.resume and args.checkpoint_dir is None:
        raise UsageError("--resume needs --checkpoint-dir")
    if args.checkpoint_dir is not None and Path(args.checkpoint_dir).is_file():
        raise UsageError(f"--checkpoint-dir {args.checkpoint_dir} is a file")
    if args.resume and not Path(args.checkpoint_dir).is_dir():
        raise UsageError(f"cannot resume: --checkpoint-dir {args.checkpoint_dir} does not exist")
    if args.record_trace is not None:
        folder = Path(args.record_trace).parent
        if Path(args.record_trace).is_dir() or not folder.is_dir():
            raise UsageError(f"--record-trace needs a file in an existing folder, "
                             f"got {args.record_trace}")
        if args.trace is not None and Path(args.trace).resolve() == Path(args.record_trace).resolve():
            raise UsageError("--record-trace would overwrite the --trace being replayed")
    args.trace_data = None
    if args.trace is not None:
        from spikeguard.routing.trace import load_trace

        if args.skew is not None:
            raise UsageError("--trace replays recorded routing; it cannot be combined with --skew")
        trace = load_trace(args.trace)
        trace.check_matches(
            steps=train_cfg.steps, num_layers=model_cfg.num_layers,
            num_experts=model_cfg.num_experts, top_k=model_cfg.top_k,
            ep=args.ep if args.ep is not None else args.nproc,
            micro_batches=train_cfg.micro_batches,
            tokens_per_micro_batch=train_cfg.batch_size * model_cfg.seq_len)
        args.trace_data = trace


def _run_files(args: argparse.Namespace, model, model_cfg, train_cfg, parallel):
    """The loop's observers (trace recorder / replayer) and checkpointer for this rank."""
    if args is None:
        return [], None
    from spikeguard.routing.trace import TraceRecorder, TraceReplayer, TraceWriter, make_header
    from spikeguard.train.checkpoint import Checkpointer

    rank = parallel.worker.rank if parallel is not None else 0
    group = parallel.worker.group if parallel is not None else None
    observers = []
    if args.trace_data is not None:
        observers.append(TraceReplayer(model, args.trace_data, rank=rank))
    if args.record_trace is not None:
        writer = None
        if rank == 0:
            skew = args.skew_config.to_dict() if getattr(args, "skew_config", None) else None
            writer = TraceWriter(args.record_trace, make_header(
                num_layers=model_cfg.num_layers, num_experts=model_cfg.num_experts,
                top_k=model_cfg.top_k, ep=parallel.worker.world_size if parallel else 1,
                micro_batches=train_cfg.micro_batches,
                tokens_per_micro_batch=train_cfg.batch_size * model_cfg.seq_len,
                preset=args.preset, seed=train_cfg.seed, skew=skew))
        observers.append(TraceRecorder(model, train_cfg.micro_batches, writer, group))
    checkpoint = None
    if args.checkpoint_dir is not None:
        checkpoint = Checkpointer(args.checkpoint_dir, args.checkpoint_every, rank=rank,
                                  resume=args.resume)
    return observers, checkpoint


def _skew_config(args: argparse.Namespace, ep: int):
    if args.skew is None:
        return None
    from spikeguard.routing.skew import SkewConfig

    spike_max = args.spike_max if args.spike_max is not None else min(2.6, float(ep))
    extra = {"spike_probability": args.spike_prob} if args.spike_prob is not None else {}
    return SkewConfig(seed=args.skew_seed, pattern=args.skew, spike_max_ratio=spike_max,
                      spike_min_ratio=min(1.2, spike_max), **extra)


def _run_demo(args: argparse.Namespace) -> int:
    """Two expert-parallel processes, routing spikes, an automatic budget: `train` with the
    demo's arguments. --nproc 1 is the plain single-process run."""
    from spikeguard.model.config import model_config
    from spikeguard.train.loop import TrainConfig

    if args.nproc != 1:
        if args.nproc < 2:
            raise UsageError(f"--nproc must be a positive integer, got {args.nproc}")
        argv = ["train", "--preset", DEMO_PRESET, "--nproc", str(args.nproc),
                "--steps", str(args.steps), "--seed", str(args.seed),
                "--batch-size", str(DEMO_BATCH),
                "--eval-every", str(max(1, min(DEMO_EVAL_EVERY, args.steps))),
                *DEMO_SKEW, "--budget", "auto", "--policy", "adaptive"]
        for flag, value in (("--log", args.log), ("--threads", args.threads)):
            if value is not None:
                argv += [flag, str(value)]
        return main(argv)
    train_cfg = TrainConfig(steps=args.steps, batch_size=DEMO_BATCH, seed=args.seed,
                            eval_every=max(1, min(DEMO_EVAL_EVERY, args.steps)))
    return _run(DEMO_PRESET, model_config(DEMO_PRESET), train_cfg, data=None, log=args.log,
                threads=args.threads, guard_args=None)


def _make_guard(model, args: argparse.Namespace, optimizer):
    """Attach the memory guard; imported here so plain training never needs the runtime."""
    try:
        from spikeguard import attach
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.startswith("spikeguard.runtime"):
            raise UsageError("--budget/--policy need the memory runtime "
                             "(spikeguard.runtime.guard), which this install lacks") from None
        raise
    kwargs: dict[str, Any] = {"optimizer": optimizer}
    if args.budget_bytes is not None:
        kwargs["budget"] = args.budget_bytes
    if args.policy is not None:
        kwargs["policy"] = args.policy
    return attach(model, **kwargs)


def _run(preset: str, model_cfg, train_cfg, *, data: Optional[str], log: Optional[str],
         threads: Optional[int], guard_args: Optional[argparse.Namespace],
         parallel_args: Optional[argparse.Namespace] = None,
         run_args: Optional[argparse.Namespace] = None) -> int:
    import torch

    if threads is not None and threads <= 0:
        raise UsageError(f"--threads must be a positive integer, got {threads}")
    threads_before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _train_and_report(preset, model_cfg, train_cfg, data=data, log=log,
                                 guard_args=guard_args, parallel_args=parallel_args,
                                 run_args=run_args)
    finally:
        # main() may run inside a longer-lived process (tests): leave its setting as found.
        torch.set_num_threads(threads_before)


def _expert_parallel(model, args: argparse.Namespace):
    """Join torchrun's group, shard the experts, attach the skew injector: the loop's hooks."""
    from spikeguard.parallel.expert_parallel import parallelize_experts
    from spikeguard.parallel.launch import init_worker
    from spikeguard.parallel.training import ExpertParallelHooks

    worker = init_worker()
    parallelize_experts(model, worker.group)
    injector = None
    if args.skew_config is not None:
        from spikeguard.routing.skew import SkewInjector, SkewSchedule

        schedule = SkewSchedule(args.skew_config, worker.world_size)
        injector = SkewInjector(schedule, worker.world_size).attach(model)
        injector.set_step(0)  # the evaluation before the first step
    return ExpertParallelHooks(worker, injector)


def _train_and_report(preset: str, model_cfg, train_cfg, *, data: Optional[str],
                      log: Optional[str], guard_args: Optional[argparse.Namespace],
                      parallel_args: Optional[argparse.Namespace] = None,
                      run_args: Optional[argparse.Namespace] = None) -> int:
    import torch
    from rich.console import Console

    from spikeguard.data.corpus import load_corpus
    from spikeguard.model.transformer import build_model
    from spikeguard.train.log import check_log_path, format_rate, memory_summary
    from spikeguard.train.loop import summarize, train

    if log is not None:
        check_log_path(log)
    corpus = load_corpus(data)
    corpus.check_seq_len(model_cfg.seq_len)
    model = build_model(model_cfg, seed=train_cfg.seed)
    console = Console()
    num_params = sum(p.numel() for p in model.parameters())
    parallel = _expert_parallel(model, parallel_args) if parallel_args else None
    if parallel is not None:
        if log is not None and parallel.worker.rank:
            stem, dot, ext = log.rpartition(".")
            log = f"{stem}.rank{parallel.worker.rank}.{ext}" if dot else f"{log}.rank{parallel.worker.rank}"
        if not parallel.is_main:
            console = Console(quiet=True)
    tokens_per_step = train_cfg.micro_batches * train_cfg.batch_size * model_cfg.seq_len
    _say(console, f"model {preset}: {model_cfg.num_layers} layers, {model_cfg.num_experts} "
                  f"experts top-{model_cfg.top_k}, {num_params / 1e6:.2f}M params | "
                  f"{train_cfg.steps} steps x {tokens_per_step} tokens | CPU threads "
                  f"{torch.get_num_threads()}")
    _say(console, f"data: {corpus.source}")
    def guarded(guarded_model, optimizer):
        if guard_args.budget == "auto":
            guard_args.budget_bytes = _auto_budget(guarded_model, optimizer, corpus,
                                                   model_cfg, train_cfg, parallel, console)
        return _make_guard(guarded_model, guard_args, optimizer)

    factory = guarded if guard_args is not None else None
    if guard_args is not None:
        # Training here runs on CPU, where there is no device memory: the peak and budget
        # in the step lines are the bytes the guard's ledger tracks against its budget.
        _say(console, "memory: CPU run, peak / budget are the emulated device's (every live storage, as an allocator counts)")
    if parallel is not None:
        _say(console, f"expert parallel: {parallel.worker.world_size} ranks (gloo), "
                      f"{model_cfg.num_experts // parallel.worker.world_size} experts each; "
                      f"skew {parallel_args.skew or 'none'}; step lines are rank 0's, "
                      f"rank-imb and peak are the cluster's")
    observers, checkpoint = _run_files(run_args, model, model_cfg, train_cfg, parallel)
    try:
        records = train(model, model_cfg, train_cfg, corpus, guard_factory=factory,
                        log_path=log, console=console, parallel=parallel, observers=observers,
                        checkpoint=checkpoint,
                        skip_steps=run_args.skip_step_set if run_args is not None else ())
    except BaseException:
        if parallel is not None:
            parallel.close(clean=False)
        raise
    finally:
        for observer in observers:
            observer.detach()
    if parallel is not None:
        del model, factory, guarded  # the group must be unreferenced when it is torn down
        parallel.close(clean=True)
    s = summarize(records)
    if guard_args is not None:
        _say(console, memory_summary(records))
    if not s:
        _say(console, f"done: no step trained ({len(records)} dropped or resumed past)")
        return 0
    seconds = s["train_time_s"]

    def loss_pair(first, last) -> str:
        return f"{'-' if first is None else f'{first:.3f}'} -> {'-' if last is None else f'{last:.3f}'}"

    _say(console, f"done: {s['steps']} steps in {seconds:.{1 if seconds >= 10 else 2}f} s "
                  f"(training only) | train loss {loss_pair(s['loss_first'], s['loss_last'])} | "
                  f"val loss {loss_pair(s['val_loss_init'], s['val_loss_final'])} | "
                  f"{format_rate(s['tokens_per_s'])} tok/s")
    return 0


def _auto_budget(model, optimizer, corpus, model_cfg, train_cfg, parallel, console) -> int:
    """--budget auto: measure a calm step with everything saved (routing held at the calm
    maximum when skew is injected; the worst rank under expert parallelism), add the margin.
    The probe draws its own micro-batches, so the training data is unchanged."""
    import torch

    from spikeguard.memory.budget import format_bytes
    from spikeguard.train.auto_budget import AUTO_MARGIN, auto_budget, calm_peak_bytes

    offset = parallel.seed_offset if parallel is not None else 0
    gen = torch.Generator().manual_seed(train_cfg.seed + AUTO_PROBE_SEED + offset)
    batches = [corpus.get_batch("train", train_cfg.batch_size, model_cfg.seq_len, gen)
               for _ in range(train_cfg.micro_batches)]
    injector = parallel.injector if parallel is not None else None
    held = ""
    if injector is not None:
        calm = injector.schedule.config.calm_max_ratio
        injector.hold(calm)
        held = f", routing held at the calm maximum {calm:g}x on rank 0"
    group = parallel.worker.group if parallel is not None else None
    peak, static = calm_peak_bytes(model, optimizer, batches, group=group)
    budget = auto_budget(peak, static)
    _say(console, f"memory: budget auto = {format_bytes(budget)}: a calm step with everything "
                  f"saved peaks at {format_bytes(peak)} (worst rank{held}; "
                  f"{format_bytes(static)} of it parameters, gradients and optimizer state), "
                  f"plus {AUTO_MARGIN:.0%} of its activations (emulated device)")
    return budget


AUTO_PROBE_SEED = 7919  # the probe's micro-batches are drawn apart from the training data


def _say(console, text: str) -> None:
    console.print(text, soft_wrap=True, markup=False, highlight=False)


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command line; returns the exit code (the console script exits with it)."""
    if argv is None:
        from spikeguard.parallel.launch import worker_argv
        argv = worker_argv()  # a rank relaunched under torchrun reads its arguments here
    try:
        try:
            args = _build_parser().parse_args(argv)
        except SystemExit as exc:       # --help / --version
            return exc.code if isinstance(exc.code, int) else 0
        args.argv = list(sys.argv[1:] if argv is None else argv)
        return args.run(args)
    except UsageError as exc:
        print(f"spikeguard: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except DeviceOutOfMemory as exc:
        rank = f" on rank {os.environ['RANK']}" if "RANK" in os.environ else ""
        print(f"spikeguard: out of memory{rank}: {_one_line(exc)}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        print("spikeguard: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # Output piped into `head`: stop quietly, and keep Python's exit-time flush of
        # stdout from raising the same error again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except RuntimeError as exc:
        from spikeguard.memory.device import DeviceBuildError
        if isinstance(exc, DeviceBuildError):   # no compiler: the machine, not the input
            print(f"spikeguard: error: {_one_line(exc)}", file=sys.stderr)
            return 1
        if not _peer_failed(exc):
            raise
        # A rank of the group died (its own message is printed): this one's collective
        # broke. One line, not a traceback of the broken collective.
        print(f"spikeguard: rank {os.environ.get('RANK', '?')} stopped: another rank of "
              f"the group failed ({_one_line(exc).split('. ')[0]})", file=sys.stderr)
        return 1


# What gloo and NCCL say in a surviving rank when a peer's process is gone.
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
              "NCCL communicator was aborted")


def _peer_failed(exc: BaseException) -> bool:
    return "RANK" in os.environ and any(text in str(exc) for text in _PEER_GONE)
