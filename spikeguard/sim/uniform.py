"""A static policy's walk of one stage under one load, as a cumulative sum (numpy).

Under a static policy every chunk's forward is the same whatever is in use, and under
one load (an int: every micro-batch and layer) the stage's step is the schedule's running
sum of what each forward adds and each backward frees, with each op's own peak on top.
sim/walk.py's `StageWalker.walk` calls this for such walks; the walker supplies the
forwards (memoised), the schedule and the static bytes.
"""

from __future__ import annotations

from collections import Counter

from spikeguard.extras import require

np = require("numpy", "sim", "spikeguard simulate")   # the `sim` extra


def walk_uniform_static(walker, count: int, state) -> tuple[int, float, bool, Counter]:
    """(peak bytes, busy seconds, crashed, decisions) of `walker`'s stage under `count`
    routed copies in every layer, from `state` (a StepState)."""
    w = walker
    st, lazy = w.stage, w.dm.lazy_state
    fwds = [w.forward(c, (count,) * len(chunk), 0, 0) for c, chunk in enumerate(st.chunks)]
    kept = np.array([f.kept for f in fwds], dtype=np.int64)[w.chunk_of]
    fwd_over = np.array([f.peak for f in fwds], dtype=np.int64)[w.chunk_of]
    bwd_over = np.array([f.bwd for f in fwds], dtype=np.int64)[w.chunk_of]
    secs = np.array([f.seconds for f in fwds])[w.chunk_of] * w.is_forward
    delta = np.where(w.is_forward, kept, -kept)
    over = np.where(w.is_forward, fwd_over, bwd_over)
    static = w.static_bytes(state)
    first_backward, forwards_of, backward_zero = w.uniform_schedule
    if lazy:   # each chunk's first backward makes its gradients
        for c, f in enumerate(fwds):
            if first_backward[c] is not None:
                over[first_backward[c]] = f.bwd_first
                delta[first_backward[c]] += st.chunk_grad_bytes[c]
    if backward_zero is not None:
        delta[backward_zero] += w.lingering()
    before = static + np.concatenate(([0], np.cumsum(delta)[:-1]))
    tops = before + over
    decisions: Counter = Counter()
    for c, f in enumerate(fwds):
        decisions.update({k: v * forwards_of[c] for k, v in f.decisions.items()})
    bad = np.flatnonzero(tops > w.capacity)
    if bad.size:
        end = bad[0] + 1
        return int(max(static, tops[:end].max())), float(secs[:end].sum()), True, decisions
    return int(max(static, tops.max())), float(secs.sum()), False, decisions


def schedule_facts(is_forward, chunk_of, num_chunks: int) -> tuple:
    """What `walk_uniform_static` reads of a stage's schedule, found once per walker (a
    1,000-step run walks each stage under each load and static policy): per chunk the
    index of its first backward (None: none) and its number of forwards, and the index of
    the stage's first backward (None: none)."""
    first, forwards = [], []
    for c in range(num_chunks):
        found = np.flatnonzero(~is_forward & (chunk_of == c))
        first.append(found[0] if found.size else None)
        forwards.append(int(np.sum(is_forward & (chunk_of == c))))
    backwards = np.flatnonzero(~is_forward)
    return tuple(first), tuple(forwards), backwards[0] if backwards.size else None
