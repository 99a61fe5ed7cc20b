"""The planner's inputs, from what the decision window knows: one pure function for all.

The runtime's decision window (spikeguard/runtime/window.py) and the simulator's walk
(spikeguard/sim/walk.py) both turn plain numbers into the arguments of
`Planner.decide(num_routed, headroom, evictable, backward_room)` here, so the two cannot
drift apart. Nothing here holds torch tensors, a guard or a ledger: frozen dataclasses of
numbers in, a frozen dataclass out. The one collaborator is the forecast (plan/forecast.py),
whose two methods read the rest of the micro-batch and the pipeline's reservations and
change nothing.

    forward headroom = budget - in use - still to come - forward transient
                       - the resident micro-batches' backward working set (pipeline)
                       - forward extra (FSDP2's bytes still to come)
    backward room    = budget - in use - prefetch margin - backward reserve - backward extra
                       (the reserve is negative where older residents are freed first)
    layer shortfall  = max(layer's forward peak, layer's backward peak + backward reserve)
                       - budget: to evict first, whatever the plan
    at a layer's entry: in use + its attention part + its least expert path (+ still to
                       come), and under expert parallelism at least in use + its attention
                       part + the dispatch exchange's sent rows (the received ones are
                       made room for at the dispatch: runtime/window.py)

    .venv/bin/python -m spikeguard.plan.room      # microseconds per decision, 8 x 64
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Protocol

from spikeguard.plan.catalogue import ExpertShape
from spikeguard.plan.frozen import quick_init


class ToCome(Protocol):
    """What the window asks the forecast (spikeguard.plan.forecast.Forecast)."""

    def still_to_come(self, layer: int, layer_part_bytes: int, max_routed_seen: float,
                      min_expert_bytes_per_token: int, num_tokens: int) -> int: ...

    def backward_reserve(self, layer: int, layer_part_bytes: int, max_routed_seen: float,
                         min_expert_bytes_per_token: int, num_tokens: int) -> int: ...

    def later_evictable(self, layer: int, layer_part_bytes: int,
                        least_expert_bytes: int = 0) -> int: ...


@quick_init
@dataclass(frozen=True)
class Seen:
    """What the window remembers of the decisions before this one: the largest routed count
    of this micro-batch, and the largest attention part and routed copies per token
    measured so far (the runtime's guard keeps the last two for its whole life; they make
    the layer-entry estimate, before a layer's counts are known)."""

    max_routed: int = 0
    layer_bytes_per_token: float = 0.0
    routed_per_token: float = 0.0

    def after(self, num_routed: int, layer_part_bytes: int, num_tokens: int) -> "Seen":
        """The memory once a layer has decided on `num_routed` copies."""
        if not num_tokens:
            return replace(self, max_routed=max(self.max_routed, num_routed))
        # max() written out (`b if b > a else a` is max(a, b), ties and NaN alike): the
        # simulator's `1t` calls this 140k times a run
        part, routed = layer_part_bytes / num_tokens, num_routed / num_tokens
        return Seen(num_routed if num_routed > self.max_routed else self.max_routed,
                    part if part > self.layer_bytes_per_token else self.layer_bytes_per_token,
                    routed if routed > self.routed_per_token else self.routed_per_token)

    def next_micro_batch(self) -> "Seen":
        return replace(self, max_routed=0)


@quick_init
@dataclass(frozen=True)
class WindowState:
    """What the window knows in layer `layer`, right after routing."""

    layer: int
    budget_bytes: int
    in_use_bytes: int          # on the device now, this layer's attention part included
    num_routed: int            # routed copies this layer's local experts received
    layer_part_bytes: int      # this layer's attention + router part, measured
    max_routed: int            # largest routed count of this micro-batch, this one included
    num_tokens: int            # tokens of the micro-batch (0: unknown, use num_routed)
    min_bytes_per_token: int   # Planner.min_bytes_per_token: the least plan, per routed copy
    # Stage temporaries the allocator holds during the expert forward, per routed copy
    # (CUDA: the per-expert GEMM outputs before their concatenation); see
    # `forward_transient_bytes_per_routed`.
    transient_bytes_per_routed: int = 0
    # In backward this layer's offloaded tensors come back while what is in use now is
    # still alive; a prefetch by the layer above also finds that layer's attention part
    # alive (about this layer's): the margin, unless prefetch is off or nothing is above.
    prefetch: bool = False
    last_layer: bool = False
    evictable_bytes: int = 0   # earlier layers of this micro-batch, and older residents
    # Backward working set that is not in use now and not in the forecast (activation
    # gradients of this layer in backward, bytes recompute rematerialises, gradients not
    # yet allocated): subtracted from the backward room. 0 until the byte model has it.
    backward_extra_bytes: int = 0
    # Forward: bytes that are not in use now, not the forecast's, and will be by this
    # micro-batch's last backward peak (FSDP2's units kept gathered, the head's prefetch
    # and gradients; plan/fsdp_bytes.py `forward_to_come`): subtracted from the headroom.
    forward_extra_bytes: int = 0
    # The layer's own peaks, which no plan of its own changes (the whole expert path is
    # alive in its forward, and back with its gradients in its backward; see
    # spikeguard/plan/layer_room.py): device bytes, 0 when not modelled.
    layer_forward_peak_bytes: int = 0
    layer_backward_peak_bytes: int = 0
    # Pipeline: how far the other resident micro-batches' backward will reach above the
    # in-use they left at the end of their forward (`backward_above_end`), the largest.
    # Their backward runs while what this one keeps is still here, and their bytes are
    # in `in_use_bytes` already, so it is room this one's plan must leave free.
    resident_backward_bytes: int = 0


@quick_init
@dataclass(frozen=True)
class Room:
    """The planner's arguments for one decision, and the figures they came from."""

    num_routed: int
    headroom_bytes: int
    evictable_bytes: int
    backward_room_bytes: int
    to_come_bytes: int
    prefetch_margin_bytes: int
    backward_reserve_bytes: int
    # What must leave the device (eviction of earlier layers) before the layer's own
    # forward and backward peaks fit, beside the pipeline's backward reserve.
    layer_shortfall_bytes: int = 0

    def planner_args(self) -> tuple[int, int, int, int]:
        """`Planner.decide(*room.planner_args())`."""
        return self.num_routed, self.headroom_bytes, self.evictable_bytes, self.backward_room_bytes


def forward_transient_bytes_per_routed(shape: ExpertShape, on_cuda: bool) -> int:
    """The largest stage temporary of the expert forward, per routed copy: the gate/up
    output, which the CUDA allocator holds beside the saved tensors until the stage ends.
    The emulated CPU device counts only what stays alive, so there it is 0."""
    return shape.bytes_per_token()["gate_up"] if on_cuda else 0


def backward_above_end(backward_peak_bytes: int, end_in_use_bytes: int,
                       over_decision_bytes: int, measured: bool) -> int:
    """What a finished forward's backward adds on top of the device as that forward left it.

    `measured` (the layer peaks' slopes set from the device's own peaks, LayerRoom.observed):
    its largest predicted layer backward peak (device bytes, as `LayerRoom.needs` gives them
    at each decision) less the in-use at the forward's end. A later micro-batch's in-use
    already holds every byte this one keeps, so only this excess is room it must leave.
    (Taken over each decision's own in-use instead, it counted again the bytes of this
    micro-batch's layers above that decision, which its backward frees before it gets
    there: ~10 MiB of a 64.9 MiB budget on stage 0 of PP=2 x EP=2, `small`.)

    Not measured (the first step; CUDA, whose device keeps no peaks per position): the
    slopes are the shapes' guess, and the simulator's 188B at PP=8 showed that guess short
    of its backward byte model by more than the excess leaves (195 step re-runs in 40
    steps); then the largest excess over each decision's own in-use,
    `over_decision_bytes`, as before. Never negative."""
    if not measured:
        return max(0, over_decision_bytes)
    return max(0, backward_peak_bytes - end_in_use_bytes)


def decision_inputs(state: WindowState, forecast: ToCome) -> Room:
    """Forward headroom and backward room of one decision (see the module doc)."""
    s = state
    num_routed, budget, in_use = s.num_routed, s.budget_bytes, s.in_use_bytes
    # Negative `reserve` when older resident micro-batches, in `in_use` now, are freed by
    # their own backward before this one's starts: this one's backward finds that room
    # free. (Held at 0, the last forward of stage 0 of PP=2 x EP=2 planned its backward
    # beside the whole first micro-batch: ~20 MiB of a 64.9 MiB budget, on `small`.)
    both = getattr(forecast, "to_come_and_reserve", None)   # Forecast's: one call for the two
    if both is not None:
        to_come, reserve = both(s.layer, s.layer_part_bytes, s.max_routed, s.min_bytes_per_token,
                                s.num_tokens or num_routed)
    else:
        args = (s.layer, s.layer_part_bytes, s.max_routed, s.min_bytes_per_token,
                s.num_tokens or num_routed)
        to_come, reserve = forecast.still_to_come(*args), forecast.backward_reserve(*args)
    headroom = (budget - in_use - to_come - num_routed * s.transient_bytes_per_routed
                - s.resident_backward_bytes - s.forward_extra_bytes)
    margin = s.layer_part_bytes if s.prefetch and not s.last_layer else 0
    backward_room = budget - in_use - margin - reserve - s.backward_extra_bytes
    # max(0, forward over, backward over) written out (ints: the same value)
    shortfall = s.layer_forward_peak_bytes - budget
    if s.layer_backward_peak_bytes:
        backward_over = s.layer_backward_peak_bytes + reserve - budget
        if backward_over > shortfall:
            shortfall = backward_over
    return Room(num_routed, headroom, s.evictable_bytes, backward_room, to_come, margin, reserve,
                shortfall if shortfall > 0 else 0)


@quick_init
@dataclass(frozen=True)
class EntryState:
    """What the window knows at a layer's entry, before its attention runs: no counts yet."""

    layer: int
    budget_bytes: int
    in_use_bytes: int
    num_tokens: int
    min_bytes_per_token: int
    seen: Seen
    resident_backward_bytes: int = 0   # as in WindowState
    forward_extra_bytes: int = 0       # as in WindowState
    # Under expert parallelism, where the dispatch exchange's rows are freed before the
    # decision (the built-in dispatcher): the rows sent, per token of the micro-batch,
    # alive during the layer's dispatch beside all it grew by up to its decision, and in
    # none of that growth. The rows received are not counted here: their number is known
    # only once the counts are exchanged, where the dispatch makes room for them exactly
    # (runtime/window.py `make_room_for_dispatch`). 0: no exchange (one process, the
    # simulator).
    sent_bytes_per_token: int = 0


def entry_estimate(state: EntryState) -> Optional[tuple[int, float]]:
    """(attention part bytes, routed copies) a layer is expected to bring, from what earlier
    layers measured; None before any layer measured its attention part."""
    seen, tokens = state.seen, state.num_tokens
    if seen.layer_bytes_per_token <= 0:
        return None
    return (int(seen.layer_bytes_per_token * tokens),
            max(seen.max_routed, seen.routed_per_token * tokens))


def entry_overflow(state: EntryState, forecast: ToCome) -> tuple[int, int]:
    """(overflow, own overflow) at a layer's entry with its expert path at the least the
    planner can keep: the bytes over budget with what is still to come in the micro-batch,
    and without it (what must leave the device before this layer's own forward can run);
    under expert parallelism each at least the dispatch's peak (EntryState's exchange rows).
    Not positive where it fits; (0, 0) before an attention part was measured."""
    # `entry_estimate` written out (the simulator's `1t` asks this 150k times a run)
    seen, tokens = state.seen, state.num_tokens
    if seen.layer_bytes_per_token <= 0:
        return 0, 0
    layer_part = int(seen.layer_bytes_per_token * tokens)
    routed = seen.routed_per_token * tokens
    if not routed > seen.max_routed:   # max(seen.max_routed, routed): the first of equals
        routed = seen.max_routed
    least = layer_part + state.min_bytes_per_token * routed
    to_come = forecast.still_to_come(state.layer, layer_part, routed, state.min_bytes_per_token,
                                     tokens)
    own = (state.in_use_bytes + least + state.resident_backward_bytes
           + state.forward_extra_bytes - state.budget_bytes)
    overflow = own + to_come
    rows = state.sent_bytes_per_token * state.num_tokens
    if rows:
        # The dispatch's peak as far as the entry knows it: the sent rows beside what the
        # layer grows by up to its decision, on top of all that is in use now. It is over
        # by the decision, before anything the rest of the micro-batch adds (`medium`,
        # EP=2, 0.7x, CPU, emulated device: without the exchange's rows the regrouping
        # copy ran out 1 MiB over a budget this check said had 6 MiB to spare). The
        # received rows were counted here too, at the most routed copies seen so far: more
        # than the dispatch needed (tests/runtime/test_runtime_entry_exchange.py).
        at_dispatch = state.in_use_bytes + layer_part + rows - state.budget_bytes
        own, overflow = max(own, at_dispatch), max(overflow, at_dispatch)
    return int(overflow), int(own)


def layer_cannot_fit(state: EntryState, forecast: ToCome) -> bool:
    """Would the layer overflow even with its expert path at the least the planner can
    keep, evicting nothing? Never before an attention part was measured."""
    return entry_overflow(state, forecast)[0] > 0


def _measure(reps: int = 300) -> None:
    """Times the window of one micro-batch of 8 layers x 64 experts: per layer the entry
    check, the inputs and the planner's decision (the ranking is refreshed per micro-batch,
    as the guard does), calm (everything saved fits) and tight (0.6x what saving everything
    needs: mixed plans, evictions on the last layers). A measurement, never asserted."""
    import statistics
    import time

    from spikeguard.plan.cost import CostModel
    from spikeguard.plan.forecast import Forecast
    from spikeguard.plan.planner import Planner

    layers, experts, tokens, top_k = 8, 64, 4096, 2
    shape = ExpertShape(d_model=256, d_expert=128)
    planner = Planner(shape, CostModel())
    forecast = Forecast(num_layers=layers, head_bytes_per_token=1564.0)
    tokens_per_expert_LE = [[tokens * top_k // experts] * experts for _ in range(layers)]
    attn_bytes_per_token = 2400
    layer_part = attn_bytes_per_token * tokens
    whole = layers * (layer_part + sum(shape.predict(tokens * top_k).values())) + 1564 * tokens
    print(f"window of {layers} layers x {experts} experts, N={tokens * top_k} per layer "
          f"(CPU, this machine; median of {reps} micro-batches):")
    for label, budget in (("calm", 4 * whole), ("tight (0.6x)", int(0.6 * whole))):
        for with_planner in (False, True):
            samples = []
            for _ in range(reps):
                planner.refresh()
                start = time.perf_counter()
                seen, in_use, plans = Seen(0, float(attn_bytes_per_token), float(top_k)), 0, set()
                for layer, tokens_per_expert_E in enumerate(tokens_per_expert_LE):
                    layer_cannot_fit(EntryState(layer, budget, in_use, tokens,
                                                planner.min_bytes_per_token, seen), forecast)
                    num_routed = sum(tokens_per_expert_E)
                    seen = seen.after(num_routed, layer_part, tokens)
                    room = decision_inputs(WindowState(
                        layer, budget, in_use + layer_part, num_routed, layer_part,
                        seen.max_routed, tokens, planner.min_bytes_per_token,
                        last_layer=layer == layers - 1, evictable_bytes=in_use), forecast)
                    if with_planner:
                        d = planner.decide(*room.planner_args())
                        in_use += layer_part + d.device_bytes - d.evict_bytes
                        plans.add(d.plan)
                    else:
                        in_use += layer_part
                samples.append((time.perf_counter() - start) * 1e6 / layers)
            what = "inputs + planner" if with_planner else "inputs only     "
            extra = f", {len(plans)} distinct plans" if with_planner else ""
            print(f"  {label:13s} {what} {statistics.median(samples):6.1f} us per decision "
                  f"(p90 {sorted(samples)[int(0.9 * reps)]:.1f}{extra})")


if __name__ == "__main__":
    _measure()
