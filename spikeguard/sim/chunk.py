"""One micro-batch chunk on one rank: its forward's decisions and bytes, its backward's peak.

A static policy takes `Planner.fixed`; `adaptive` calls the decision procedure the
runtime's decision window calls too (spikeguard.plan.decide: `entry_fallback`,
`decide_layer`), on what this chunk would know: in use at the decision as the device
counts it, the layer's own
forward and backward peaks (plan/layer_room.py, the runtime's own arithmetic) that
are evicted for first, the forecast with the schedule's residency. Whole-layer recompute
when even the least would not fit at the layer's entry; the safety net (the micro-batch
re-run with full recompute) when the planner raises. Nothing here decides memory: the
chunk only says what the window would know.

Bytes are the device's (sim/device_bytes.py): a layer's forward peak above its decision,
what it keeps, and its backward's timeline above the in-use when that starts; the chunk's
backward walks its layers from the last (the head's first on the last stage). Evictions
move whole saved storages to host, earliest layer first and in the order they were saved,
as runtime/hooks.py does; they come back in their layer's backward.
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, field
from typing import Optional

from spikeguard.errors import BudgetInfeasible
from spikeguard.plan.catalogue import OPS, POLICY_PLANS, LayerPlan
from spikeguard.plan.forecast import Forecast
from spikeguard.plan.frozen import quick_init
from spikeguard.plan.decide import LayerFacts, decide_layer, entry_fallback
from spikeguard.plan.room import EntryState, Seen, backward_above_end
from spikeguard.plan.layer_room import LayerRoom
from spikeguard.sim.chunk_parts import BackwardPeaks, ChunkEvictor, Layer
from spikeguard.sim.layer_figures import LayerFigures
from spikeguard.sim.residents import ResidentTracker, relative

HEAD = "head"


@quick_init
@dataclass(frozen=True)
class Memory:
    """What the guard carries from micro-batch to micro-batch: the window's memory, its
    layer peaks' slopes and its forecast of the head (what the head keeps and its
    backward, measured on the first micro-batch)."""

    seen: Seen
    room: LayerRoom
    head_per_token: float


@dataclass
class Forward:
    """One micro-batch chunk's forward on this rank, and what its backward will do."""

    kept: int             # bytes it keeps until its backward
    peak: int             # its forward's peak above the in-use at its start
    bwd: int              # its backward's peak above the in-use at its start
    bwd_first: int        # the same in the step's first backward of these parameters
    seconds: float        # forward + backward + what the plans add
    decisions: Counter = field(default_factory=Counter)
    failed: bool = False  # the safety net's re-run does not fit either
    host: tuple = ()      # bytes it put on the host, per layer of the chunk
    # bytes it evicted from older resident micro-batches: (index in the newest-first order
    # of the older ones, bytes), relative so that the memoised forward applies anywhere
    resident_evictions: tuple = ()
    memory: Optional[Memory] = None   # adaptive: the guard's memory after this forward
    # Where the device's peaks are, for the runtime's calibration of its layer peaks, by
    # the layer's index in the chunk (the guard's numbering): forward (layer, above the
    # start), backward (layer, above the backward's start, the same in a first backward),
    # probes (layer, in use at the decision above the start, routed copies, bytes of
    # older resident micro-batches it had sent to host by then, this micro-batch's bytes
    # below sent to host after its forward, and before it by its own decision) and the
    # in-use after the forward above its start.
    forward_where: tuple = ()
    backward_where: tuple = ()
    probes: tuple = ()
    end: int = 0
    # adaptive: how far its backward is predicted to reach above the in-use this forward
    # leaves (plan/room.py, backward_above_end), as the runtime's window keeps it
    pending: int = 0
    evictable: int = 0    # of what it keeps, the saved storages that could go to host

    @property
    def resident_freed(self) -> int:
        return sum([n for _, n in self.resident_evictions]) if self.resident_evictions else 0


class Chunk:
    """The forward and backward of one micro-batch chunk, for one stage and policy."""

    def __init__(self, walker, figures: Optional[LayerFigures] = None):
        """`figures`: the byte model's, remembered (shared by every walker of the run: the
        same layer and tokens on every stage)."""
        self.w = walker
        dm = walker.dm
        self.lb, self.hb, self.T = dm.layer, dm.head, dm.tokens
        self.figures = figures or LayerFigures(dm.layer, dm.tokens)
        # id(plan) -> (plan, its actions counted, offload bytes/token, its number)
        self._plans: dict = {}
        self._numbers = itertools.count()
        self._decided: dict = {}     # the layers' plan numbers (-1: whole) -> decisions
        self._backwards: dict = {}   # (chunk, tail, the layers' figures) -> _finish's backward
        self._facts_of: dict = {}    # _facts's arguments -> LayerFacts
        self._fixed_of: dict = {}    # (static policy, routed count) -> Planner.fixed
        self._base: dict = {}    # (counts, head FLOPs) -> walker.base_s

    def _plan_facts(self, plan: LayerPlan) -> tuple[Counter, int, int]:
        """What the chunk adds up per decided plan, found once per plan: its actions as
        the runtime records them, the bytes per routed copy it offloads, and a number
        that stands for it in the chunk's memo keys."""
        hit = self._plans.get(id(plan))
        if hit is None or hit[0] is not plan:
            hit = self._plans[id(plan)] = (plan, Counter(a.value for a in plan.actions),
                                           self.w.planner.offload_bytes_per_token(plan),
                                           next(self._numbers))
        return hit[1], hit[2], hit[3]

    def _decisions(self, numbers: tuple) -> Counter:
        """The decisions of layers decided `numbers` (_plan_facts's; -1: recomputed whole),
        added up in the layers' order as the runtime records them (the keys' order too);
        shared by every forward so decided (the walk adds them up by object and count):
        the caller copies it before adding to it."""
        hit = self._decided.get(numbers)
        if hit is None:
            hit = Counter()
            by_number = {v[3]: v[1] for v in self._plans.values()}
            for n in numbers:
                # the runtime records every op of a layer recomputed whole
                hit.update(by_number[n] if n >= 0 else {"full_layer": 1, "recompute": len(OPS)})
            self._decided[numbers] = hit
        return hit

    def _base_s(self, counts: tuple[int, ...], head_flops: float) -> float:
        hit = self._base.get((counts, head_flops))
        if hit is None:
            if len(self._base) >= 1 << 16:
                self._base.clear()
            hit = self._base[(counts, head_flops)] = self.w.base_s(counts, head_flops)
        return hit

    # ---- pieces shared by every policy ---------------------------------------------------
    def _ends(self, chunk: int) -> tuple[int, int, float]:
        """The embedding's and the head's device bytes (when this chunk has them), and the
        head's FLOPs."""
        w, dm, T = self.w, self.w.dm, self.T
        embed = dm.embed_bytes if w.first_chunk(chunk) else 0
        if w.last_chunk(chunk):
            return embed, self.hb.kept(T), dm.head_flops_per_token * T
        return embed, self.figures.flow, 0.0   # the stage's output, alive until its backward

    def _full_layer(self, count: int) -> Layer:
        flow = self.figures.flow
        return Layer(None, count, self.figures.full(count).kept, [("attn", flow)], flow)

    def _planned_layer(self, plan: LayerPlan, count: int) -> Layer:
        fig = self.figures.planned(plan, count)
        return Layer(plan, count, fig.kept, fig.storages, fig.evictable)

    def backward(self, chunk: int, layers: list[Layer], tail: int,
                 first: bool) -> tuple[int, tuple]:
        """(peak above the in-use at the backward's start, [(layer, peak above it)])."""
        lb, hb, T, w = self.lb, self.hb, self.T, self.w
        r = peak = 0
        where = []
        grads = w.dm.layer_grad_bytes
        if w.last_chunk(chunk):
            head_peak = hb.backward_over_end(T, first)
            peak = head_peak
            where.append((HEAD, head_peak))
            r = -tail + lb.flow(T) + (w.dm.head_grad_bytes if first else 0)
        backward_over = self.figures.backward_over
        for i in range(len(layers) - 1, -1, -1):
            layer = layers[i]
            over = backward_over(layer.plan, layer.num_routed, first, layer.on_host)
            peak = max(peak, r + over)
            where.append((i, r + over))
            r += -layer.kept + (grads if first else 0)
        return peak, tuple(where)

    def _finish(self, chunk: int, layers: list[Layer], embed: int, tail: int, seconds: float,
                decisions: Counter, forward_where: list, moved: int = 0,
                numbers: Optional[tuple] = None, **extra) -> Forward:
        """`moved`: bytes of older resident micro-batches this forward sent to host (the
        relative figures are over the in-use before it started, those bytes included);
        `numbers`: adaptive's, the layers' plan numbers (`_decisions`')."""
        kept = embed + sum([layer.kept for layer in layers]) + tail
        bwd, bwd_first, both = self._backward_pair(chunk, layers, tail, numbers)
        end = kept - moved
        head = self.hb.forward_over_end(self.T) if self.w.last_chunk(chunk) else 0
        peak = max([end + head] + [rel for _, rel in forward_where])
        return Forward(kept, peak, bwd, bwd_first, seconds, decisions,
                       host=tuple(extra.pop("host", ())), forward_where=tuple(forward_where),
                       backward_where=both, end=end,
                       evictable=sum([layer.evictable for layer in layers]), **extra)

    def _backward_pair(self, chunk: int, layers: list[Layer], tail: int,
                       numbers: Optional[tuple] = None) -> tuple:
        """`backward` in a later and in the step's first backward: (peak, peak first,
        ((layer, above, above first), ...)); remembered for layers nothing was evicted of
        (their figures are then their plan's and routed count's): by their plan numbers
        (`numbers`), routed counts and kept bytes."""
        key = None
        # a static policy's chunks are remembered whole by the walker (chunk, counts)
        if numbers is not None and not any([layer.on_host for layer in layers]):
            key = (chunk, tail, numbers, tuple([layer.num_routed for layer in layers]),
                   tuple([layer.kept for layer in layers]))
            hit = self._backwards.get(key)
            if hit is not None:
                return hit
        bwd, where = self.backward(chunk, layers, tail, first=False)
        bwd_first, where_first = self.backward(chunk, layers, tail, first=True)
        out = bwd, bwd_first, tuple((a[0], a[1], b[1]) for a, b in zip(where, where_first))
        if key is not None:
            if len(self._backwards) >= 1 << 16:
                self._backwards.clear()
            self._backwards[key] = out
        return out

    # ---- static policies: Planner.fixed --------------------------------------------------
    def _fixed(self, policy: str, count: int):
        """Planner.fixed of the policy's plan: pure arithmetic on the plan, the count and
        the cost model, which nothing moves during a run; asked once per count."""
        key = (policy, count)
        hit = self._fixed_of.get(key)
        if hit is None:
            if len(self._fixed_of) >= 1 << 16:
                self._fixed_of.clear()
            hit = self._fixed_of[key] = self.w.planner.fixed(POLICY_PLANS[policy], count)
        return hit

    def static(self, chunk: int, counts: tuple[int, ...], policy: Optional[str] = None) -> Forward:
        w, lb, T = self.w, self.lb, self.T
        policy = policy or w.policy
        embed, tail, head_flops = self._ends(chunk)
        seconds = w.base_s(counts, head_flops)
        flow = lb.flow(T)
        layers: list[Layer] = []
        forward_where: list = []
        decisions: Counter = Counter()
        for i, count in enumerate(counts):
            start = embed + flow + sum(layer.kept for layer in layers)
            if policy == "full":
                layer = self._full_layer(count)
                forward_where.append((i, start + self.figures.full(count).forward_over))
                seconds += w.layer_compute_s(count)
                decisions["recompute"] += len(OPS)
            else:
                d = self._fixed(policy, count)
                layer = self._planned_layer(d.plan, count)
                fig = self.figures.planned(d.plan, count)
                forward_where.append((i, start + fig.at_decision + fig.over_decision))
                seconds += d.added_s
                decisions.update(a.value for a in d.plan.actions)
            layers.append(layer)
        return self._finish(chunk, layers, embed, tail, seconds, decisions, forward_where)

    # ---- adaptive: Planner.decide with the runtime's inputs ------------------------------
    def adaptive(self, chunk: int, counts: tuple[int, ...], in_use: int, residency,
                 evictable: dict, memory: Memory, grads_by_layer: tuple,
                 resident_backward: int = 0) -> Forward:
        """The window's decisions by plan/decide.py. `resident_backward`: the other resident
        micro-batches' largest predicted backward excess (the runtime's pending backward);
        `grads_by_layer[i]`: gradients that exist by layer i's backward and not now."""
        w, T, planner, figures = self.w, self.T, self.w.planner, self.figures
        cap = int(w.capacity)
        embed, tail, head_flops = self._ends(chunk)
        forecast = self._forecast(chunk, len(counts), memory, residency)
        layer_part, min_bpt, flow = figures.layer_part, planner.min_bytes_per_token, figures.flow
        seconds = self._base_s(counts, head_flops)
        layers: list[Layer] = []
        # decided: _decisions's numbers; offloaded: _host's
        forward_where, probes, decided, offloaded = [], [], [], []
        residents = ResidentTracker(evictable)
        seen, room = memory.seen, memory.room
        peaks, kept = BackwardPeaks(), 0   # kept: bytes this micro-batch's layers kept
        evictor = ChunkEvictor(layers, probes, residency, residents)

        for i, count in enumerate(counts):
            evictor.deciding = i
            # The device's figure: what was in use, plus this micro-batch's embedding,
            # hidden state and layers so far, less what went to host (older ones' and these).
            start = in_use + embed + flow + kept - evictor.moved
            entry = EntryState(i, cap, start, T, min_bpt, seen, resident_backward)
            if entry_fallback(entry, forecast, room, grads_by_layer[i], evictor, planner,
                              peaks.note):
                layers.append(self._full_layer(count))
                kept += layers[-1].kept
                forward_where.append((i, in_use + embed + flow + kept - evictor.moved - in_use
                                      - layers[-1].kept + figures.full(count).forward_over))
                seconds += w.layer_compute_s(count)
                decided.append(-1)
                offloaded.append(None)
                continue
            # The window remembers the device's growth since the layer's entry.
            grown = figures.at_decision(count)
            seen = seen.after(count, max(layer_part, grown), T)
            at_decision = start + grown
            if w.calibrates:   # only then are the probes read (the walk's calibration)
                probes.append((i, at_decision - in_use, count, evictor.resident_moved, 0, 0))
            facts = self._facts(i, count, seen.max_routed, grads_by_layer[i],
                                i == len(counts) - 1, resident_backward)
            try:
                out = decide_layer(facts, at_decision, room, forecast, planner, evictor,
                                   peaks.note)
            except BudgetInfeasible:
                net = self.safety_net(chunk, counts, i)
                net.resident_evictions = relative(residency, residents)
                net.memory = Memory(seen, room, memory.head_per_token)
                return net
            d = out.decision
            fig = figures.planned(d.plan, count)
            layers.append(Layer(d.plan, count, fig.kept, fig.storages, fig.evictable))
            kept += fig.kept
            # The device held all of it at the decision, before anything was evicted.
            forward_where.append((i, max(at_decision, out.in_use_bytes + fig.over_decision)
                                  - in_use))
            seconds += d.added_s
            _, per_token, number = self._plan_facts(d.plan)
            decided.append(number)
            offloaded.append(per_token)
        decided = tuple(decided)
        decisions = self._decisions(decided)
        if evictor.moved:
            seconds += w.copy_s(evictor.moved)
            decisions = Counter(decisions)
            decisions["evicted_bytes"] += evictor.moved
        out = self._finish(chunk, layers, embed, tail, seconds, decisions, forward_where,
                           moved=evictor.resident_moved, host=self._host(layers, offloaded),
                           numbers=decided,
                           resident_evictions=relative(residency, residents),
                           probes=tuple(probes))
        head = self.hb.ledger(T) / T + room.head_backward_per_token if w.last_chunk(chunk) \
            else memory.head_per_token
        out.memory = Memory(seen, room, head)
        out.pending = backward_above_end(peaks.peak, in_use + out.kept - out.resident_freed,
                                         peaks.over, room.observed)
        return out

    def _facts(self, layer: int, count: int, max_routed: int, grads_to_come: int,
               last_layer: bool, resident_backward: int) -> LayerFacts:
        """The layer's LayerFacts (frozen, so one serves every decision with the same
        figures: its construction was a tenth of the chunk's own time on `1t`)."""
        key = (layer, count, max_routed, grads_to_come, last_layer, resident_backward)
        hit = self._facts_of.get(key)
        if hit is None:
            w = self.w
            if len(self._facts_of) >= 1 << 16:
                self._facts_of.clear()
            hit = self._facts_of[key] = LayerFacts(
                layer=layer, budget_bytes=int(w.capacity), num_routed=count,
                layer_part_bytes=self.figures.layer_part, max_routed=max_routed,
                num_tokens=self.T, min_bytes_per_token=w.planner.min_bytes_per_token,
                grads_to_come=grads_to_come, transient_bytes_per_routed=w.transient,
                prefetch=w.prefetch, last_layer=last_layer,
                resident_backward_bytes=resident_backward)
        return hit

    def _forecast(self, chunk: int, num_layers: int, memory: Memory, residency) -> Forecast:
        """The window's forecast of the rest of the micro-batch, as the runtime's guard
        builds it (its head measured on earlier micro-batches, on the last stage only)."""
        dm = self.w.dm
        head = memory.head_per_token if self.w.last_chunk(chunk) else 0.0
        return Forecast(num_layers=num_layers, head_bytes_per_token=head,
                        post_bytes_per_token=dm.shared_bytes_per_token,
                        combine_bytes_per_token=dm.combine_bytes_per_token, residency=residency)

    def _host(self, layers: list, offloaded: list) -> list[int]:
        """Bytes each layer has on the host: evicted, and offloaded by its plan
        (`offloaded`: per layer, its plan's bytes per routed copy, `_plan_facts`'; None
        for a layer recomputed whole)."""
        return [(layer.on_host.total() if layer.on_host else 0)
                + (per_token * layer.num_routed if per_token is not None else 0)
                for layer, per_token in zip(layers, offloaded)]

    def safety_net(self, chunk: int, counts: tuple[int, ...], layer: int) -> Forward:
        """The planner raised: the runtime abandons the micro-batch and re-runs it with
        full recompute (guard.py); the abandoned forward's layers are time lost, and only
        the re-run's decisions count (as in the runtime's history)."""
        w = self.w
        net = self.static(chunk, counts, policy="full")
        net.seconds += sum(w.layer_compute_s(c) + 2 * w.a2a_s(c) for c in counts[:layer + 1])
        net.decisions = Counter(recompute=len(OPS) * len(counts), safety_net=1)
        return net
