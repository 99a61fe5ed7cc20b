"""One step of one pipeline stage on one expert-parallel rank, under one memory policy.

The walk follows the stage's schedule (spikeguard.sim.schedule): a forward adds what the
micro-batch chunk keeps for backward, its backward frees it. Every expert-path decision
is the runtime's own: `Planner.fixed` for the static policies, and for `adaptive`
`Planner.decide` with the inputs that spikeguard.plan.room computes for the runtime's
decision window too (`decision_inputs`, `layer_cannot_fit`: the same functions, the same
Forecast with the schedule's residency): whole-layer recompute when even the least would
not fit at the layer's entry, and the safety net (the micro-batch re-run with full
recompute) when the planner raises. Nothing here decides memory; the walk only says what
the window would know (bytes in use, the attention part, what earlier layers routed).

The window's memory of earlier decisions (`room.Seen`) is carried from forward to forward
within a walk as the guard carries it. A walk starts from the guard's steady state: the
attention part measured, routed copies per token at the mean (top-k). The guard keeps its
largest routed copies per token for its whole life, which a walk cannot (the engine walks
one load once for every rank and step that share it, spikeguard/sim/engine.py).

Decisions are pure functions of (chunk, loads, bytes in use, reserve, that memory), so one
forward is memoised on exactly that key: in the steady state of 1F1B the same in-use
figure recurs, and a spike-free step repeats across steps.

Time of a micro-batch on this rank: forward FLOPs at the device's achieved rate plus the
all-to-all (dispatch and combine), backward `backward_ratio` (2) times the forward's
compute plus its all-to-all, plus
what the plans add (the planner's own `added_s`: recompute, and copies that do not hide),
plus whole-layer recompute and safety-net re-runs.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Optional

import numpy as np

from spikeguard.errors import BudgetInfeasible
from spikeguard.plan.catalogue import ALL_OFFLOAD, ALL_SAVE, EXPERTS_RECOMPUTE, OPS
from spikeguard.plan.cost import CostModel
from spikeguard.plan.forecast import Forecast
from spikeguard.plan.planner import Planner
from spikeguard.plan.room import (EntryState, Seen, WindowState, decision_inputs,
                                  forward_transient_bytes_per_routed, layer_cannot_fit)
from spikeguard.sim.config import SimConfig
from spikeguard.sim.schedule import Op, stage_ops
from spikeguard.sim.shape import DeviceModel, StageShape

FIXED_PLANS = {"ceiling": ALL_SAVE, "none": ALL_SAVE, "experts": EXPERTS_RECOMPUTE,
               "offload": ALL_OFFLOAD}


@dataclass
class Forward:
    """One micro-batch chunk's forward on this rank."""

    kept: int             # bytes it keeps until its backward
    peak: int             # most it held during the forward (above what was in use before)
    seconds: float        # forward + backward + what the plans add
    decisions: Counter = field(default_factory=Counter)
    failed: bool = False  # nothing fits, even full recompute: the device runs out
    host: tuple = ()      # bytes it put on the host, per layer of the chunk
    # bytes it evicted from older resident micro-batches: (index in the newest-first order
    # of the older ones, bytes), relative so that the memoised forward applies anywhere
    resident_evictions: tuple = ()
    seen: Optional[Seen] = None   # adaptive: the window's memory after this forward

    @property
    def resident_freed(self) -> int:
        return sum(n for _, n in self.resident_evictions)


@dataclass
class WalkResult:
    peak_bytes: int
    seconds: float        # this rank's busy time in the step
    crashed: bool
    decisions: Counter


def _positions(ops: list[Op]) -> list:
    """The runtime's own reading of a schedule (parallel/pipeline_residency.positions), fed
    the attributes it reads from torch's pipeline IR. All chunks of a stage count as one
    (under the interleaved schedule the unit resident is a micro-batch chunk)."""
    from spikeguard.parallel.pipeline_residency import positions

    actions = [SimpleNamespace(computation_type=SimpleNamespace(value=op.kind), stage_index=0)
               for op in ops]
    return positions(actions, 0)


class _ResidentTracker:
    """The two tracker calls Residency.evictable/evict make (runtime/hooks.py's
    SavedTensorTracker), over the bytes the walk's resident micro-batches hold."""

    def __init__(self, device: dict):
        self.device = dict(device)
        self.evicted: dict = {}

    def evictable(self, micro_batch: int, before_layer: int) -> int:
        return self.device.get(micro_batch, 0)

    def evict(self, micro_batch: int, before_layer: int, num_bytes: int) -> int:
        take = min(num_bytes, self.device.get(micro_batch, 0))
        if take > 0:
            self.device[micro_batch] -= take
            self.evicted[micro_batch] = self.evicted.get(micro_batch, 0) + take
        return max(take, 0)


def _relative(residency, residents: _ResidentTracker) -> tuple:
    """Evictions as (index among the older micro-batches, newest first, bytes)."""
    if not residents.evicted:
        return ()
    order = sorted(residency.position().older, reverse=True)
    return tuple((order.index(mb), n) for mb, n in residents.evicted.items())


def _residency(schedule_positions, forward: int, host: dict, device: dict):
    """The runtime's Residency object, reading this walk's host and device bytes."""
    from spikeguard.parallel.pipeline_residency import Residency

    return Residency(schedule_positions, micro_batch=lambda: forward,
                     host_bytes=lambda: dict(host), device_bytes=lambda k: device.get(k, 0))


class StageWalker:
    """Walks one stage's schedule for one policy; memoises forwards."""

    def __init__(self, cfg: SimConfig, dm: DeviceModel, stage: StageShape, policy: str,
                 cost: CostModel):
        self.cfg, self.dm, self.stage, self.policy = cfg, dm, stage, policy
        lay, dev = cfg.layout, cfg.device
        self.capacity = float("inf") if policy == "ceiling" else dev.capacity_bytes
        self.cuda = dev.kind == "cuda"
        # The runtime's offload engine prefetches on CUDA only (runtime/offload.py).
        self.prefetch = self.cuda
        self.transient = forward_transient_bytes_per_routed(dm.expert_shape, self.cuda)
        self.flop_rate = dev.peak_flops * dev.efficiency
        self.planner = Planner(dm.expert_shape, cost)
        self.ops: list[Op] = stage_ops(stage.stage, lay.pp, lay.micro_batches, lay.virtual_stages)
        self.ep = lay.ep
        self._memo: dict = {}
        self.positions = _positions(self.ops) if policy == "adaptive" else []
        self._is_f = np.array([op.kind == "F" for op in self.ops])
        self._chunk_of = np.array([op.chunk for op in self.ops])

    # ---- the step ----------------------------------------------------------------------
    def walk(self, load) -> WalkResult:
        """`load`: an int (every micro-batch and layer) or counts[micro_batch, layer]."""
        if self.policy != "adaptive" and isinstance(load, (int, np.integer)):
            return self._walk_uniform_static(int(load))
        in_use = self.stage.static_bytes
        peak, seconds = in_use, 0.0
        live: dict = {}     # (micro-batch, chunk) -> forward ordinal
        device: dict = {}   # forward ordinal -> bytes it keeps on the device
        host: dict = {}     # (forward ordinal, layer) -> bytes it has on the host
        decisions: Counter = Counter()
        seen = self._first_seen()
        k = 0
        for op in self.ops:
            if op.kind == "B":
                done = live.pop((op.micro_batch, op.chunk))
                in_use -= device.pop(done)
                for key in [key for key in host if key[0] == done]:
                    del host[key]
                continue
            counts = self._counts(load, op)
            fwd = self.forward(op.chunk, counts, in_use, k, host, device, seen)
            seen = fwd.seen or seen
            top = in_use - fwd.resident_freed + fwd.peak
            peak = max(peak, top)
            decisions.update(fwd.decisions)
            seconds += fwd.seconds
            if fwd.failed or top > self.capacity:
                return WalkResult(peak, seconds, True, decisions)
            if fwd.resident_evictions:   # the older resident micro-batches it sent to host
                newest_first = sorted(self.positions[k].older, reverse=True)
                for index, n in fwd.resident_evictions:
                    device[newest_first[index]] -= n
                    key = (newest_first[index], "evicted")
                    host[key] = host.get(key, 0) + n
            in_use += fwd.kept - fwd.resident_freed
            live[(op.micro_batch, op.chunk)], device[k] = k, fwd.kept
            host.update({(k, layer): n for layer, n in enumerate(fwd.host) if n})
            k += 1
        return WalkResult(peak, seconds, False, decisions)

    def _walk_uniform_static(self, count: int) -> WalkResult:
        """A static policy under one load: every chunk's forward is the same whatever is in
        use, so the walk is a cumulative sum over the schedule (numpy)."""
        fwds = [self.forward(c, (count,) * len(chunk), 0, 0)
                for c, chunk in enumerate(self.stage.chunks)]
        kept = np.array([f.kept for f in fwds], dtype=np.int64)[self._chunk_of]
        secs = np.array([f.seconds for f in fwds])[self._chunk_of] * self._is_f
        live = self.stage.static_bytes + np.cumsum(np.where(self._is_f, kept, -kept))
        decisions: Counter = Counter()
        for c, f in enumerate(fwds):
            n = int(np.sum(self._is_f & (self._chunk_of == c)))
            decisions.update({k: v * n for k, v in f.decisions.items()})
        over = np.flatnonzero(live > self.capacity)
        if over.size:
            end = over[0] + 1
            return WalkResult(int(live[:end].max()), float(secs[:end].sum()), True, decisions)
        return WalkResult(int(live.max()), float(secs.sum()), False, decisions)

    def _counts(self, load, op: Op) -> tuple[int, ...]:
        chunk = self.stage.chunks[op.chunk]
        if isinstance(load, (int, np.integer)):
            return (int(load),) * len(chunk)
        return tuple(int(c) for c in load[op.micro_batch, list(chunk)])

    def _first_seen(self) -> Seen:
        """The guard's steady state (module doc): attention part measured, mean load."""
        return Seen(0, self.dm.layer_part() / self.dm.tokens, float(self.cfg.model.top_k))

    def forward(self, chunk: int, counts: tuple[int, ...], in_use: int, k: int = 0,
                host: dict | None = None, device: dict | None = None,
                seen: Optional[Seen] = None) -> Forward:
        """The k-th forward of the stage. Adaptive decisions depend on the bytes in use,
        the window's memory of earlier forwards (`seen`) and, through the residency
        forecast, on the schedule position and what the older resident micro-batches hold
        on the device and host: all of it is the memo key."""
        if self.policy != "adaptive":
            key = (chunk, counts)
            hit = self._memo.get(key)
            if hit is None:
                hit = self._memo[key] = self._static(chunk, counts)
            return hit
        host, device = host or {}, device or {}
        seen = (seen or self._first_seen()).next_micro_batch()
        pos = self.positions[k]
        older = set(pos.older)
        reload = max((n for (o, _), n in host.items() if o in older), default=0)
        key = (chunk, counts, in_use, pos.to_add, pos.at_backward, reload,
               tuple(device.get(o, 0) for o in sorted(older, reverse=True)), seen)
        hit = self._memo.get(key)
        if hit is None:
            residency = _residency(self.positions, k, host, device)
            hit = self._memo[key] = self._adaptive(chunk, counts, in_use, residency, device, seen)
        return hit

    # ---- pieces shared by every policy -------------------------------------------------
    def _first_chunk(self, chunk: int) -> bool:
        return self.stage.has_embed and chunk == 0

    def _last_chunk(self, chunk: int) -> bool:
        return self.stage.has_head and chunk == len(self.stage.chunks) - 1

    def _ends(self, chunk: int) -> tuple[int, int, float]:
        """Bytes of the embedding and head (if this chunk has them), and the head's FLOPs."""
        T, dm = self.dm.tokens, self.dm
        embed = int(dm.embed_bytes_per_token * T) if self._first_chunk(chunk) else 0
        if self._last_chunk(chunk):
            return embed, int(dm.head_bytes_per_token * T), dm.head_flops_per_token * T
        return embed, 0, 0.0

    def _layer_compute_s(self, count: int) -> float:
        dm = self.dm
        return (dm.dense_flops_per_token * dm.tokens + dm.expert_flops_per_copy * count) / self.flop_rate

    def _a2a_s(self, count: int) -> float:
        """One exchange (dispatch or combine): the larger of what this rank sends (its
        T*K copies) and receives (`count`), the off-rank share of it, at link speed."""
        if self.ep == 1:
            return 0.0
        rows = max(self.dm.tokens * self.cfg.model.top_k, count) * (self.ep - 1) / self.ep
        return rows * self.dm.a2a_bytes_per_copy / self.cfg.device.interconnect_bytes_per_s

    def _base_s(self, counts: tuple[int, ...], head_flops: float) -> float:
        """Forward and backward without any memory policy: the forward's FLOPs, backward
        `device.backward_ratio` times that (2 on GPUs), and 4 exchanges a layer."""
        compute = sum(self._layer_compute_s(c) for c in counts) + head_flops / self.flop_rate
        return (1 + self.cfg.device.backward_ratio) * compute + 4 * sum(self._a2a_s(c) for c in counts)

    def _post_bytes(self) -> int:
        return int((self.dm.shared_bytes_per_token + self.dm.combine_bytes_per_token) * self.dm.tokens)

    def _full_chunk(self, chunk: int, counts: tuple[int, ...]) -> tuple[int, float]:
        """Bytes and added seconds of the chunk with every layer recomputed whole."""
        embed, head, _ = self._ends(chunk)
        kept = embed + head + len(counts) * int(self.dm.input_bytes_per_token * self.dm.tokens)
        return kept, sum(self._layer_compute_s(c) for c in counts)

    # ---- static policies: Planner.fixed -------------------------------------------------
    def _static(self, chunk: int, counts: tuple[int, ...]) -> Forward:
        embed, head, head_flops = self._ends(chunk)
        seconds = self._base_s(counts, head_flops)
        if self.policy == "full":
            kept, added = self._full_chunk(chunk, counts)
            return Forward(kept, kept, seconds + added, Counter(recompute=len(OPS) * len(counts)))
        plan = FIXED_PLANS[self.policy]
        kept, decisions = embed, Counter()
        for count in counts:
            d = self.planner.fixed(plan, count)
            kept += self.dm.layer_part() + d.device_bytes + self._post_bytes()
            seconds += d.added_s
            decisions.update(a.value for a in d.plan.actions)
        return Forward(kept + head, kept + head, seconds, decisions)

    # ---- adaptive: Planner.decide with the runtime's inputs -----------------------------
    def _adaptive(self, chunk: int, counts: tuple[int, ...], in_use: int, residency,
                  device: dict, seen: Seen) -> Forward:
        dm, planner, T = self.dm, self.planner, self.dm.tokens
        cap = int(self.capacity)
        embed, head, head_flops = self._ends(chunk)
        forecast = Forecast(num_layers=len(counts), head_bytes_per_token=head / T,
                            post_bytes_per_token=dm.shared_bytes_per_token,
                            combine_bytes_per_token=dm.combine_bytes_per_token,
                            residency=residency)
        layer_part, post = dm.layer_part(), self._post_bytes()
        min_bpt = planner.min_bytes_per_token
        seconds = self._base_s(counts, head_flops)
        kept_by_layer: list[int] = []
        host_by_layer: list[int] = []
        decisions: Counter = Counter()
        residents = _ResidentTracker(device)
        start_in_use = in_use
        for i, count in enumerate(counts):
            in_use = start_in_use - sum(residents.evicted.values())
            held = embed + sum(kept_by_layer)
            # The runtime's ledger at the layer's entry holds in_use + held.
            if layer_cannot_fit(EntryState(i, cap, in_use + held, T, min_bpt, seen), forecast):
                # The layer runs whole under a checkpoint: no decision, nothing seen.
                kept_by_layer.append(int(dm.input_bytes_per_token * T))
                host_by_layer.append(0)
                seconds += self._layer_compute_s(count)
                decisions["full_layer"] += 1
                decisions["recompute"] += len(OPS)  # the runtime records every op recomputed
                continue
            seen = seen.after(count, layer_part, T)
            room = decision_inputs(WindowState(
                layer=i, budget_bytes=cap, in_use_bytes=in_use + held + layer_part,
                num_routed=count, layer_part_bytes=layer_part, max_routed=seen.max_routed,
                num_tokens=T, min_bytes_per_token=min_bpt,
                transient_bytes_per_routed=self.transient, prefetch=self.prefetch,
                last_layer=i == len(counts) - 1,
                # earlier layers of the micro-batch, and older resident ones (window.py)
                evictable_bytes=held + residency.evictable(residents)), forecast)
            try:
                d = planner.decide(*room.planner_args())
            except BudgetInfeasible:
                net = self._safety_net(chunk, counts, in_use, i, head_flops)
                net.resident_evictions = _relative(residency, residents)
                net.seen = seen
                return net
            if d.evict_bytes:
                own = min(d.evict_bytes, held)
                seconds += self._evict(kept_by_layer, host_by_layer, own)
                if d.evict_bytes > own:
                    before = sum(residents.evicted.values())
                    residency.evict(residents, d.evict_bytes - own)
                    seconds += self._copy_s(sum(residents.evicted.values()) - before)
                decisions["evicted_bytes"] += d.evict_bytes
            kept_by_layer.append(layer_part + d.device_bytes + post)
            host_by_layer.append(planner.offload_bytes_per_token(d.plan) * count)
            seconds += d.added_s
            decisions.update(a.value for a in d.plan.actions)
        kept = embed + sum(kept_by_layer) + head
        return Forward(kept, kept, seconds, decisions, host=tuple(host_by_layer),
                       resident_evictions=_relative(residency, residents), seen=seen)

    def _evict(self, kept_by_layer: list[int], host_by_layer: list[int], evict: int) -> float:
        """Earlier layers go to host, oldest first; their copies cost what the planner's
        cost model says a copy costs (hidden on a device whose copies overlap)."""
        left = evict
        for j in range(len(kept_by_layer)):
            take = min(left, kept_by_layer[j])
            kept_by_layer[j] -= take
            host_by_layer[j] += take
            left -= take
        return self._copy_s(evict)

    def _copy_s(self, num_bytes: int) -> float:
        cost = self.planner.cost
        return 0.0 if cost.copies_overlap else num_bytes * (cost.d2h_s_per_byte + cost.h2d_s_per_byte)

    def _safety_net(self, chunk: int, counts: tuple[int, ...], in_use: int, layer: int,
                    head_flops: float) -> Forward:
        """The planner raised: the runtime abandons the micro-batch and re-runs it with
        full recompute (guard.py); the abandoned forward's layers are time lost, and only
        the re-run's decisions count (as in the runtime's history)."""
        kept, added = self._full_chunk(chunk, counts)
        wasted = sum(self._layer_compute_s(c) + 2 * self._a2a_s(c) for c in counts[:layer + 1])
        decisions = Counter(recompute=len(OPS) * len(counts), safety_net=1)
        failed = in_use + kept > self.capacity
        return Forward(kept, kept, self._base_s(counts, head_flops) + added + wasted, decisions,
                       failed=failed)
