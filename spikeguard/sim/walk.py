"""One step of one pipeline stage on one expert-parallel rank, under one memory policy.

The walk follows the stage's schedule (spikeguard.sim.schedule) and keeps the device's
figure as its allocator would (spikeguard.sim.device_bytes): weights; gradients, made by
the step's first backward of each chunk (persistent, or freed after every step under
`training.lazy_state`); optimizer state (from the first optimizer step on, under
`lazy_state`); what every resident micro-batch keeps. A forward (spikeguard.sim.chunk)
reaches its own peak above that and adds what it keeps; a backward reaches its own peak
(the head's and each layer's gradients, what comes back from host or is recomputed) and
frees what it kept. The step's peak is the largest of all of them.

The guard's memory (`chunk.Memory`: the window's `Seen`, its layer peaks' slopes, its
forecast of the head) is carried from forward to forward and, in `StepState`, from step to
step as the guard carries it. On the emulated device (device.kind = cpu) the layer peaks
are calibrated after each step from its simulated peaks per (phase, layer) and the
window's probes, by the runtime's arithmetic (plan/layer_room.py); on CUDA the runtime's
device keeps no such peaks and neither does the walk. On CUDA a walk
also starts from the window's steady state (attention part measured, the mean routed
copies per token), so that one walk serves every rank and step that share its load.

Decisions are pure functions of (chunk, loads, bytes in use, gradients still to come, the
schedule position, what older resident micro-batches hold, the guard's memory), so one
forward is memoised on that key (of the older ones' bytes, the sums it reads:
sim/forward_memo.py).

Time of a micro-batch on this rank: forward FLOPs at the device's achieved rate plus the
all-to-all (dispatch and combine), backward `backward_ratio` (2) times the forward's
compute plus its all-to-all, plus what the plans add (the planner's own `added_s`:
recompute, and copies that do not hide), plus whole-layer recompute and safety-net re-runs.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace
from operator import attrgetter
from typing import Optional

from spikeguard.extras import require

np = require("numpy", "sim", "spikeguard simulate")   # the `sim` extra

from spikeguard.plan.cost import CostModel
from spikeguard.plan.planner import Planner
from spikeguard.plan.room import Seen, forward_transient_bytes_per_routed
from spikeguard.sim.chunk import HEAD, Chunk, Memory
from spikeguard.sim.forward_memo import ForwardMemo
from spikeguard.sim.residents import positions_of as _positions
from spikeguard.sim.config import SimConfig
from spikeguard.plan.layer_room import (BACKWARD, FORWARD, MICRO_BATCH_CODES, LayerRoom, Probe,
                                        expert_grads)
from spikeguard.sim.schedule import Op, stage_ops
from spikeguard.sim.shape import DeviceModel, StageShape
from spikeguard.sim.stage_times import StageTimes
from spikeguard.sim.uniform import schedule_facts, walk_uniform_static


_pending = attrgetter("pending")


@dataclass(frozen=True)
class StepState:
    """What one rank carries into a step: whether the optimizer's state exists yet, and
    (adaptive) the guard's memory."""

    optimizer: bool = False
    memory: Optional[Memory] = None


@dataclass
class _Walk:
    """One step's walk on one stage, as it goes (StageWalker.walk)."""

    in_use: int
    lingering: int
    peak: int = 0
    seconds: float = 0.0
    k: int = 0           # forwards run so far (their ordinals)
    grads_done: set = field(default_factory=set)
    live: dict = field(default_factory=dict)       # (micro-batch, chunk) -> forward ordinal
    fwds: dict = field(default_factory=dict)       # forward ordinal -> its Forward
    device: dict = field(default_factory=dict)     # forward ordinal -> bytes it keeps on device
    evictable: dict = field(default_factory=dict)  # forward ordinal -> of those, what may go
    host: dict = field(default_factory=dict)       # (forward ordinal, layer) -> host bytes
    host_max: dict = field(default_factory=dict)   # forward ordinal -> its largest of those
    # id(a forward's decisions) -> [them, how many forwards had them] (memoised ones share)
    tally: dict = field(default_factory=dict)
    memory: Optional[Memory] = None
    where: dict = field(default_factory=dict)      # (phase, layer, mb mod 4): position codes
    probes: list = field(default_factory=list)
    # forward ordinal -> its probes, until its backward says what the others hold then
    waiting: dict = field(default_factory=dict)
    head_probes: dict = field(default_factory=dict)

    def decisions(self) -> Counter:
        """The forwards' decisions added up, as adding each in turn would (int counts)."""
        out: Counter = Counter()
        for counted, n in self.tally.values():
            for key, value in counted.items():
                out[key] += value * n
        return out


@dataclass
class WalkResult:
    peak_bytes: int
    seconds: float        # this rank's busy time in the step
    crashed: bool
    decisions: Counter
    state: StepState = StepState()
    # The largest in-use per (phase "F"/"B", layer in the chunk, micro-batch mod 4): the
    # runtime's position codes (uniform static walks do not record them, nor walks on
    # CUDA, whose runtime device keeps no such peaks: 1.2M max() calls of `1t`'s walks).
    where: Optional[dict] = None


class StageWalker(StageTimes, ForwardMemo):
    """Walks one stage's schedule for one policy; memoises forwards."""

    def __init__(self, cfg: SimConfig, dm: DeviceModel, stage: StageShape, policy: str,
                 cost: CostModel, figures=None, statics=None):   # shared by a run's walkers
        self.cfg, self.dm, self.stage, self.policy = cfg, dm, stage, policy
        lay, dev = cfg.layout, cfg.device
        self.capacity = float("inf") if policy == "ceiling" else dev.capacity_bytes
        self.cuda = dev.kind == "cuda"
        self.prefetch = self.cuda   # the runtime's offload engine's, on CUDA only (offload.py)
        self.transient = forward_transient_bytes_per_routed(dm.expert_shape, self.cuda)
        self.flop_rate = dev.peak_flops * dev.efficiency
        self.planner = Planner(dm.expert_shape, cost)
        self.ops: list[Op] = stage_ops(stage.stage, lay.pp, lay.micro_batches, lay.virtual_stages)
        self.ep, self.chunks = lay.ep, Chunk(self, figures)
        self._memo, self._statics = {}, ({} if statics is None else statics)   # forwards
        self._grads: dict = {}   # grads_by_layer's answers
        self._next: dict = {}    # (id(room), seen's rates, head) -> (room, next memory, number)
        self._memory_ids: dict = {}   # memory -> its number in the memo key
        self.positions = _positions(self.ops) if policy == "adaptive" else []
        # per op of the schedule: a forward?, its chunk (sim/uniform.py's cumulative sum)
        self.is_forward, self.chunk_of = (np.array([op.kind == "F" for op in self.ops]),
                                          np.array([op.chunk for op in self.ops]))
        self.uniform_schedule = schedule_facts(self.is_forward, self.chunk_of, len(stage.chunks))
        # The runtime calibrates its layer peaks from the emulated device only.
        self.calibrates = policy == "adaptive" and not self.cuda
        self.head_layer = len(stage.chunks[0])   # the runtime's code of the head's backward

    # ---- the guard's memory --------------------------------------------------------------
    def initial_state(self) -> StepState:
        """What a freshly attached guard knows: no window memory yet, its layer peaks from
        the shapes, the head from the last Linear's estimate (plan/forecast.py)."""
        if self.policy != "adaptive":
            return StepState(optimizer=not self.dm.lazy_state)
        hb = self.dm.head
        logit = hb.vocab_size * hb.elem_bytes if self.stage.has_head else 0.0
        lb = self.dm.layer
        largest = max(lb.weight_grads()[2:])     # the experts' down and gate_up weights
        room = LayerRoom.from_shape(self.dm.expert_shape.bytes_per_token(), logit,
                                    expert_grads(largest, lb.num_local_experts, not lb.grouped))
        estimate = hb.elem_bytes * (4 * hb.d_model + hb.vocab_size) + 16 + 2 * logit
        head = estimate if self.stage.has_head else 0.0
        return StepState(optimizer=not self.dm.lazy_state,
                         memory=Memory(self._steady_seen() if self.cuda else Seen(), room, head))

    def _steady_seen(self) -> Seen:
        """The guard's steady state: attention part measured, mean load."""
        return Seen(0, self.dm.layer_part() / self.dm.tokens, float(self.cfg.model.top_k))

    # ---- the step ------------------------------------------------------------------------
    def walk(self, load, state: Optional[StepState] = None) -> WalkResult:
        """`load`: an int (every micro-batch and layer) or counts[micro_batch, layer]."""
        state = state or self.initial_state()
        if self.policy != "adaptive" and isinstance(load, (int, np.integer)):
            peak, seconds, crashed, decisions = walk_uniform_static(self, int(load), state)
            return WalkResult(peak, seconds, crashed, decisions,
                              state if crashed else StepState(True, state.memory))
        st = self.stage
        w = _Walk(in_use=self.static_bytes(state), lingering=self.lingering())
        if not self.dm.lazy_state:
            w.in_use += sum(st.chunk_grad_bytes)
            w.grads_done = set(range(len(st.chunks)))
        w.peak = w.in_use
        w.memory = state.memory
        if w.memory is not None and self.cuda:
            w.memory = replace(w.memory, seen=self._steady_seen())
        for op in self.ops:
            over = self._backward(op, w) if op.kind == "B" else self._forward(load, op, w)
            if over:
                return self._overflow(load, state, w.peak, w.seconds, w.decisions())
        memory = w.memory
        if memory is not None and self.calibrates:
            memory = replace(memory, room=memory.room.calibrated(
                lambda phase, layer, mb: w.where.get((phase, layer, mb % MICRO_BATCH_CODES), 0),
                w.probes, w.head_probes))
        if memory is not None and self.cuda:   # every walk starts from the steady state
            memory = replace(memory, seen=self._steady_seen())
        return WalkResult(w.peak, w.seconds, False, w.decisions(), StepState(True, memory),
                          None if self.cuda else w.where)

    def _backward(self, op: Op, w: "_Walk") -> bool:
        """One chunk's backward; True when the device runs out."""
        done = w.live.pop((op.micro_batch, op.chunk))
        fwd = w.fwds.pop(done)
        if self.calibrates:
            others = sum(n for o, n in w.device.items() if o != done)
            w.probes += [replace(p, others_added=others - before)
                         for p, before in w.waiting.pop(done, ())]
        first = op.chunk not in w.grads_done
        top = w.in_use + (fwd.bwd_first if first else fwd.bwd)
        w.peak = max(w.peak, top)
        # the loss's gradient starts the head's backward
        if self.calibrates and self.last_chunk(op.chunk):
            w.head_probes[(self.head_layer, op.micro_batch)] = (w.in_use, self.dm.tokens)
        for layer, rel, rel_first in () if self.cuda else fwd.backward_where:
            key = (BACKWARD, self.head_layer if layer == HEAD else layer,
                   op.micro_batch % MICRO_BATCH_CODES)
            w.where[key] = max(w.where.get(key, 0), w.in_use + (rel_first if first else rel))
        w.in_use -= w.device.pop(done)
        w.evictable.pop(done)
        if w.host_max.pop(done, 0):   # only a forward with host bytes has host entries
            for key in [key for key in w.host if key[0] == done]:
                del w.host[key]
        if first:
            w.in_use += self.stage.chunk_grad_bytes[op.chunk]
            w.grads_done.add(op.chunk)
        w.in_use, w.lingering = w.in_use + w.lingering, 0   # from the first backward on
        return top > self.capacity

    def _forward(self, load, op: Op, w: "_Walk") -> bool:
        """One chunk's forward (or the safety net's re-run of it); True when it runs out."""
        counts, k = self._counts(load, op), w.k
        to_come = self.stage.chunk_grad_bytes[op.chunk] if op.chunk not in w.grads_done else 0
        resident = max(map(_pending, w.fwds.values()), default=0)
        grads = self.grads_by_layer(len(counts), k, to_come)
        older = self.positions[k].older if self.positions else ()
        host_max = w.host_max
        reload = max([host_max[o] for o in older if o in host_max], default=0) if host_max else 0
        fwd = self.forward(op.chunk, counts, w.in_use, k, w.host, w.device, w.memory, to_come,
                           resident, w.evictable, grads, reload)
        if self.policy == "adaptive" and w.in_use + fwd.peak > self.capacity and not fwd.failed:
            # An allocation past the device in forward: the safety net re-runs it.
            net = self.chunks.safety_net(op.chunk, counts, len(counts) - 1)
            net.memory, fwd = fwd.memory, net
        w.memory = fwd.memory or w.memory
        top = w.in_use + fwd.peak
        w.peak = max(w.peak, top)
        w.tally.setdefault(id(fwd.decisions), [fwd.decisions, 0])[1] += 1
        w.seconds += fwd.seconds
        for layer, rel in () if self.cuda else fwd.forward_where:
            key = (FORWARD, layer, op.micro_batch % MICRO_BATCH_CODES)
            w.where[key] = max(w.where.get(key, 0), w.in_use + rel)
        if self.calibrates:   # the window's probes, for the calibration after the step
            part = self.chunks.figures.layer_part
            others = sum(w.device.values())   # the live forwards before this one
            w.waiting[k] = [(Probe(op.micro_batch, layer, w.in_use + rel, n, grads[layer], part,
                                   evicted_later=later, evicted_first=first,
                                   forward_peak_before=w.in_use + rel + first), others - sent)
                            for layer, rel, n, sent, later, first in fwd.probes]
        if fwd.failed or top > self.capacity:
            return True
        if fwd.resident_evictions:   # the older resident micro-batches it sent to host
            newest_first = sorted(self.positions[k].older, reverse=True)
            for index, n in fwd.resident_evictions:
                w.device[newest_first[index]] -= n
                w.evictable[newest_first[index]] -= n
                key = (newest_first[index], "evicted")
                w.host[key] = w.host.get(key, 0) + n
                w.host_max[key[0]] = max(w.host_max.get(key[0], 0), w.host[key])
        w.in_use += fwd.kept - fwd.resident_freed if fwd.resident_evictions else fwd.kept
        w.live[(op.micro_batch, op.chunk)], w.device[k], w.fwds[k] = k, fwd.kept, fwd
        w.evictable[k] = fwd.evictable
        if fwd.host and max(fwd.host) > 0:   # (host bytes are never negative)
            w.host.update({(k, layer): n for layer, n in enumerate(fwd.host) if n})
            w.host_max[k] = max(fwd.host)
        w.k += 1
        return False

    def _overflow(self, load, state: StepState, peak: int, seconds: float,
                  decisions: Counter) -> WalkResult:
        """The device ran out in this step. A static policy crashes; under adaptive the
        step-level safety net (runtime/step.py, `run_step`) frees the step and runs it
        again with every layer recomputed: its time is lost, the re-run's peak and
        decisions stand, and a re-run that does not fit either is the crash."""
        if self.policy != "adaptive":
            return WalkResult(peak, seconds, True, decisions, state)
        full = self._full_walker().walk(load, StepState(state.optimizer))
        again = Counter(full.decisions)
        again["step_rerun"] += 1
        return WalkResult(full.peak_bytes, seconds + full.seconds, full.crashed, again,
                          StepState(not full.crashed or state.optimizer, state.memory))

    def _full_walker(self) -> "StageWalker":
        if getattr(self, "_full", None) is None:
            self._full = StageWalker(self.cfg, self.dm, self.stage, "full", self.planner.cost,
                                     self.chunks.figures, self._statics)
        return self._full

    def static_bytes(self, state: StepState) -> int:
        """On the device before the step's first forward: weights, the pipeline's receive
        buffers, (persistent, or from the first optimizer step on) the optimizer's state;
        the gradients too unless the step's backward makes them."""
        st, dm = self.stage, self.dm
        later = state.optimizer or not dm.lazy_state
        out = st.param_bytes + st.buffer_bytes
        if later:
            out += st.optimizer_bytes
        if not dm.lazy_state:
            out += sum(st.chunk_grad_bytes)
        return out

    def lingering(self) -> int:
        """torch's pipelining: a stage's last sent output stays until the next exchange
        (from its first backward on, one hidden state on every stage but the last)."""
        if not self.dm.torch_buffers or self.cfg.layout.pp == 1 or self.stage.has_head:
            return 0
        return self.dm.layer.flow(self.dm.tokens)

    def _counts(self, load, op: Op) -> tuple[int, ...]:
        chunk = self.stage.chunks[op.chunk]
        if isinstance(load, (int, np.integer)):
            return (int(load),) * len(chunk)
        return tuple(int(c) for c in load[op.micro_batch, list(chunk)])

    # ---- pieces the chunk uses -----------------------------------------------------------
    def first_chunk(self, chunk: int) -> bool:
        return self.stage.has_embed and chunk == 0

    def last_chunk(self, chunk: int) -> bool:
        return self.stage.has_head and chunk == len(self.stage.chunks) - 1
