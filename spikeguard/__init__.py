"""spikeguard: keep MoE training under the device memory limit through routing spikes.

`spikeguard.attach(model, budget=..., policy="adaptive")` decides per micro-batch and per
operator, right after the router has run, what to keep, recompute or offload.
"""

from spikeguard.errors import BudgetInfeasible, DeviceOutOfMemory, UsageError


def attach(model, budget=None, policy: str = "adaptive", optimizer=None,
           shared_policy: str = "keep", memory_snapshot=None):
    """Attach a guard to `model`; see spikeguard.runtime.guard. `shared_policy` ("keep" or
    "recompute") is the static policy of shared experts and dense (non-MoE) layers;
    `memory_snapshot` a folder for a snapshot of each out-of-memory (CUDA: the allocator's
    history, for pytorch.org/memory_viz; CPU: JSON), spikeguard.memory.snapshot."""
    from spikeguard.integrations import ADAPTERS
    from spikeguard.runtime.guard import attach as _attach
    return _attach(model, budget=budget, policy=policy, optimizer=optimizer,
                   shared_policy=shared_policy, memory_snapshot=memory_snapshot,
                   adapters=ADAPTERS)


__all__ = ["attach", "BudgetInfeasible", "DeviceOutOfMemory", "UsageError"]
