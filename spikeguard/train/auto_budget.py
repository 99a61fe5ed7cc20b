"""The automatic budget of an emulated device: what calm steps need, plus a margin.

The peak is the device's true one (every live storage, backward included). For a demo or a benchmark the interesting
budget is the one an engineer would have tuned by hand on calm steps: everything saved
fits, a large routing spike does not. `calm_peak_bytes` measures that peak with one probe step
(policy "none", no limit) on micro-batches the caller draws apart from the training data,
while the skew injector, if any, holds routing at the calm maximum; under expert
parallelism the worst rank's peak is taken (one all-reduce), so every rank gets the same
budget. The probe leaves no gradient behind.
"""

from __future__ import annotations

import copy
import math
from typing import Callable, Optional, Sequence

import torch
from torch import nn

from spikeguard.errors import UsageError
from spikeguard.memory.budget import format_bytes
from spikeguard.memory.static import optimizer_state_bytes

# The margin is a fraction of the activation bytes (the peak less parameters, gradients
# and optimizer state), not of the whole peak: static bytes do not move with routing, and a
# margin on them would let most spikes fit with everything saved.
AUTO_MARGIN = 0.10
_NO_LIMIT = 1 << 50


def calm_peak_bytes(model: nn.Module, optimizer: Optional[torch.optim.Optimizer],
                    micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
                    group=None, loss_of: Optional[Callable] = None) -> tuple[int, int]:
    """(peak, static) device bytes of one step over `micro_batches` with everything saved,
    the optimizer step's peak included. `loss_of(batch)`: the micro-batch's loss (default
    the built-in model's `model(idx, targets).loss`; torchtitan's is computed outside its
    model): the one probe of every family."""
    from spikeguard import attach

    if loss_of is None:
        def loss_of(batch):
            return model(*batch).loss

    if not micro_batches:
        raise UsageError("calm_peak_bytes needs at least one micro-batch")
    guard = attach(model, budget=_NO_LIMIT, policy="none", optimizer=optimizer)
    try:
        with guard.step():
            for batch in micro_batches:
                loss_of(batch).backward()
        record = guard.history[-1]
        # The optimizer's state exists on the device from its first step on; a probe before
        # that step peaks without it, so it is added (it is resident through every later
        # step). The optimizer step itself (state, and its foreach temporaries beside the
        # gradients) may peak higher than the step: it is measured too, then undone.
        to_come = 0
        optimizer_peak = 0
        if optimizer is not None:
            expected, present = optimizer_state_bytes(model, optimizer)
            to_come = expected - present
            optimizer_peak = _optimizer_step_peak(model, optimizer, guard)
    finally:
        guard.detach()
        model.zero_grad(set_to_none=True)
    both = torch.tensor([max(record["peak_bytes"] + to_come, optimizer_peak),
                         record["static_bytes"]], dtype=torch.int64)
    if group is not None:
        import torch.distributed as dist
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    peak, static = both.tolist()
    return peak, static


def pipeline_calm_peak_bytes(engine, micro_batches: Sequence[tuple]) -> tuple[int, int]:
    """(peak, static) of a pipeline rank's calm step, the worst over the whole job, from a
    probe `engine` (spikeguard.train.engines.PipelineEngine) built for it alone, with its
    optimizers: its guards attach before its schedule is built, and the probe is thrown
    away afterwards (the run's own ranks stay as they were). A rank of the interleaved
    schedule holds two chunks, each guarded with half the rank's budget: its peak is twice
    the larger chunk's."""
    from spikeguard import attach

    engine.attach_guards(lambda m, o: attach(m, budget=_NO_LIMIT, policy="none", optimizer=o))
    idx_BT = torch.cat([b[0] for b in micro_batches])
    targets_BT = torch.cat([b[1] for b in micro_batches])
    engine.prank.step(idx_BT, targets_BT)
    peaks, statics = [], []
    for guard, module, optimizer in zip(engine.guards, engine.modules, engine.optimizers):
        record = guard.history[-1]
        expected, present = optimizer_state_bytes(module, optimizer)
        peaks.append(max(record["peak_bytes"] + expected - present,
                         _optimizer_step_peak(module, optimizer, guard)))
        statics.append(record["static_bytes"])
    both = torch.tensor([max(peaks) * len(peaks), max(statics) * len(statics)], dtype=torch.int64)
    import torch.distributed as dist
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    peak, static = both.tolist()
    return peak, static


def _optimizer_step_peak(model: nn.Module, optimizer: torch.optim.Optimizer, guard) -> int:
    """The device's peak over one optimizer step on the probe's gradients; the parameters
    and the optimizer's state are put back exactly as they were."""
    from spikeguard.memory.device import host

    with host():
        params = [p.detach().clone() for p in model.parameters()]
    state = copy.deepcopy(optimizer.state_dict())
    guard.meter.reset_peak()
    optimizer.step()
    peak = guard.meter.peak()
    with torch.no_grad():
        for p, saved in zip(model.parameters(), params):
            p.copy_(saved)
    optimizer.state.clear()
    optimizer.load_state_dict(state)
    return peak


def auto_budget(calm_peak: int, static: int, margin: float = AUTO_MARGIN) -> int:
    """calm_peak plus `margin` of its activation part, rounded up to a whole KiB."""
    if not isinstance(calm_peak, int) or calm_peak <= 0:
        raise UsageError(f"calm peak must be a positive byte count, got {calm_peak!r}")
    if not isinstance(static, int) or not 0 <= static <= calm_peak:
        raise UsageError(f"static bytes must be between 0 and the peak, got {static!r}")
    if not isinstance(margin, (int, float)) or not math.isfinite(margin) or margin < 0:
        raise UsageError(f"margin must be a non-negative number, got {margin!r}")
    return int(math.ceil((calm_peak + margin * (calm_peak - static)) / 1024)) * 1024


def auto_budget_line(peak: int, static: Optional[int], budget: int, held: str = "") -> str:
    """The line that says how `--budget auto` was reached from a calm step's peak."""
    of_it = (f"; {format_bytes(static)} of it parameters, gradients and optimizer state"
             if static is not None else "")
    return (f"memory: budget auto = {format_bytes(budget)}: a calm step with everything "
            f"saved peaks at {format_bytes(peak)} (worst rank{held}{of_it}), plus "
            f"{AUTO_MARGIN:.0%} of its activations (emulated device)")
