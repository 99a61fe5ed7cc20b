"""spikeguard: keep MoE training under the device memory limit through routing spikes.

`spikeguard.attach(model, budget=..., policy="adaptive")` decides per micro-batch and per
operator, right after the router has run, what to keep, recompute or offload.
"""

from spikeguard.errors import BudgetInfeasible, DeviceOutOfMemory, UsageError


def attach(model, budget=None, policy: str = "adaptive", optimizer=None):
    """Attach a guard to `model`; see spikeguard.runtime.guard."""
    from spikeguard.runtime.guard import attach as _attach
    return _attach(model, budget=budget, policy=policy, optimizer=optimizer)


__all__ = ["attach", "BudgetInfeasible", "DeviceOutOfMemory", "UsageError"]
