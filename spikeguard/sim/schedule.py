"""Pipeline schedules as each stage sees them: the order of its forwards and backwards.

M = micro-batches per step, pp = stages, v = virtual chunks per stage (interleaved).

1F1B: stage s runs min(pp - s - 1, M) warm-up forwards, then alternates one forward and
one backward, then drains. Interleaved (Megatron's order, M a multiple of pp): the k-th
forward of a stage is chunk (k // pp) % v of micro-batch (k // (pp*v))*pp + k % pp; the
k-th backward is chunk v-1-((k // pp) % v) of the same; warm-up is (pp - s - 1)*2 +
(v - 1)*pp forwards. Each forward also carries `to_add`: the forwards this stage runs after
it and before its next backward, which is what the runtime's residency forecast reserves
(spikeguard/plan/residency.py, read there from torch's own schedule IR).
The bubble of a step is (pp - 1)/v micro-batch times (each stage idles that long).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass


@dataclass(frozen=True)
class Op:
    kind: str        # "F" or "B"
    micro_batch: int
    chunk: int       # virtual chunk on this stage (0 under 1F1B)
    to_add: int = 0  # forwards only: later forwards before the next backward


def stage_ops(stage: int, pp: int, micro_batches: int, virtual: int = 1) -> list[Op]:
    """The ordered forwards and backwards of one stage in one step (a fresh list; the
    order itself is worked out once per arguments: every policy's walker asks)."""
    return list(_stage_ops(stage, pp, micro_batches, virtual))


@functools.lru_cache(maxsize=256)
def _stage_ops(stage: int, pp: int, micro_batches: int, virtual: int) -> tuple[Op, ...]:
    total = micro_batches * virtual
    if virtual == 1:
        warm = min(pp - stage - 1, micro_batches)
        fwd = [(k, 0) for k in range(total)]
        bwd = fwd
    else:
        warm = min((pp - stage - 1) * 2 + (virtual - 1) * pp, total)
        fwd = [((k // (pp * virtual)) * pp + k % pp, (k // pp) % virtual) for k in range(total)]
        bwd = [((k // (pp * virtual)) * pp + k % pp, virtual - 1 - (k // pp) % virtual)
               for k in range(total)]
    kinds = ["F"] * warm
    for _ in range(total - warm):
        kinds += ["F", "B"]
    kinds += ["B"] * warm
    ops, f, b = [], 0, 0
    for kind in kinds:
        if kind == "F":
            ops.append(("F",) + fwd[f])
            f += 1
        else:
            ops.append(("B",) + bwd[b])
            b += 1
    out = []
    for i, (kind, mb, chunk) in enumerate(ops):
        to_add = 0
        if kind == "F":
            for later in ops[i + 1:]:
                if later[0] == "B":
                    break
                to_add += 1
        out.append(Op(kind, mb, chunk, to_add))
    return tuple(out)


def max_in_flight(ops: list[Op]) -> int:
    """Most micro-batch chunks whose forward ran and backward has not, at once."""
    live = most = 0
    for op in ops:
        live += 1 if op.kind == "F" else -1
        most = max(most, live)
    return most


def bubble_micro_batches(pp: int, virtual: int) -> float:
    return (pp - 1) / virtual
