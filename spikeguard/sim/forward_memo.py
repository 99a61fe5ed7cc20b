"""A stage's forwards, remembered: the memo key of an adaptive forward and what it reads.

Mixed into sim/walk.py's StageWalker, whose `policy`, `chunks`, `positions`, `dm`, `_memo`,
`_statics`, `_grads`, `_next`, `_memory_ids` and `initial_state` it reads. Decisions are
pure functions of (chunk, loads, bytes in use, gradients still to come, the schedule
position, what older resident micro-batches hold, the guard's memory), so one forward is
memoised on that key (of the older ones' bytes, the sums it reads).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

from spikeguard.plan.residency import grads_at_backward
from spikeguard.sim.chunk import Forward, Memory
from spikeguard.sim.residents import residency as _residency
from spikeguard.sim.residents import spread as _spread


class ForwardMemo:
    """The walker's `forward` (a static policy's, per chunk ends and counts; adaptive's, on
    the memo key), the gradients each layer's backward finds, and the guard's memory as
    the next micro-batch starts."""

    _last_next: tuple = (None, None)   # _next_micro_batch's last (memory, answer)

    def forward(self, chunk: int, counts: tuple[int, ...], in_use: int, k: int = 0,
                host: dict | None = None, device: dict | None = None,
                memory: Optional[Memory] = None, grads_to_come: int = 0,
                resident_backward: int = 0, evictable: dict | None = None,
                grads: Optional[tuple] = None, reload: Optional[int] = None) -> Forward:
        """The k-th forward of the stage. Adaptive decisions depend on the bytes in use,
        the gradients still to come, the guard's memory and, through the residency
        forecast, on the schedule position and what the older resident micro-batches hold
        on the device and host: all of it is the memo key. Of the older ones' bytes the
        decisions read sums only (the reserve their device bytes and their largest host
        layer, the evictor their evictable total: plan/residency.py); which of them an
        eviction takes is the one thing their split decides, and it is spread again over
        this forward's split (sim/residents.py `spread`)."""
        if self.policy != "adaptive":
            # the same on every stage whose chunk has the same ends (sim/chunk.py `static`)
            key = (self.policy, self.first_chunk(chunk), self.last_chunk(chunk), counts)
            hit = self._statics.get(key)
            if hit is None:
                hit = self._statics[key] = self.chunks.static(chunk, counts)
            return hit
        host, device, evictable = host or {}, device or {}, evictable or {}
        memory, memory_id = self._next_micro_batch(memory or self.initial_state().memory)
        pos = self.positions[k]
        older = pos.older
        if reload is None:   # the largest layer of the older ones on host (the walk's own)
            reload = max([n for (o, _), n in host.items() if o in older], default=0)
        grads = grads or self.grads_by_layer(len(counts), k, grads_to_come)
        try:   # the walk's older ones are all live: two C-level sums (a KeyError else)
            older_device = sum(map(device.__getitem__, older))
            older_evictable = sum(map(evictable.__getitem__, older))
        except KeyError:
            older_device = sum([device.get(o, 0) for o in older])
            older_evictable = sum([evictable.get(o, 0) for o in older])
        key = (chunk, counts, in_use, grads, resident_backward, pos.to_add,
               pos.at_backward, reload, older_device, older_evictable, memory_id)
        hit = self._memo.get(key)
        if hit is None:
            residency = _residency(self.positions, k, host, device, (reload, older_device))
            hit = self._memo[key] = self.chunks.adaptive(chunk, counts, in_use, residency,
                                                         evictable, memory, grads,
                                                         resident_backward)
        elif hit.resident_evictions:
            taken = _spread(hit.resident_freed, [evictable.get(o, 0) for o in reversed(older)])
            if taken != hit.resident_evictions:
                hit = replace(hit, resident_evictions=taken)
        return hit

    def grads_by_layer(self, num_layers: int, k: int, grads_to_come: int) -> tuple:
        """Layer of the chunk -> gradient bytes not allocated yet that exist by the k-th
        forward's backward there, as the runtime's guard counts them (runtime/grads.py:
        the layer's own and those above; plan/residency.py, grads_at_backward: all of
        them when an older resident micro-batch's backward runs first)."""
        key = (num_layers, k, grads_to_come)
        hit = self._grads.get(key)
        if hit is None:
            lg = self.dm.layer_grad_bytes
            by_layer = {i: max(0, grads_to_come - i * lg) if grads_to_come else 0
                        for i in range(num_layers)}
            pos = self.positions[k] if k < len(self.positions) else None
            by_layer = grads_at_backward(by_layer, pos)
            hit = self._grads[key] = tuple(by_layer[i] for i in range(num_layers))
        return hit

    def _next_micro_batch(self, memory: Memory) -> tuple[Memory, int]:
        """The guard's memory as the next micro-batch starts (`Seen.next_micro_batch`),
        and a number that stands for its value in the forwards' memo key (equal memories,
        equal numbers): remembered per room object and the figures the next memory has
        besides (max_routed reset), since hashing a memory is hashing its slopes and
        window state, and each computed forward hands on a new Memory with the same room
        (one in three forwards of `1t`'s adaptive walk missed when this was per object)."""
        last = self._last_next   # the same memory as the forward before (a memoised one)
        if last[0] is memory:
            return last[1]
        seen = memory.seen
        key = (id(memory.room), seen.layer_bytes_per_token, seen.routed_per_token,
               memory.head_per_token)
        hit = self._next.get(key)
        if hit is None or hit[0] is not memory.room:
            if len(self._next) >= 1 << 12:
                self._next.clear()
            after = replace(memory, seen=seen.next_micro_batch())
            number = self._memory_ids.setdefault(after, len(self._memory_ids))
            hit = self._next[key] = (memory.room, after, number)
        self._last_next = (memory, (hit[1], hit[2]))
        return hit[1], hit[2]
