"""Collectives that return once a CPU backend has let go of the tensors it was handed.

gloo's work item holds a collective's tensors until its worker thread drops the item,
which is after the wait has returned: a tensor nothing else holds (a flag point's row, a
zero buffer of a settlement or a replay, transformers' expert output at its combine) is
then freed on that thread whenever it next runs, while the step goes on allocating, and
a step's peak moves with the same data (found by counting the frees made off the main
thread, tiny Qwen3-MoE under transformers' EP=2, gloo, torch 2.13: the flag point's
64 + 128 bytes moved both ranks' metered peak by 192 B and the budget derived from it;
the combine's 33 KB expert output and its received rows were freed on gloo's threads
while the peak rose). The backend is handed views (a storage reference each, its own),
and the caller waits until each storage's use count says the views are gone, so the
tensors are freed where the program drops them, on its own thread:

    views, marks = handed([out, mine])
    dist.all_gather_single(*views)
    del views
    let_go(marks)

A functional collective's output, which the work item keeps after the input, is waited
for by its own use count (`waited`); an in-place collective on a tensor the caller drops
next goes through `reduced`.

CPU tensors only (gloo, measured); a GPU tensor gets no mark and no wait.
"""

from __future__ import annotations

import time

import torch
from torch.utils._pytree import tree_leaves, tree_map_only

SETTLE_S = 10.0   # a backend that keeps its tensors longer: the caller goes on, as before


def use_count(storage) -> int:
    return torch._C._storage_Use_Count(storage._cdata)


def handed(value):
    """`value` (a tensor or a tree of them) with each tensor replaced by a view of it, to
    hand a backend, and the marks `let_go` waits on (one per CPU storage)."""
    bases = [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]
    views = tree_map_only(torch.Tensor, lambda t: t.view(t.shape), value)
    storages = {}
    for t in bases:
        if t.device.type == "cpu":
            storage = t.untyped_storage()
            storages[storage._cdata] = storage
    # Counted with the views alive: each view holds one reference, the backend's own.
    return views, [(s, use_count(s)) for s in storages.values()]


def let_go(marks: list, settle_s: float = SETTLE_S) -> None:
    """Wait until every marked storage lost a reference (its view, dropped by the caller,
    and then by the backend); at most `settle_s` seconds. A collective that held none
    (a recompute replaying a cached exchange) returns at once."""
    deadline = time.monotonic() + settle_s
    for storage, held in marks:
        while use_count(storage) >= held:
            if time.monotonic() > deadline:
                return
            time.sleep(0)


def reduced(collective, tensor: torch.Tensor, **kwargs) -> None:
    """`collective(tensor, **kwargs)`, an in-place one (an all-reduce), handed a view of
    `tensor` and returning once the backend has let go of it: a small tensor the caller
    drops next (a mask, a norm's part) is freed on the caller's thread, not gloo's."""
    views, marks = handed(tensor)
    collective(views, **kwargs)
    del views
    let_go(marks)


def waited(out: torch.Tensor, settle_s: float = SETTLE_S) -> torch.Tensor:
    """A functional collective's output (`torch.ops._c10d_functional`), waited, returned
    once the backend's work item holds none of it. gloo's work item keeps the output it
    made (three references once complete, torch 2.13) and drops them on its worker thread
    after the wait returns, and after the input handed it (which `let_go` watches): an
    output the caller dropped meanwhile was freed on that thread (the built-in
    dispatcher's rows, 1.9-2.6 MB on `small` at EP=2, in one run of three of 2 steps;
    CPU, gloo), and the device's count at a later layer's entry held them or not with the
    same data: rank 1 asked room there in one CI run of several
    (tests/runtime/test_runtime_entry_exchange.py). The output's own use count says when:
    the caller holds one reference (the returned tensor; a checkpoint policy caches a
    detached alias, another tensor, and a replayed cache entry was never the backend's),
    the backend the rest. A rarer late free is left, about 1 in 1,000 collectives, of an
    output already the caller's alone here (tests/parallel/test_parallel_ep_release.py).
    Waited at most `settle_s` seconds, as `let_go`; the caller must hold no other
    reference to `out` (a view made before this call). CPU tensors only: NCCL's watchdog
    keeps a work item's outputs until it polls, and a GPU allocator does not free on the
    backend's threads (no wait there)."""
    out = torch.ops._c10d_functional.wait_tensor(out)
    if out.device.type != "cpu":
        return out
    deadline = time.monotonic() + settle_s
    while out._use_count() > 1:
        if time.monotonic() > deadline:
            break
        time.sleep(0)
    return out


def exchange(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group_name: str,
             settle_s: float = SETTLE_S) -> torch.Tensor:
    """`all_to_all_single` and its wait as the raw functional ops (not
    `_functional_collectives.all_to_all_single`, which wraps its output in an
    AsyncCollectiveTensor in eager mode; these are the very ops the checkpoint policies
    name), returning once the backend has let go of `x`.

    gloo's work item holds the input until its worker thread drops it, which is after the
    wait has returned: an input nothing else holds (the backward's) was freed on that
    thread whenever it next ran, while this one went on allocating. On the emulated device
    a step's peak then moved from step to step with the same data and plans, by up to one
    exchange's rows (`medium`, EP=2, static policy `full`: 0 or +3.3-3.5 MB in a backward,
    at a layer that changed; 30 frees a step on another thread). The work item is handed a
    view of `x` (a storage reference of its own), and the exchange waits until the
    storage's count says the view is gone, so `x` is freed where the program drops it, on
    this thread. The output, which the work item holds longer than the input, is
    returned once it is the caller's alone (`waited`). A recompute that replays the
    cached exchange (the checkpoint policies) holds no work item: the counts are back at
    once. CPU tensors only (gloo, measured). The built-in dispatcher's exchanges both ways
    (expert_parallel `_Exchange`), its journal's flag point and zero rows
    (exchange_journal.py) and transformers' settlement rows (family_journal.py) are this
    one call."""
    views, marks = handed(x)
    out = torch.ops._c10d_functional.all_to_all_single(views, out_splits, in_splits, group_name)
    del views
    out = waited(out, settle_s)
    let_go(marks, settle_s)
    return out


def released(call, rows, *rest):
    """`call(rows, *rest)`, a call that issues one collective on `rows` (transformers'
    combine, torchtitan's token exchanges), handed a view of `rows` and returning once the
    backend has let go of it. gloo's work item holds its input and output until its worker
    thread drops the item, after the wait: `rows` and the rows received, which nothing else
    may hold, were freed on that thread while the step went on (transformers' combine: its
    33 KB expert output and received rows, tiny Qwen3-MoE, at a peak that rose meanwhile;
    torchtitan's deepseek_v3 at EP=2, 8 x 128 tokens: 2.9-3.6 MB still on the device at a
    layer's decision in one forward of about four, so the hookless proof's walk, which takes
    the most growth it saw, proved 1 layer of 3 on rank 0 and no calm forward). An output
    returned unwaited (torch's AsyncCollectiveTensor, the functional all-to-all's) is waited
    here (its own `trigger_wait`: the wait its first use would make, sooner; the autograd
    graph unchanged). CPU tensors only: anything else is called as it is."""
    if type(rows) is not torch.Tensor or rows.device.type != "cpu" or not rows.is_contiguous():
        return call(rows, *rest)   # a copy would be handed: nothing to watch
    view, marks = handed(rows)
    out = call(view, *rest)
    del view
    wait = getattr(out, "trigger_wait", None)
    if callable(wait):
        wait()
    let_go(marks)
    return out
