"""The `spikeguard` command: the parser of every command, and the exit codes.

    .venv/bin/spikeguard demo
    .venv/bin/spikeguard train --preset tiny --steps 50 --log runs/tiny.jsonl

Commands: train and demo (spikeguard.train.command), bench and report
(spikeguard.bench), simulate (spikeguard.sim.cli). Exit codes: 0 done, 2 usage error (bad
argument, file, or setting; one line on stderr), 3 out of memory or out of disk once work began (one line on stderr),
130 interrupted. User mistakes never print a traceback: every argparse error goes
through the same one-line path as a UsageError.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

from spikeguard.errors import DeviceOutOfMemory, OutputError, UsageError


class _ArgumentParser(argparse.ArgumentParser):
    """argparse prints usage plus a message; we want the one-line contract of UsageError.
    No abbreviations (every command's parser is of this class): `--step` must not quietly
    mean `--steps`."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):  # type: ignore[override]
        if message.endswith("expected one argument"):
            # argparse reads `--budget -1GiB` as two flags
            message += " (a value that starts with '-' is written --flag=VALUE)"
        raise UsageError(f"{message} (see '{self.prog} --help')")


def package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("spikeguard")
    except PackageNotFoundError:   # a source tree that was not installed
        return "unknown"


def _build_parser() -> argparse.ArgumentParser:
    """Each command's arguments and body live in its own module; this only gathers them."""
    from spikeguard.bench.bench_cli import add_parser as add_bench_parser
    from spikeguard.bench.report_cli import add_parser as add_report_parser
    from spikeguard.sim.cli import add_parser as add_simulate_parser
    from spikeguard.train.command import add_demo_parser, add_train_parser

    parser = _ArgumentParser(
        prog="spikeguard",
        description="Keep MoE training under the device memory limit through routing spikes.")
    parser.add_argument("--version", action="version",
                        version=f"spikeguard {package_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_train_parser(commands)
    add_demo_parser(commands)
    add_bench_parser(commands)
    add_report_parser(commands)
    add_simulate_parser(commands)
    return parser


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
        _usage_line(f"spikeguard: error: {_one_line(exc)}")
        return 2
    except OutputError as exc:     # disk full once work began; the previous file is kept
        print(f"spikeguard: error: {_one_line(exc)}", file=sys.stderr)
        return 3
    except DeviceOutOfMemory as exc:
        rank = f" on rank {os.environ['RANK']}" if "RANK" in os.environ else ""
        _stderr_line(f"spikeguard: out of memory{rank}: {_one_line(exc)}")
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


def _stderr_line(text: str) -> None:
    """One write per line: print() writes the text and its newline apart, so two ranks'
    messages sharing the terminal could land on one line."""
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


def _usage_line(text: str) -> None:
    """A usage error; in a rank that launch_job started, handed to the launcher, which
    prints each distinct line once (every rank usually finds the same mistake)."""
    from spikeguard.parallel.launch import rank_usage_file

    path = rank_usage_file()
    if path is not None:
        try:
            with open(path, "a", encoding="utf-8") as f:
                f.write(text + "\n")
            return
        except OSError:
            pass
    _stderr_line(text)


# What gloo and NCCL say in a surviving rank when a peer's process is gone.
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
              "NCCL communicator was aborted")


def _peer_failed(exc: BaseException) -> bool:
    return "RANK" in os.environ and any(text in str(exc) for text in _PEER_GONE)
