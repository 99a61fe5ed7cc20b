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
import contextlib
import os
import signal
import sys
import time
from typing import Optional, Sequence

from spikeguard.errors import ArgumentParser, DeviceOutOfMemory, OutputError, UsageError


def _quiet_absent_numpy() -> None:
    """numpy is optional for torch and for spikeguard's core (spikeguard.extras), yet
    torch 2.13 warns "Failed to initialize NumPy" at its import when numpy is absent: the
    CLI's output is its own lines, so that warning is dropped there, and only there."""
    import importlib.util
    import warnings

    if importlib.util.find_spec("numpy") is None:
        warnings.filterwarnings("ignore", message="Failed to initialize NumPy")


_quiet_absent_numpy()   # before torch's first import (runtime.interrupts imports it)
from spikeguard.runtime.interrupts import in_finalizer  # noqa: E402


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

    parser = ArgumentParser(
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


def _agreed_elsewhere(exc: DeviceOutOfMemory) -> bool:
    """The job ends on an agreed failure (every rank holds the same line): only the rank
    that ran out prints it. The others exit 3 a moment later, so that a launcher sees that
    rank first and names it (its own SIGTERM then ends the rest)."""
    from spikeguard.runtime.agreement import JobEnds, worst

    if not isinstance(exc, JobEnds) or "RANK" not in os.environ:
        return False
    if int(os.environ["RANK"]) == worst(exc.notes).rank:
        return False
    import time
    time.sleep(2.0)
    return True


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command line; returns the exit code (the console script exits with it)."""
    from spikeguard.parallel.launch import rank_started

    if argv is None:
        from spikeguard.parallel.launch import worker_argv
        try:
            argv = worker_argv()  # a rank relaunched under torchrun reads its arguments here
        except UsageError as exc:
            _usage_line(f"spikeguard: error: {_one_line(exc)}")
            _end_quietly_if_told(2)
            return 2
    rank_started()  # under torchrun: die with it (a no-op elsewhere)
    from spikeguard.bench.worker import WORKER_COMMAND
    if argv is not None and list(argv[:1]) == [WORKER_COMMAND] and "RANK" in os.environ:
        from spikeguard.bench.worker import serve
        return serve(argv[1], main)   # the bench's reusable worker: each job is a main()
    stops = _StopSignals()
    global _STOPS
    outer, _STOPS = _STOPS, stops   # main() may run again in this process (the bench's
    try:                            # worker runs one per job): no stale signal carries over
        code = _main_stopping(argv, stops)
    finally:
        _STOPS = outer
    if "RANK" in os.environ and code:
        _end_quietly_if_told(code)
        _exit_now(code)
    return code


_QUIET_END = False   # this rank of a torchrun by hand left the job's line to another


def _end_quietly_if_told(code: int) -> None:
    from spikeguard.parallel.launch import by_hand, wait_to_be_stopped_by_hand

    if _QUIET_END and by_hand():
        wait_to_be_stopped_by_hand()
        _exit_now(code)


def _main_stopping(argv, stops: "_StopSignals") -> int:
    with stops.installed():
        try:
            code = _run(argv)
        except KeyboardInterrupt as exc:
            code = _stopped(getattr(exc, "signum", None) or stops.signum or signal.SIGINT)
        except Exception:
            if stops.signum is None:
                raise
            # After SIGINT/SIGTERM, whatever ends the command is its consequence (a
            # peer's broken collective): the stop, not a traceback.
            code = _stopped(stops.signum)
    return code


PEER_STOP_WAIT_S = 3.0   # how long a launched rank whose peer vanished waits for its own stop
_STOPS: Optional["_StopSignals"] = None   # main()'s, while it runs


def _await_own_stop() -> None:
    """A launched rank's peer is gone: if that was the launcher's forwarded SIGINT/SIGTERM,
    this rank's copy is on its way (or was taken already, inside the collective that
    then broke): stop on it, silently, rather than report the peer."""
    from spikeguard.errors import Interrupted

    deadline = time.monotonic() + PEER_STOP_WAIT_S
    while True:
        if _STOPS is not None and _STOPS.signum is not None:
            raise Interrupted(_STOPS.signum)
        if time.monotonic() >= deadline:
            return
        time.sleep(0.05)


def _exit_now(code: int) -> None:
    """A rank failed or stopped with its process group alive, its files closed by the
    unwinding: go at once (torchrun sees the root cause first) and
    leave without the interpreter's and torch's teardown, which would print c10d's
    "there are still N unwaited collective calls" or abort in gloo's threads (see
    parallel/launch_utils.close_gloo)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def _run(argv: Optional[Sequence[str]]) -> int:
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
        if _agreed_elsewhere(exc):
            return 3
        rank = f" on rank {os.environ['RANK']}" if "RANK" in os.environ else ""
        _stderr_line(f"spikeguard: out of memory{rank}: {_one_line(exc)}")
        return 3
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
        from spikeguard.parallel.launch_utils import peer_failure
        peer = peer_failure(exc)
        if peer is None:
            raise
        from spikeguard.parallel.launch import LAUNCHER_ENV
        if LAUNCHER_ENV in os.environ:
            # The peer may have stopped on a SIGINT/SIGTERM the launcher forwarded to the
            # whole job, and this rank's is on its way (it lands here as Interrupted).
            _await_own_stop()
            # A rank of the group died and this one's collective broke: the launcher's
            # final line names the dead rank and why; a line from every survivor would
            # only stand between the cause and it.
            return 1
        # Under a torchrun started by hand the failed rank printed the job's line, and
        # torchrun's SIGTERM for this one follows its exit: stop on it, quietly. Only if
        # none comes (the peer was on another machine), one line, not a traceback.
        _await_own_stop()
        print(f"spikeguard: rank {os.environ.get('RANK', '?')} stopped: another rank of "
              f"the group failed ({_one_line(peer).split('. ')[0]})", file=sys.stderr)
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

    global _QUIET_END
    from spikeguard.parallel.launch import by_hand

    if by_hand() and os.environ.get("LOCAL_RANK", "0") != "0":
        _QUIET_END = True   # every rank finds the same mistake: the first of each machine says it
        return
    path = rank_usage_file()
    if path is not None:
        try:
            with open(path, "a", encoding="utf-8") as f:
                f.write(text + "\n")
            return
        except OSError:
            pass
    _stderr_line(text)


def _stopped(signum: int) -> int:
    """SIGINT: 130, SIGTERM: 143. A rank of a launched job says nothing: the launcher
    prints the job's one line. Nor does a rank of a torchrun started by hand: torchrun
    starts its ranks in sessions of their own, so a signal reaches them from torchrun,
    which sends SIGTERM to all when one rank failed (that rank's line is the job's; seen:
    "interrupted by SIGTERM" from the survivor after the other's out-of-memory line) or
    when it was itself stopped (it says so)."""
    from spikeguard.parallel.launch import LAUNCHER_ENV, by_hand

    if LAUNCHER_ENV not in os.environ and not by_hand():
        name = "" if signum == signal.SIGINT else f" by {signal.Signals(signum).name}"
        print(f"spikeguard: interrupted{name}", file=sys.stderr)
    return 128 + signum


class _StopSignals:
    """SIGINT and SIGTERM raise Interrupted once; a repeat (torchrun forwards what the
    launcher already sent) is ignored, so it cannot break the unwinding of the first.

    Python runs a signal handler wherever the main thread is, finalizers included: a
    KeyboardInterrupt raised inside a `__del__` or a weakref callback is printed as
    "Exception ignored in: ..." and dropped, and the run goes on (seen with
    runtime/hooks.py's Packed, 2 of 4 trials). sys.unraisablehook sees every such drop:
    the interrupt is delivered again, to run as soon as the finalizer is left (the
    library does the same inside every guarded step: spikeguard.runtime.interrupts)."""

    def __init__(self):
        self.signum: Optional[int] = None
        self._redeliver = False

    @contextlib.contextmanager
    def installed(self):
        import threading
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self._handle)
                    for sig in (signal.SIGINT, signal.SIGTERM)}
        previous_hook, sys.unraisablehook = sys.unraisablehook, self._unraisable
        try:
            yield
        finally:
            if self._redeliver:
                sys.setprofile(None)
            sys.unraisablehook = previous_hook
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _handle(self, signum, frame) -> None:
        if self.signum is not None and not self._redeliver:
            return
        self.signum = self.signum or signum
        if in_finalizer(frame):
            self._defer()
            return
        self._redeliver = False
        from spikeguard.errors import Interrupted
        raise Interrupted(self.signum)

    def _defer(self) -> None:
        """Raise it at the first call or return outside every finalizer. (Re-arming the
        signal with _thread.interrupt_main would run this handler again at once, still
        inside the finalizer.) A profile function's exception propagates into the code
        it profiles (CPython 3.11, sys.setprofile)."""
        self.signum = self.signum or signal.SIGINT
        self._redeliver = True

        def deliver(frame, event, arg):
            if self._redeliver and not in_finalizer(frame):
                sys.setprofile(None)
                self._redeliver = False
                from spikeguard.errors import Interrupted
                raise Interrupted(self.signum)

        sys.setprofile(deliver)

    def _unraisable(self, unraisable) -> None:
        if isinstance(unraisable.exc_value, KeyboardInterrupt):
            self._defer()
            return
        sys.__unraisablehook__(unraisable)
