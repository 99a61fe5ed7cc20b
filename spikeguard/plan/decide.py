"""The decision procedure of one layer: written once, called by every part that decides.

The runtime's decision window (spikeguard/runtime/window.py), its hookless proof
(spikeguard/runtime/hookless.py) and the simulator's chunk walk (spikeguard/sim/chunk.py)
each collect their numbers (the device's in-use, the layer's measured attention part, its
routed count) and call these functions; none of them repeats the steps:

    at a layer's entry   entry_fallback: would even its least plan overflow? then the
                         layers below make room where that costs less than its
                         recompute; else it is recomputed whole, and room is made now for
                         its whole backward
    after routing        decide_layer: window state -> planner inputs (plan/room.py) ->
                         evict first if the layer's own peaks do not fit -> the planner's
                         least-cost plan -> evict what that plan still needs
    hookless proof       fits_unaided: would a later layer decide with no eviction and no
                         whole-layer fallback?

Nothing here holds a tensor, a guard or a ledger. The two collaborators with state are
passed in as protocols: the layer slopes (plan/layer_room.py `LayerRoom`) and an evictor,
which the runtime's saved-tensor tracker and the simulator's layers both implement.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

from spikeguard.plan.planner import Decision, Planner
from spikeguard.plan.frozen import quick_init
from spikeguard.plan.room import (EntryState, ToCome, WindowState, decision_inputs,
                                  entry_estimate, entry_overflow, layer_cannot_fit)


class Evictor(Protocol):
    """Earlier layers' saved tensors (and, in a pipeline, older resident micro-batches')
    that can move to host memory."""

    def evictable(self) -> int:
        """Bytes that could leave the device now."""
        ...

    def evict(self, num_bytes: int) -> int:
        """Move at least `num_bytes` (as far as there are) to host; the device bytes freed."""
        ...


class Slopes(Protocol):
    """The layer's own forward and backward peaks (plan/layer_room.py `LayerRoom`);
    `fixed`: bytes beside the layer's own that the byte model has apart (FSDP2's,
    plan/fsdp_bytes.py)."""

    def needs(self, in_use: int, num_routed: int, grads_to_come: int,
              layer_part: int = 0, fixed: tuple[int, int] = (0, 0)) -> tuple[int, int]: ...

    def whole_backward(self, entry_in_use: int, layer_part: int, num_routed: int,
                       grads_to_come: int, fixed: tuple[int, int] = (0, 0)) -> int: ...


# Called with (a predicted backward peak of the layer, the in-use it was predicted at):
# the caller keeps the largest, for the pipeline's resident-backward reserve.
NoteBackward = Callable[[int, int], None]


def _ignore(backward_peak: int, in_use: int) -> None:
    return None


@dataclass(frozen=True)
class LayerFacts:
    """What the caller knows of a layer right after routing, the device's in-use aside
    (it changes as the procedure evicts)."""

    layer: int
    budget_bytes: int
    num_routed: int            # routed copies this layer's local experts received
    layer_part_bytes: int      # its attention + router part, measured
    max_routed: int            # largest routed count of this micro-batch, this one included
    num_tokens: int
    min_bytes_per_token: int   # Planner.min_bytes_per_token
    grads_to_come: int         # gradient bytes this layer's backward will allocate
    transient_bytes_per_routed: int = 0
    prefetch: bool = False
    last_layer: bool = False
    resident_backward_bytes: int = 0
    # FSDP2 (plan/fsdp_bytes.py; 0 without it): what its units add by the forward's last
    # backward peak, beside this layer's reloads, and beside its backward (`needs`'s fixed)
    forward_extra_bytes: int = 0
    backward_extra_bytes: int = 0
    fixed_backward: tuple[int, int] = (0, 0)


def window_state(facts: LayerFacts, in_use: int, evictable: int, slopes: Slopes) -> WindowState:
    """The one constructor of a decision's WindowState: the layer's own peaks at `in_use`."""
    forward_peak, backward_peak = slopes.needs(in_use, facts.num_routed, facts.grads_to_come,
                                               facts.layer_part_bytes, facts.fixed_backward)
    # positional, in WindowState's field order (17 keywords cost a third of the call)
    f = facts
    return WindowState(f.layer, f.budget_bytes, in_use, f.num_routed, f.layer_part_bytes,
                       f.max_routed, f.num_tokens, f.min_bytes_per_token,
                       f.transient_bytes_per_routed, f.prefetch, f.last_layer, evictable,
                       f.backward_extra_bytes, f.forward_extra_bytes, forward_peak,
                       backward_peak, f.resident_backward_bytes)


@quick_init
@dataclass(frozen=True)
class LayerDecision:
    decision: Decision
    in_use_bytes: int          # the device after the evictions


def decide_layer(facts: LayerFacts, in_use: int, slopes: Slopes, forecast: ToCome,
                 planner: Planner, evictor: Evictor,
                 note_backward: NoteBackward = _ignore) -> LayerDecision:
    """The layer's plan at the least added time that fits (raises BudgetInfeasible, from
    the planner, when nothing does even after evicting everything evictable)."""
    state = window_state(facts, in_use, evictor.evictable(), slopes)
    note_backward(state.layer_backward_peak_bytes, in_use)
    room = decision_inputs(state, forecast)
    if room.layer_shortfall_bytes > 0:
        # The layer's own peaks do not fit beside the layers below, whatever its plan:
        # move bytes of those to host first, then decide on what is left.
        in_use -= evictor.evict(room.layer_shortfall_bytes)
        state = window_state(facts, in_use, evictor.evictable(), slopes)
        note_backward(state.layer_backward_peak_bytes, in_use)
        room = decision_inputs(state, forecast)
    # What only the rest of the micro-batch needs is left to its later layers to move, as
    # far as they will be able to (the parts they and this layer leave): evicted lazily,
    # it is evicted only if the rest of the micro-batch really comes to need it.
    later = forecast.later_evictable(facts.layer, facts.layer_part_bytes,
                                     facts.min_bytes_per_token * facts.num_routed)
    to_come = room.to_come_bytes
    # room.planner_args(), and min(to_come, later), written out
    decision = planner.decide(room.num_routed, room.headroom_bytes, room.evictable_bytes,
                              room.backward_room_bytes,
                              deferrable_bytes=later if later < to_come else to_come)
    if decision.evict_bytes:
        in_use -= evictor.evict(decision.evict_bytes)
    return LayerDecision(decision, in_use)


def entry_fallback(entry: EntryState, forecast: ToCome, slopes: Slopes, grads_to_come: int,
                   evictor: Evictor, planner: Planner, note_backward: NoteBackward = _ignore,
                   fixed_backward: tuple[int, int] = (0, 0)) -> bool:
    """Before a layer's forward: would it overflow even with its expert path at the least
    the planner can keep? Where the layers below can give the bytes for less than the
    layer's recompute would cost, they do (what its own forward needs, now; the rest as
    later layers come) and it runs planned (False). Else it is recomputed whole (True)
    rather than discovered mid-layer; recomputed whole it still comes back whole in its
    backward, with its gradients, beside what the layers below keep: that is made to fit
    now, by eviction."""
    overflow, own = entry_overflow(entry, forecast)
    if overflow <= 0:
        return False
    part, routed = entry_estimate(entry)
    if _evicting_pays(entry, overflow, own, part, int(routed), forecast, evictor, planner):
        if own > 0:
            evictor.evict(own)
        return False
    backward = slopes.whole_backward(entry.in_use_bytes, part, int(routed), grads_to_come,
                                     fixed_backward)
    note_backward(backward, entry.in_use_bytes)
    short = backward + entry.resident_backward_bytes - entry.budget_bytes
    if short > 0:
        evictor.evict(short)
    return True


def _evicting_pays(entry: EntryState, overflow: int, own: int, part: int, routed: int,
                   forecast: ToCome, evictor: Evictor, planner: Planner) -> bool:
    """Can the layers below give a layer's overflow, evicting lazily, for less than its
    recompute? Its own forward's part must be evictable now; the rest by the time it is
    needed (what is evictable now, and the attention parts this layer and the later ones
    leave). Recomputed whole, a layer frees about what its least plan keeps, for at least
    its expert path's forward again: that many bytes' round trip is the price to beat."""
    evictable = evictor.evictable()
    later = forecast.later_evictable(entry.layer, part, entry.min_bytes_per_token * routed)
    if own > evictable or overflow > evictable + later:
        return False
    freed_by_recompute = part + entry.min_bytes_per_token * routed
    return (planner.cost.offload_s_for_bytes(min(overflow, freed_by_recompute))
            <= planner.whole_recompute_s(routed))


def fits_unaided(entry: EntryState, facts: LayerFacts, in_use: int, slopes: Slopes,
                 forecast: ToCome, planner: Planner) -> bool:
    """Would the layer (at `entry` before its attention, `in_use` after it) decide with no
    whole-layer fallback, no eviction first and some plan of the menu fitting as it is?
    The hookless proof asks this of every later layer, on a prediction."""
    if layer_cannot_fit(entry, forecast):
        return False
    room = decision_inputs(window_state(facts, in_use, 0, slopes), forecast)
    if room.layer_shortfall_bytes:
        return False
    return planner.fits(room.num_routed, room.headroom_bytes, room.backward_room_bytes)
