"""What a pipeline schedule keeps resident on a stage: the guard's view of the warm-up.

With 1F1B, stage s of p runs p - s forwards before its first backward: during warm-up the
saved activations of several micro-batches sit on the device together, and a routing spike
in any of them lands on top of the others. The guard plans one micro-batch at a time; this
object tells it, at each decision, where that micro-batch stands in the schedule:

  * `resident`: micro-batches of this stage whose forward ran and whose backward has not
    (their bytes are already in the device's in-use figure);
  * `to_add`: forwards the schedule runs on this stage after this one and before the next
    backward of this stage frees anything. The forecast reserves one whole micro-batch,
    at the least it can keep, for each of them (plan/forecast.py, `reserve`);
  * `at_backward`: forwards that run after this one and before this micro-batch's own
    backward: they are resident when its offloaded tensors come back, so the planner's
    backward room is cut by as many whole micro-batches (`backward_reserve`), and grows
    by what the older resident ones hold (their backward runs first and frees it);
  * the older resident micro-batches run their backward while this one is resident, and
    their offloaded tensors come back then: the forward reserves the largest layer of
    them that is on the host (reloads come back a layer at a time). Their backward also
    makes every gradient of the stage, so by this one's backward they all exist
    (`grads_at_backward`), whichever of them are not allocated at its forward.

It is read from the schedule's own action list (`schedule.pipeline_order[rank]`, the IR
torch.distributed.pipelining builds, torch 2.13), by position, not by micro-batch number:
the k-th forward the guard sees in a step is the k-th forward action of its stage. (The
IR that torch 2.13 builds for Schedule1F1B numbers the last rank's micro-batches from 1;
the order of F and B actions, which is all that is used here, is right.)

    residency = use_schedule(guard, schedule, stage_index, pp_rank)   # runtime/pipeline_view.py
    with guard.step():
        residency.begin_step()
        schedule.step(...)
    residency.log   # one entry per (micro-batch, layer) decision of the step
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, NamedTuple, Optional, Sequence

FORWARD_KINDS = ("F",)
BACKWARD_KINDS = ("B", "I")  # a full backward, or the input half of a split one


@dataclass(frozen=True)
class SchedulePosition:
    forward: int          # this stage's k-th forward of the step
    phase: str            # "warmup" before this stage's first backward, then "steady"
    resident: int         # micro-batches resident before this forward
    to_add: int           # forwards after this one before the next backward
    at_backward: int      # forwards after this one before its own backward
    older: tuple          # the resident ones (forward ordinals), backward before this one


def positions(actions: Sequence, stage_index: int) -> list[SchedulePosition]:
    """One SchedulePosition per forward of `stage_index` in a rank's action list."""
    ops = [str(a.computation_type.value) for a in actions
           if a is not None and a.stage_index == stage_index]
    out: list[SchedulePosition] = []
    done_f = done_b = 0
    for i, kind in enumerate(ops):
        if kind in FORWARD_KINDS:
            to_add = at_backward = 0
            backwards_ahead = 0  # a stage's backwards run in forward order
            for later in ops[i + 1:]:
                if later in BACKWARD_KINDS:
                    backwards_ahead += 1
                    if done_b + backwards_ahead > done_f:
                        break
                elif later in FORWARD_KINDS:
                    to_add += backwards_ahead == 0
                    at_backward += 1
            out.append(SchedulePosition(done_f, "warmup" if done_b == 0 else "steady",
                                        done_f - done_b, to_add, at_backward,
                                        tuple(range(done_b, done_f))))
            done_f += 1
        elif kind in BACKWARD_KINDS:
            done_b += 1
    return out


def grads_at_backward(grads_by_layer: dict[int, int],
                      position: Optional[SchedulePosition]) -> dict[int, int]:
    """Layer -> gradient bytes not allocated now that will exist when this micro-batch's
    backward reaches that layer. Without an older resident micro-batch, those of the layer
    and the ones above (runtime/grads.py); with one, its backward runs first and makes all
    of them: every layer gets the largest figure. (Counted per layer instead, the second
    micro-batch's probes on stage 0 of PP=2 x EP=2 read the gradients the first one's
    backward had made, ~2 MiB, as working set: the slope rose by ~2 KB per routed copy.)"""
    if position is None or not position.older or not grads_by_layer:
        return grads_by_layer
    total = max(grads_by_layer.values())
    return {layer: total for layer in grads_by_layer}


class Reserve(NamedTuple):
    """What a pipeline stage reserves at one decision, for the other micro-batches."""

    forward_bytes: int    # the forwards the schedule runs here before the next backward
    backward_bytes: int   # what the others hold while this micro-batch's backward runs


def reserve_at(pos: SchedulePosition, whole_micro_batch_bytes: int, older_reload_bytes: int,
               older_device_bytes: int) -> Reserve:
    """`Residency.reserve`'s arithmetic, pure: one whole micro-batch for each forward still
    to come before the next backward, and the largest layer of the older resident
    micro-batches on the host (reloaded a layer at a time); beside this one's backward, the
    forwards that run before it, less what the older ones hold now (their backward frees
    it first). The simulator reads the older ones' bytes once per forward and calls this
    at each decision (sim/residents.py)."""
    return Reserve(pos.to_add * whole_micro_batch_bytes + older_reload_bytes,
                   pos.at_backward * whole_micro_batch_bytes - older_device_bytes)


@dataclass
class Residency:
    """The forecast's pipeline hook; `micro_batch()` says which forward the guard is in."""

    schedule_positions: list[SchedulePosition]
    micro_batch: Callable[[], int]
    # bytes on the host of (micro-batch, layer), from the guard's offload engine
    host_bytes: Callable[[], dict] = dict
    # bytes a micro-batch holds on the device now, from the guard's ledger
    device_bytes: Callable[[int], int] = lambda mb: 0
    enabled: bool = True
    log: list[dict] = field(default_factory=list)
    _seen: set = field(default_factory=set)

    def begin_step(self) -> None:
        self.log, self._seen = [], set()

    def position(self) -> Optional[SchedulePosition]:
        k = self.micro_batch()
        return self.schedule_positions[k] if 0 <= k < len(self.schedule_positions) else None

    def grads_at_backward(self, grads_by_layer: dict[int, int]) -> dict[int, int]:
        """`grads_at_backward` at this forward's position (unchanged when disabled)."""
        return grads_at_backward(grads_by_layer, self.position() if self.enabled else None)

    def reserve(self, layer: int, whole_micro_batch_bytes: int) -> Reserve:
        """Bytes to reserve at this decision: for the forwards still to come before the
        next backward, and beside this micro-batch's backward. Changes nothing but the log,
        which gets the first consultation of each (micro-batch, layer)."""
        pos = self.position()
        if pos is None or not self.enabled:
            return Reserve(0, 0)
        older = set(pos.older)
        reload = max((n for (mb, _), n in self.host_bytes().items() if mb in older), default=0)
        reserved, backward = reserve_at(pos, whole_micro_batch_bytes, reload,
                                        sum(self.device_bytes(mb) for mb in older))
        key = (pos.forward, layer)
        if key not in self._seen:
            self._seen.add(key)
            self.log.append({"micro_batch": pos.forward, "layer": layer, "phase": pos.phase,
                             "resident": pos.resident, "to_add": pos.to_add,
                             "at_backward": pos.at_backward, "reserved_bytes": reserved,
                             "older_reload_bytes": reload,
                             "backward_reserved_bytes": backward})
        return Reserve(reserved, backward)

    # ---- the forwards to come (the hookless proof, runtime/hookless.py) --------------
    def later_forwards(self) -> Optional[tuple[int, ...]]:
        """The forwards this stage runs after this one and before this one's backward:
        this micro-batch is among their older residents, so their decisions may evict it.
        None where the position is unknown; none when disabled (nothing is evicted then)."""
        pos = self.position()
        if pos is None:
            return None
        if not self.enabled:
            return ()
        return tuple(range(pos.forward + 1, pos.forward + 1 + pos.at_backward))

    def freed_before(self, forward: int) -> tuple[int, ...]:
        """The micro-batches resident now whose backward runs before forward `forward`."""
        now = self.position()
        return tuple(sorted(set(now.older) - set(self.schedule_positions[forward].older)))

    def at_forward(self, forward: int, held: Optional[dict[int, int]] = None) -> "Residency":
        """This residency as forward `forward` will read it, reading today's figures (the
        older ones' bytes now, on the device and the host; `held`: micro-batch -> the
        bytes it will hold then, in place of its figure now), with a log of its own."""
        device_bytes = self.device_bytes
        if held:
            device_bytes = lambda mb: held[mb] if mb in held else self.device_bytes(mb)
        return replace(self, micro_batch=lambda: forward, device_bytes=device_bytes, log=[],
                       _seen=set())

    # ---- eviction of resident micro-batches ----------------------------------------
    def _evict_order(self) -> list[int]:
        """Older resident micro-batches, the one whose backward comes last first."""
        pos = self.position()
        return sorted(pos.older, reverse=True) if pos is not None and self.enabled else []

    def evictable(self, tracker) -> int:
        """Bytes of the older resident micro-batches' saved tensors that could go to host."""
        return sum(tracker.evictable(mb, ALL_LAYERS) for mb in self._evict_order())

    def evict(self, tracker, num_bytes: int) -> int:
        """Offload older resident micro-batches' saved tensors (earliest layer first, the
        newest micro-batch first) until `num_bytes` are freed; they come back when their
        backward unpacks them, counted by the reload reservation above."""
        freed = 0
        for mb in self._evict_order():
            if freed >= num_bytes:
                break
            freed += tracker.evict(mb, ALL_LAYERS, num_bytes - freed)
        if freed and self.log:
            self.log[-1]["evicted_resident_bytes"] = self.log[-1].get(
                "evicted_resident_bytes", 0) + freed
        return freed


ALL_LAYERS = 1 << 30  # tracker.evict/evictable take layers below this: every layer


def schedule_residency(schedule, stage_index: int, pp_rank: int, *,
                       micro_batch: Callable[[], int], host_bytes: Callable[[], dict],
                       device_bytes: Callable[[int], int], enabled: bool = True) -> Residency:
    """The schedule's residency for `stage_index` (on `pp_rank`), reading the guard's
    figures through the three callables (spikeguard.runtime.pipeline_view gives them)."""
    order = getattr(schedule, "pipeline_order", None)
    if not order or pp_rank not in order:
        raise ValueError(f"{type(schedule).__name__} exposes no pipeline_order for rank "
                         f"{pp_rank}: its residency cannot be read")
    return Residency(positions(order[pp_rank], stage_index), micro_batch=micro_batch,
                     host_bytes=host_bytes, device_bytes=device_bytes, enabled=enabled)
