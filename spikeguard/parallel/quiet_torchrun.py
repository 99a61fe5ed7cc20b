"""torchrun without its traceback: `python -m spikeguard.parallel.quiet_torchrun ARGS...`
takes torchrun's own arguments and runs torch.distributed.run's launcher.

When a rank fails, torchrun's entry point prints a Python traceback of its own
ChildFailedError and an error table, after the rank has already printed its one-line
message. A user must see that line, not a traceback: this calls the same launcher
(`torch.distributed.run.run`), quiets the elastic agent's logs, writes which ranks failed
and how (exit code, or the signal that killed them) to the file named by
SPIKEGUARD_FAILURES for the launcher's final line, and exits 3 when a rank ran out of
memory, 1 for another failure, 128 + N when a signal N stopped torchrun itself.

Started by spikeguard's launcher (SPIKEGUARD_LAUNCHER_PID set), it dies with it: the
kernel sends it SIGTERM when the launcher goes (even by SIGKILL), and torchrun's own
handler then stops the ranks.
"""

from __future__ import annotations

import json
import logging
import os
import sys


def main(argv: list[str]) -> int:
    from spikeguard.parallel.launch import LAUNCHER_ENV, TORCHRUN_ENV, watch_parent

    if LAUNCHER_ENV in os.environ:
        watch_parent(int(os.environ[LAUNCHER_ENV]))
    os.environ[TORCHRUN_ENV] = str(os.getpid())   # the ranks inherit it (watch_parent)

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    args = get_args_parser().parse_args(argv)
    # Each elastic module's logger has a level of its own (torch 2.13: "WARNING", or
    # $LOGLEVEL), so the parent's is not enough: "Received 15 death signal, shutting down
    # workers" would follow the launcher's own line.
    import torch.distributed.elastic.agent.server.api  # noqa: F401  (creates its logger)
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        run(args)
    except ChildFailedError as err:
        failures = [{"rank": int(rank), "exitcode": int(f.exitcode)}
                    for rank, f in err.failures.items()]
        _write_failures(failures)
        return usage_or_oom({f["exitcode"] for f in failures})
    except SignalException as err:
        return 128 + int(err.sigval)
    return 0


def usage_or_oom(codes: set) -> int:
    """2 if a rank refused its input (the cause; its peers then fail too), 3 if a rank
    ran out of memory, 1 otherwise."""
    return 2 if 2 in codes else 3 if 3 in codes else 1


def _write_failures(failures: list[dict]) -> None:
    from spikeguard.parallel.launch import FAILURES_ENV

    path = os.environ.get(FAILURES_ENV)
    if path:
        try:
            with open(path, "w") as f:
                json.dump(failures, f)
        except OSError:
            pass


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
