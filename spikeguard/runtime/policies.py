"""Names of the memory policies (no torch import, so the CLI can read them cheaply).

adaptive: planned per micro-batch and operator; none: keep everything; full: recompute
every layer; experts: always recompute the expert path; offload: always offload it.
"""

from spikeguard.errors import UsageError
from spikeguard.names import SHARED_POLICIES

POLICIES = ("adaptive", "none", "full", "experts", "offload")


def check_policies(policy, shared_policy) -> None:
    """The guard's two policy settings, each refused in one line (UsageError) naming the
    choices: every door that takes them (attach, the run's configuration, torchtitan's
    converter) checks them here, so they are checked alike. `policy` None: no guard."""
    if policy is not None and policy not in POLICIES:
        raise UsageError(f"unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")
    if shared_policy not in SHARED_POLICIES:
        raise UsageError(f"unknown shared_policy {shared_policy!r}; choose one of "
                         f"{', '.join(SHARED_POLICIES)}")
