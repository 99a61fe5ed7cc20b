"""Routing loads per step: routed token copies each expert-parallel rank receives.

T = tokens one rank routes per micro-batch, K = top-k, R = ep ranks; the mean a rank
receives is T*K. Two sources:

  * the skew schedule (spikeguard.routing.skew.SkewSchedule, the production distribution by
    default: 2.9% spike steps of 1.2x to 2.6x): per step one hot rank receives ratio * T*K
    copies and the others share the rest evenly, in every micro-batch and layer of the
    step, exactly as the runtime's SkewInjector steers every router of a step;
  * a recorded trace (spikeguard.routing.trace): per step, micro-batch, layer and expert.

Load resolution: under the schedule a rank's count is rounded *up* to a multiple of
mean / `workload.load_resolution` (256 by default: at most 0.4% more than drawn; 0 keeps
exact counts). Rounding up can only add memory; it lets a 1,000-step run reuse the walk of
an earlier step with the same load instead of walking thousands of nearly equal loads.

`groups(step)` returns the distinct loads of a step with how many ranks have each: under
the schedule two (the hot rank, the rest), so a step on 12,288 devices walks a few
(stage, load) pairs, not 12,288 ranks. Every EP group of the cluster (dp/ep of them per
stage) is assumed to see the step's distribution: the published spike statistics are the
job's, and one overflowing device crashes the job.
"""

from __future__ import annotations

from typing import Union

from spikeguard.extras import require

np = require("numpy", "sim", "spikeguard simulate")   # the `sim` extra

from spikeguard.routing.skew import SkewSchedule
from spikeguard.errors import UsageError
from spikeguard.sim.config import SimConfig

Load = Union[int, np.ndarray]   # uniform count, or counts[micro_batch, layer] (global layers)


class Loads:
    def __init__(self, cfg: SimConfig, tokens: int):
        self.cfg = cfg
        self.mean = tokens * cfg.model.top_k
        self.ep = cfg.layout.ep
        self.trace_loads = None
        self.schedule = None
        resolution = cfg.workload.load_resolution
        self.quantum = max(1, self.mean // resolution) if resolution else 1
        if cfg.workload.trace is not None:
            self.trace_loads = _trace_loads(cfg, tokens)
        elif self.ep >= 2:
            self.schedule = SkewSchedule(cfg.workload.skew_config(), self.ep)

    def groups(self, step: int) -> list[tuple[Load, int]]:
        """[(load, number of ranks with it)] for `step` (0-based)."""
        if self.trace_loads is not None:
            per_rank = self.trace_loads[step]              # [M, L, R]
            return [(np.ascontiguousarray(per_rank[:, :, r]), 1) for r in range(self.ep)]
        if self.schedule is None:
            return [(self.mean, 1)]
        _, ratio = self.schedule.target(step)
        total = self.mean * self.ep
        hot = min(total, int(round(ratio * self.mean)))
        cold = -(-(total - hot) // (self.ep - 1))          # the rounding lands on the cold side
        return [(self._round_up(hot), 1), (self._round_up(cold), self.ep - 1)]

    def _round_up(self, count: int) -> int:
        return -(-count // self.quantum) * self.quantum

    def is_spike(self, step: int) -> bool:
        return self.schedule is not None and self.schedule.is_spike(step)


def _trace_loads(cfg: SimConfig, tokens: int) -> np.ndarray:
    from spikeguard.routing.trace import load_trace

    m, lay = cfg.model, cfg.layout
    trace = load_trace(cfg.workload.trace)
    trace.check_matches(steps=cfg.workload.steps, num_layers=m.num_layers,
                        num_experts=m.num_experts, top_k=m.top_k, ep=lay.ep,
                        micro_batches=lay.micro_batches, tokens_per_micro_batch=tokens)
    loads = trace.rank_loads()
    if loads.min() < 0:
        raise UsageError(f"trace {cfg.workload.trace} has negative counts")
    return loads.astype(np.int64)
