"""Optional dependencies: numpy and matplotlib belong to extras, not to the core.

`import spikeguard`, `attach` and `spikeguard train` need only torch and rich, so the
package installs beside a user's own environment without pulling a plotting stack. The
simulator, routing-trace replay, the bench and the plots import what they use through
`require`, when they run; a missing one is one line naming the extra that installs it:

    spikeguard: error: spikeguard simulate needs numpy, which is not installed: pip install 'spikeguard[sim]'

`MissingExtra` is a UsageError (the CLI's one line, exit 2) and an ImportError (what a
library caller expects from a missing package).
"""

from __future__ import annotations

import importlib
from types import ModuleType

from spikeguard.errors import UsageError

# The extra of pyproject.toml that installs each feature's packages.
EXTRAS = {"sim": ("numpy",), "trace": ("numpy",), "plots": ("numpy", "matplotlib"),
          "bench": ("numpy", "matplotlib"), "tensorboard": ("tensorboard",),
          "wandb": ("wandb",)}


class MissingExtra(UsageError, ImportError):
    """An optional dependency is not installed; the message names the extra to install."""


def require(module: str, extra: str, what: str) -> ModuleType:
    """`module` imported, or MissingExtra naming `extra` for `what` (the feature)."""
    assert extra in EXTRAS and module.split(".")[0] in EXTRAS[extra], (module, extra)
    try:
        return importlib.import_module(module)
    except ImportError as err:
        top = module.split(".")[0]
        if err.name is not None and err.name.split(".")[0] != top:
            raise   # the package is there and one of its own imports failed: its traceback
        raise MissingExtra(f"{what} needs {top}, which is not installed: "
                           f"pip install 'spikeguard[{extra}]'") from None
