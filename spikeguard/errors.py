"""Error types shared by every stage of spikeguard.

`UsageError` is a user mistake (bad argument, bad file): the CLI turns it into a one-line
message and exit code 2. `DeviceOutOfMemory` is the one out-of-memory type the guard uses
everywhere: the emulated CPU budget raises it, and on CUDA `torch.cuda.OutOfMemoryError`
is caught and re-raised as it, so callers handle one type.
"""

import argparse


class UsageError(ValueError):
    """A user mistake: bad argument, unknown preset, missing file. Exit code 2."""


class DeviceOutOfMemory(RuntimeError):
    """The device (real, or the emulated byte budget on CPU) ran out of memory."""

    def __init__(self, message: str, *, needed_bytes: int = 0, budget_bytes: int = 0):
        super().__init__(message)
        self.needed_bytes = needed_bytes
        self.budget_bytes = budget_bytes
        self.memory_snapshot = None   # its snapshot's path, where one was asked for


class BudgetInfeasible(DeviceOutOfMemory):
    """The planner found no plan under the budget; says what budget would work."""


class OutputError(RuntimeError):
    """An output could not be written once work began (disk full, I/O error): one line,
    exit code 3. spikeguard.files leaves the previous file intact."""


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM reached the command: it stops, exit 128 + the signal's number."""

    def __init__(self, signum: int):
        super().__init__(f"signal {signum}")
        self.signum = signum


class ArgumentParser(argparse.ArgumentParser):
    """argparse prints usage plus a message; we want the one-line contract of UsageError.
    No abbreviations (every command's parser is of this class, and the benches' scripts
    use it too): `--step` must not quietly mean `--steps`."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):  # type: ignore[override]
        if message.endswith("expected one argument"):
            # argparse reads `--budget -1GiB` as two flags
            message += " (a value that starts with '-' is written --flag=VALUE)"
        raise UsageError(f"{message} (see '{self.prog} --help')")
