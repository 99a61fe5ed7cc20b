"""torchrun without its traceback: `python -m spikeguard.parallel.quiet_torchrun ARGS...`
takes torchrun's own arguments and runs torch.distributed.run's launcher.

When a rank fails, torchrun's entry point prints a Python traceback of its own
ChildFailedError and an error table, after the rank has already printed its one-line
message. A user must see that line, not a traceback: this calls the same launcher
(`torch.distributed.run.run`), quiets the elastic agent's logs, and turns the failure
into an exit code: 2 when a rank refused its input, 3 when a rank ran out of memory
(their own exit codes), 1 otherwise.
"""

from __future__ import annotations

import logging
import sys


def main(argv: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    args = get_args_parser().parse_args(argv)
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    try:
        run(args)
    except ChildFailedError as err:
        codes = {failure.exitcode for failure in err.failures.values()}
        return usage_or_oom(codes)
    return 0


def usage_or_oom(codes: set) -> int:
    """2 if a rank refused its input (the cause; its peers then fail too), 3 if a rank
    ran out of memory, 1 otherwise."""
    return 2 if 2 in codes else 3 if 3 in codes else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
