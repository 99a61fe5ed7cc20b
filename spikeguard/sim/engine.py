"""The simulation: every step, every distinct (stage, load), every policy; then the run.

    result = simulate(load_config(preset="1t"))
    result.policies["adaptive"].mfu

Per step, each stage walks its schedule for each distinct load of the step (spikeguard.sim.
walk), memoised per (policy, stage, load, state); a step that repeats (the same loads and
states) is looked up whole (spikeguard.sim.steps). The step's time is the slowest stage's busy
time plus the pipeline bubble, (pp - 1)/v of that stage's mean micro-batch time; within a
stage the slowest expert-parallel rank sets the pace (every all-to-all waits for it).
A step where any rank runs out of memory is a crash: a cold restart (run.restart_s), the
steps since the last checkpoint re-run, and the crashed attempt itself, all lost; the
steps after the restart are assumed to see fresh routing (training is not bit-replayed),
so the crashed step then completes at the policy's median step time. Gradient all-reduce
over data parallelism and tensor-parallel communication are assumed hidden under compute;
the optimizer step is not counted.
"""

from __future__ import annotations

import gc
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Optional

from spikeguard.extras import require

np = require("numpy", "sim", "spikeguard simulate")   # the `sim` extra

from spikeguard.errors import UsageError
from spikeguard.memory.budget import format_bytes
from spikeguard.plan.cost import CostModel
from spikeguard.sim.config import STATIC_CANDIDATES, SimConfig
from spikeguard.sim.layer_figures import LayerFigures
from spikeguard.sim.loads import Loads
from spikeguard.sim.schedule import bubble_micro_batches
from spikeguard.sim.shape import DeviceModel, build
from spikeguard.sim.steps import PolicySteps
from spikeguard.sim.walk import StageWalker


@dataclass
class PolicyResult:
    name: str
    step_s: np.ndarray               # time of each step as run (crashed: the lost attempt)
    crashed: np.ndarray              # bool per step
    peak_step: np.ndarray            # worst device's peak bytes per step
    peak_bytes: list[int]            # per stage, over the run
    peak_stage_step: np.ndarray      # [step, stage]: that stage's worst device
    decisions: Counter
    decisions_step: list = field(default_factory=list)   # per step, every rank
    total_s: float = 0.0
    lost_s: float = 0.0
    tokens_per_s: float = 0.0
    flops_per_s: float = 0.0
    mfu: float = 0.0
    setting: Optional[str] = None    # safe-static: which static policy it is

    @property
    def crashes(self) -> int:
        return int(self.crashed.sum())

    def to_dict(self) -> dict:
        return {"mfu": self.mfu, "tokens_per_s": self.tokens_per_s,
                "flops_per_s": self.flops_per_s, "crashes": self.crashes,
                "lost_seconds": self.lost_s, "total_seconds": self.total_s,
                "peak_bytes": self.peak_bytes, "setting": self.setting,
                "mean_step_s": float(np.mean(self.step_s[~self.crashed])) if (~self.crashed).any() else None,
                "decisions": dict(self.decisions)}


@dataclass
class SimResult:
    config: SimConfig
    device_model: DeviceModel
    policies: dict[str, PolicyResult]
    spike_steps: np.ndarray
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        cfg, dm = self.config, self.device_model
        return {"config": cfg.to_dict(), "num_params": dm.num_params,
                "tokens_per_step": cfg.layout.global_batch * cfg.model.seq_len,
                "model_flops_per_token": dm.model_flops_per_token,
                "static_bytes": [s.static_bytes for s in dm.stages],
                "spike_steps": int(self.spike_steps.sum()),
                "policies": {name: r.to_dict() for name, r in self.policies.items()},
                "notes": self.notes}


def device_cost(cfg: SimConfig, dm: DeviceModel) -> CostModel:
    dev = cfg.device
    return CostModel.from_rates(dm.expert_shape, dev.peak_flops * dev.efficiency,
                                dev.memory_bytes_per_s, dev.host_bytes_per_s,
                                copies_overlap=dev.kind == "cuda")


# The cyclic garbage collector's thresholds while `simulate` runs (CPython's default
# (700, 10, 10)): young collections only, one per 10,000 allocations. The walks' memos
# keep many small objects alive, and each older collection traverses them again: at the
# defaults one 1,000-step adaptive run of `1t` made 802 young, 73 middle and 4 full
# collections. Interleaved, four runs each (load ~2.5, CPU, emulated device): 4.14 s of
# CPU at the defaults (4.06, 4.17, 4.22, 4.12), 3.54 s at these (3.46, 3.70, 3.63, 3.39;
# 58 young collections, no older one), 3.75 s at (50,000, 10, 10) and 3.77 s with the
# collector off: the simulator does make some cyclic garbage, which young collections
# free. Peak RSS 301 MB in all four.
RUN_GC_THRESHOLDS = (10_000, 1_000, 1_000)


@contextmanager
def fewer_collections(thresholds: tuple[int, int, int] = RUN_GC_THRESHOLDS):
    """The garbage collector's thresholds at `thresholds` inside, as they were after."""
    before = gc.get_threshold()
    gc.set_threshold(*thresholds)
    try:
        yield
    finally:
        gc.set_threshold(*before)


def simulate(cfg: SimConfig, cost: Optional[CostModel] = None,
             progress: Optional[Callable[[int], None]] = None) -> SimResult:
    """Run every policy of `cfg.run.policies` over `cfg.workload.steps` steps (with fewer
    garbage collections: `fewer_collections`; the figures are the same)."""
    with fewer_collections():
        return _simulate(cfg, cost, progress)


def _simulate(cfg: SimConfig, cost: Optional[CostModel],
              progress: Optional[Callable[[int], None]]) -> SimResult:
    wanted = list(cfg.run.policies)
    needed = [p for p in wanted if p != "safe-static"]
    if "safe-static" in wanted:
        needed += [p for p in STATIC_CANDIDATES if p not in needed]
    check_steps_fit(cfg, len(needed))
    dm = build(cfg)
    cost = cost or device_cost(cfg, dm)
    check_fits(cfg, dm, cost)
    loads = Loads(cfg, dm.tokens)
    steps = cfg.workload.steps
    # the byte model's figures and the static policies' forwards, for every walker
    figures, statics = LayerFigures(dm.layer, dm.tokens), {}
    runs = {p: PolicySteps(dm.stages, [StageWalker(cfg, dm, st, p, cost, figures, statics)
                                       for st in dm.stages]) for p in needed}
    lay = cfg.layout
    bubble = bubble_micro_batches(lay.pp, lay.virtual_stages) / lay.micro_batches
    step_s = {p: np.zeros(steps) for p in needed}
    crashed = {p: np.zeros(steps, dtype=bool) for p in needed}
    peak_step = {p: np.zeros(steps, dtype=np.int64) for p in needed}
    peak_ss = {p: np.zeros((steps, lay.pp), dtype=np.int64) for p in needed}
    peak_stage = {p: [0] * lay.pp for p in needed}
    decisions_step = {p: [] for p in needed}
    spikes = np.zeros(steps, dtype=bool)
    for step in range(steps):
        groups = loads.groups(step)
        spikes[step] = loads.is_spike(step)
        for p in needed:
            f = runs[p].step(groups)
            step_s[p][step] = f.slowest_s * (1 + bubble)
            crashed[p][step] = f.crashed
            peak_step[p][step] = f.peak
            for st, stage_peak in zip(dm.stages, f.peak_by_stage):
                peak_ss[p][step, st.stage] = stage_peak
                peak_stage[p][st.stage] = max(peak_stage[p][st.stage], stage_peak)
            decisions_step[p].append(Counter(f.decisions))
        if progress is not None:
            progress(step)
    decisions = {p: runs[p].total_decisions() for p in needed}
    policies = {p: _account(cfg, dm, PolicyResult(p, step_s[p], crashed[p], peak_step[p],
                                                   peak_stage[p], peak_ss[p], decisions[p],
                                                   decisions_step[p]))
                for p in needed}
    out = {}
    for p in wanted:
        out[p] = _safe_static(policies) if p == "safe-static" else policies[p]
    return SimResult(cfg, dm, out, spikes)


def step_bytes(cfg: SimConfig, num_policies: int) -> int:
    """What the simulator keeps per simulated step, at the least: per policy its time,
    crash flag, peak, per-stage peaks (numpy) and a Counter of decisions (CPython 3.11:
    208 bytes with the three actions, plus its list slot); the spike flag."""
    import sys

    counter = sys.getsizeof(Counter(save=1, recompute=1, offload=1)) + 8
    return 1 + num_policies * (8 + 1 + 8 + 8 * cfg.layout.pp + counter)


def check_steps_fit(cfg: SimConfig, num_policies: int) -> None:
    """UsageError when `workload.steps` cannot fit this machine's memory (a typo of a few
    zeros was numpy's MemoryError traceback, or hours of swapping), before any work."""
    from spikeguard.model.config import host_memory_bytes

    steps, have = cfg.workload.steps, host_memory_bytes()
    need = steps * step_bytes(cfg, num_policies)
    if have and need > have:
        raise UsageError(f"--steps (workload.steps) {steps}: simulating {num_policies} policies over "
                         f"{steps:.3g} steps keeps at least {format_bytes(need)} of "
                         f"per-step results, more than this machine's "
                         f"{format_bytes(have)} of memory; at most "
                         f"{have // step_bytes(cfg, num_policies):,} steps fit")


def _account(cfg: SimConfig, dm: DeviceModel, r: PolicyResult) -> PolicyResult:
    """Crashes into time: restart, the steps since the last checkpoint, the lost attempt."""
    ok = r.step_s[~r.crashed]
    median = float(np.median(ok)) if ok.size else float(np.max(r.step_s))
    interval, restart = cfg.run.checkpoint_interval, cfg.run.restart_s
    total = lost = since_checkpoint = 0.0
    for step, seconds in enumerate(r.step_s):
        if r.crashed[step]:
            lost += restart + since_checkpoint + seconds
            seconds = median
        total += seconds
        since_checkpoint += seconds
        if (step + 1) % interval == 0:
            since_checkpoint = 0.0
    r.total_s, r.lost_s = total + lost, lost
    tokens = len(r.step_s) * cfg.layout.global_batch * cfg.model.seq_len
    r.tokens_per_s = tokens / r.total_s
    r.flops_per_s = r.tokens_per_s * dm.model_flops_per_token
    r.mfu = r.flops_per_s / (cfg.layout.devices * cfg.device.peak_flops)
    return r


def _safe_static(policies: dict[str, PolicyResult]) -> PolicyResult:
    """The fastest static setting that never crashed over the simulated steps."""
    alive = [policies[p] for p in STATIC_CANDIDATES if policies[p].crashes == 0]
    if not alive:
        worst = policies["full"]
        r = PolicyResult("safe-static", worst.step_s, worst.crashed, worst.peak_step,
                         worst.peak_bytes, worst.peak_stage_step, worst.decisions,
                         worst.decisions_step, worst.total_s, worst.lost_s,
                         worst.tokens_per_s, worst.flops_per_s, worst.mfu, setting=None)
        return r
    best = max(alive, key=lambda r: r.tokens_per_s)
    return PolicyResult("safe-static", best.step_s, best.crashed, best.peak_step,
                        best.peak_bytes, best.peak_stage_step, best.decisions,
                        best.decisions_step, best.total_s, best.lost_s,
                        best.tokens_per_s, best.flops_per_s, best.mfu, setting=best.name)


def check_fits(cfg: SimConfig, dm: DeviceModel, cost: CostModel) -> None:
    """A model that does not fit even with full recompute under the mean load is an error
    that says what would: the capacity needed, and layouts that would bring it down."""
    need = full_recompute_peak(cfg, dm, cost)
    cap = cfg.device.capacity_bytes
    if need <= cap:
        return
    lay = cfg.layout
    hints = [f"a device of at least {format_bytes(need, round_up=True)}"]
    for name, changes in (("pp", {"pp": lay.pp * 2}), ("ep", {"ep": lay.ep * 2}),
                          ("tp", {"tp": lay.tp * 2}),
                          ("micro_batch_size", {"micro_batch_size": max(1, lay.micro_batch_size // 2)})):
        try:
            other = cfg.with_changes(layout=changes)
        except UsageError:
            continue
        if changes == {"micro_batch_size": lay.micro_batch_size}:
            continue
        peak = full_recompute_peak(other, build(other), cost)
        if peak <= cap:
            value = next(iter(changes.values()))
            hints.append(f"layout.{name} = {value} (full recompute peak {format_bytes(peak)})")
    raise UsageError(
        f"the model does not fit even with full recompute: a stage needs "
        f"{format_bytes(need)} on a device of {format_bytes(cap)} (static "
        f"{format_bytes(max(s.static_bytes for s in dm.stages))}); would fit: "
        + "; ".join(hints))


def full_recompute_peak(cfg: SimConfig, dm: DeviceModel, cost: CostModel) -> int:
    """Worst stage's peak under full recompute with every rank at the mean load."""
    mean = dm.tokens * cfg.model.top_k
    peaks, figures = [], LayerFigures(dm.layer, dm.tokens)
    for st in dm.stages:
        walker = StageWalker(cfg, dm, st, "full", cost, figures)
        walker.capacity = float("inf")  # the whole peak, not where it would first overflow
        peaks.append(walker.walk(mean).peak_bytes)
    return max(peaks)
