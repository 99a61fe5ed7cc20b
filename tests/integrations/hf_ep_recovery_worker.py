"""One torchrun rank of the transformers-EP recovery checks (test_integrations_hf_ep_recovery.py).

    .venv/bin/python -m torch.distributed.run --nproc-per-node 2 \
        tests/integrations/hf_ep_recovery_worker.py OUT_DIR CHECK

The model and data of hf_ep_worker.py (a tiny Qwen3-MoE under `DistributedConfig(fsdp_size=2,
ep_size=2)`, 2 layers). Rank 1's device is asked, once, for an allocation no plan foresees
(the whole budget) at layer 1, after layer 0's exchanges: the device refuses it at once,
as CUDA's allocator does. CHECK says where:

  window     inside layer 1's experts call (its counts and rows exchanged, not its combine)
  attention  in layer 1's attention (its vote made, none of its exchanges)
  attention_skipped, window_skipped  as attention and window, in the step after a calm
             one, where every rank promised at layer 0's vote (runtime/window.py
             `promise`) and layer 1 casts none: the refused rank settles as where no vote
             is to come (its dispatch and combine with zeros)
  dispatch   inside transformers' dispatch of layer 1, before its counts exchange
  combine    inside transformers' combine of layer 1, right after its all-to-all (where
             `empty_like(recv_out)` or the weighted sum is refused; the peer then goes
             on to its next flag point: a combine made again hung the job in gloo)
  combine_output  inside that combine, at its all-to-all's output (not issued: the peer
             waits in it)
  backward   in layer 1's backward, in the first step (no earlier backward recorded: the
             rest of its collectives is not known, every rank ends in one agreed line)
  later_backward_L  in layer L's backward (1: the last layer, whose backward runs first;
             0: after layer 1's collectives), in the first micro-batch of the step after a
             calm one: the refused rank replays the rest of its backward's collectives
             with zeros (spikeguard.parallel.family_backward) and every rank re-runs the step
  later_backward_mb1  the same at layer 0 of the second micro-batch (the step's end next)
  later_backward_whole0  the same at layer 0, with layer 1 recomputed whole in both steps
             (adaptive's whole-layer fallback, forced on rank 1, agreed by both): its
             backward re-ran transformers' counts exchange before the refusal; re-run
  later_backward_whole1  the same at layer 1, before that recompute: the peer's recompute
             would route on zeros, so no replay: every rank ends in one agreed line
  steady_backward_L  later_backward_L after three calm steps: each micro-batch's span seen
             twice alike (steps 1 and 2), steps 3 and 4 push no recording mode (the ops
             its `__torch_dispatch__` saw are counted per step, and in step 4 up to the
             refusal); the refusal is placed by the groups' sequence numbers alone

Each writes OUT_DIR/<check>_rank<r>.json: gradients against the uninterrupted layout's,
the step record, the independent meter's peak; or, where the job ends, the agreed line.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hf_ep_worker import batches, build, differ, record, run, world_max  # noqa: E402
from host_marks import metered  # noqa: E402

import spikeguard  # noqa: E402
from spikeguard.parallel import family_backward  # noqa: E402
from spikeguard.parallel.launch import watch_parent  # noqa: E402
from spikeguard.runtime.agreement import JobEnds  # noqa: E402

HUGE = 1 << 40
GROUP_TIMEOUT_S = 60   # a whole check takes a few seconds on 2 loaded cores
REFUSING_RANK, LAYER = 1, 1


def refuse_once(budget: int, skip: int = 0):
    """A callable that, the first time on the refusing rank after `skip` calls, asks the
    device for the whole budget (refused: torch.OutOfMemoryError from the allocation)."""
    state = {"done": dist.get_rank() != REFUSING_RANK, "skip": skip}

    def ask(*_):
        if state["skip"]:
            state["skip"] -= 1
        elif not state["done"]:
            state["done"] = True
            torch.empty(budget // 4 + 1, dtype=torch.float32)
    return ask


def watched() -> list:
    """A list whose last item counts the ops the recording mode (family_backward.Span)
    sees from now on; append 0 to count a new step."""
    seen = [0]
    dispatch = family_backward.Span.__torch_dispatch__

    def counted(self, *args, **kwargs):
        seen[-1] += 1
        return dispatch(self, *args, **kwargs)
    family_backward.Span.__torch_dispatch__ = counted
    return seen


def arm(model, guard, budget: int, where: str, seen=None):
    """Place the one refusal (see the module docstring); `seen` (watched) gets the count
    at the refusal appended."""
    if where.startswith(("later_backward", "steady_backward")):
        mb1 = where.endswith("mb1")
        ask = refuse_once(budget, skip=1 if mb1 else 0)
        at = model.model.layers[0 if mb1 else int(where[-1])]

        def hook(module, grad_output):
            if seen is not None and len(seen) == 4:
                seen.append(seen[-1])   # step 4's count at its first hook
            ask()
        at.mlp.register_full_backward_pre_hook(hook)
        return
    ask = refuse_once(budget)
    layer = model.model.layers[LAYER]
    if where == "attention":
        layer.self_attn.register_forward_pre_hook(lambda m, a: ask())
    elif where == "window":
        impl = guard.adapter.part(layer.mlp).ep
        for sub in [impl, getattr(impl, "all_to_all", None)]:
            if sub is not None and "experts_forward" in vars(sub):
                window = sub.experts_forward

                def in_window(*args, _window=window):
                    ask()
                    return _window(*args)
                sub.experts_forward = in_window
    elif where in ("dispatch", "combine", "combine_output"):
        arm_exchange(layer, ask, where)
    elif where == "backward":
        def hook(module, grad_output):
            ask()
        layer.mlp.register_full_backward_pre_hook(hook)


def arm_exchange(layer, ask, where: str) -> None:
    """The refusal inside transformers' own AllToAllEP phases of `layer` (v5.24), which
    call the module's `all_to_all_single` (the counts) and `all_to_all_single_autograd`
    (the dispatch's rows, then the combine's): the real collectives, with the allocation
    asked just before the counts exchange ("dispatch"), just after the combine's
    all-to-all ("combine") or just before it ("combine_output"), in forward only."""
    from torch.distributed._functional_collectives import wait_tensor
    from transformers.distributed import expert_parallel as ep

    counts, rows = ep.all_to_all_single, ep.all_to_all_single_autograd
    armed = {"on": False, "rows": 0}

    def entered(module, args):
        armed["on"] = torch.is_grad_enabled()

    def counts_exchange(*args, **kwargs):
        if where == "dispatch" and armed["on"]:
            ask()
        return counts(*args, **kwargs)

    def rows_exchange(*args, **kwargs):
        if where == "combine_output" and armed["on"] and armed["rows"] == 1:
            ask()
        out = rows(*args, **kwargs)
        if armed["on"]:
            armed["rows"] += 1
            if where == "combine" and armed["rows"] == 2:
                # Where transformers' next allocation is refused: its first use of the
                # rows (`empty_like(recv_out)`) waits on the all-to-all before it allocates.
                wait_tensor(out)
                ask()
        return out
    layer.mlp.register_forward_pre_hook(entered)
    layer.mlp.register_forward_hook(lambda m, a, out: armed.update(on=False))
    ep.all_to_all_single, ep.all_to_all_single_autograd = counts_exchange, rows_exchange


def metered_peak(model, guard) -> int:
    """The step's peak by the independent meter (tests/meter.py), the local shards of the
    sharded state as baseline, the library's host memory marked (tests/host_marks.py)."""
    with metered(model) as meter:
        run(model, batches(), guard)
    return meter.peak_bytes


def calm_budget() -> int:
    """1.05 x the everything-kept step's device peak (worst rank)."""
    model = build()
    guard = spikeguard.attach(model, budget=HUGE, policy="none")
    run(model, batches(), guard)
    peak = world_max(record(guard)["peak"])
    guard.detach()
    return int(peak * 1.05)


def check(out_dir: Path, where: str) -> dict:
    ref = run(build(), batches())
    budget = calm_budget()
    model = build()
    guard = spikeguard.attach(model, budget=budget, policy="adaptive")
    if where.startswith("later_backward_whole") and dist.get_rank() == REFUSING_RANK:
        guard.window.layer_cannot_fit = lambda layer: layer == 1
        # ... and, as its own entry checks would, promises no layer before it the vote
        # is not needed (runtime/window.py `promise`): layer 1 votes in every micro-batch
        guard.window.promise = lambda layer: layer > 1
    seen, promised = None, []
    if where.endswith("_skipped"):
        run(model, batches(), guard)   # a calm step first: layer 0's promise can be made
        where = where[:-len("_skipped")]
        # whether layer 1's vote was skipped, first in the attempt refused
        model.model.layers[LAYER].self_attn.register_forward_pre_hook(
            lambda m, a: promised.append(guard.layers.agreement.promised))
    elif where.startswith("later_backward"):
        run(model, batches(), guard)   # a calm step first: its backward's collectives seen
    elif where.startswith("steady_backward"):
        seen = watched()
        for step in range(3):          # three calm steps: the spans confirmed by the second
            run(model, batches(), guard)
            seen.append(0)             # the next step's count
    arm(model, guard, budget, where, seen)
    start = time.perf_counter()
    try:
        peak = metered_peak(model, guard)
    except JobEnds as err:
        return {"ended": str(err), "seconds": time.perf_counter() - start}
    g = {n: p.grad.to_local().clone() for n, p in model.named_parameters()}
    return {"differ": differ(ref, g), "meter_peak": peak, "budget": budget,
            **record(guard), "seconds": time.perf_counter() - start, "watched": seen,
            "promised": promised,
            "step_reruns": [n["reason"] for n in guard.history[-1]["safety_net"]
                            if n["scope"] == "step"]}


def main() -> None:
    out_dir, where = Path(sys.argv[1]), sys.argv[2]
    torch.set_num_threads(1)
    # A hang (a collective its peer never makes) fails the job in a minute, not gloo's
    # default half hour; and a torchrun the test kills takes this rank with it.
    watch_parent(None, signal.SIGKILL)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    rank = dist.get_rank()
    found = check(out_dir, where)
    (out_dir / f"{where}_rank{rank}.json").write_text(json.dumps(found))
    if "ended" in found:
        # The job's groups are aborted: nothing to tear down. Exit 0, not 3: torchrun ends
        # the whole job at a failed exit, before the peers (released by this exit) write.
        os._exit(0)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
