"""The automatic budget of an emulated device: what calm steps need, plus a margin.

The peak is the device's true one (every live storage, backward included). For a demo or a benchmark the interesting
budget is the one an engineer would have tuned by hand on calm steps: everything saved
fits, a large routing spike does not. `calm_peak_bytes` is the one probe of every family
(built-in, its pipeline, torchtitan, Hugging Face alone or under transformers' EP with
FSDP2): it runs two real steps of the run's engine (`engine.step`: every micro-batch's
forward and backward, the gradients' reduction and clipping, the optimizer step) on
micro-batches the caller draws apart from the training data, under guards of policy
"none" with no limit, while the skew injector, if any, holds routing at the calm maximum.
The peak is the device's whole count over a step, the larger of the two steps': the
first has no optimizer state during its backward, the second does, and runs on the
weights the first update made. Under expert parallelism those weights route differently
(a rank's received rows, hence its activations, move with them), so no single step on
the first weights can stand for the second; the worst rank's peak is taken (one
all-reduce), so every rank gets the same budget. The probe leaves no gradient behind,
and the parameters, optimizer state and random generators as they were.
"""

from __future__ import annotations

import copy
import math
from typing import Optional, Sequence

import torch

from spikeguard.errors import UsageError
from spikeguard.memory.budget import format_bytes

# The margin is a fraction of the activation bytes (the peak less parameters, gradients
# and optimizer state), not of the whole peak: static bytes do not move with routing, and a
# margin on them would let most spikes fit with everything saved.
AUTO_MARGIN = 0.10
_NO_LIMIT = 1 << 50
PROBE_STEPS = 2   # the first step's update, then a calm step with the optimizer state resident


def calm_peak_bytes(engine, micro_batches: Sequence[tuple], group=None) -> tuple[int, int]:
    """(peak, static) device bytes of a calm step of `engine` (spikeguard.train.engines:
    LocalEngine, TitanEngine, PipelineEngine) over `micro_batches` with everything saved,
    the optimizer step included: the larger whole-step peak of PROBE_STEPS real steps,
    worst over `group` (None: this rank's). The engine holds no guard before (its guards
    are the probe's while it runs) nor after. A rank of the interleaved pipeline holds
    one guard per chunk, each given half the rank's budget: its peak is the chunk count
    times the larger chunk's."""
    from spikeguard import attach
    from spikeguard.train.engines import whole_step_peak

    if not micro_batches:
        raise UsageError("calm_peak_bytes needs at least one micro-batch")
    before = list(engine.guards)
    engine.attach_guards(lambda m, o: attach(m, budget=_NO_LIMIT, policy="none", optimizer=o))
    guards = list(engine.guards)
    # Taken after attach: under FSDP2 attach reshards the modules that kept their
    # parameters gathered, and the parameters are then the sharded ones.
    saved = _saved_state(engine)
    peaks = [0] * len(guards)
    try:
        with torch.random.fork_rng(devices=[]):
            for _ in range(PROBE_STEPS):
                engine.step(micro_batches)
                # The device's peak since the step opened: reduction, clip, optimizer step.
                peaks = [max(p, whole_step_peak(g)) for p, g in zip(peaks, guards)]
        statics = [g.history[-1]["static_bytes"] for g in guards]
    finally:
        for guard in guards:
            if guard.attached:
                guard.detach()
        engine.guards = before
        _restore_state(engine, saved)
    both = torch.tensor([max(peaks) * len(peaks), max(statics) * len(statics)],
                        dtype=torch.int64)
    if group is not None:
        import torch.distributed as dist
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    peak, static = both.tolist()
    return peak, static


def _saved_state(engine) -> tuple[list, list]:
    """Host copies of every module's parameters and each optimizer's state."""
    from spikeguard.memory.device import host

    with host(), torch.no_grad():
        params = [[p.detach().clone() for p in m.parameters()] for m in engine.modules]
        states = [copy.deepcopy(o.state_dict()) for o in engine.optimizers]
    return params, states


def _restore_state(engine, saved: tuple[list, list]) -> None:
    """The parameters and optimizer states as `_saved_state` found them, no gradient."""
    params, states = saved
    for module, values in zip(engine.modules, params):
        module.zero_grad(set_to_none=True)
        with torch.no_grad():
            for p, value in zip(module.parameters(), values):
                p.copy_(value)
    for optimizer, state in zip(engine.optimizers, states):
        optimizer.state.clear()
        optimizer.load_state_dict(state)


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
