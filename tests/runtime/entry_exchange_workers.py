"""Spawned rank function for tests/runtime/test_runtime_entry_exchange.py (importable by
the children)."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch
import torch.distributed as dist

import spikeguard
from spikeguard.bench.runtime_ratios import plain_step
from spikeguard.parallel.expert_parallel import ExpertParallelDispatcher
from spikeguard.parallel.launch_utils import close_gloo, init_gloo
from spikeguard.plan.cost_rates import FORMAT, VERSION, use_rates
from spikeguard.runtime.window import TrackerEvictor

from ep_case import ep_case
from host_marks import host_memory_marked
from meter import LiveMeter, model_state_tensors

# `small` with top-4 over 16 narrow experts: the dispatch exchange's rows (4 sent per token,
# 128 wide) weigh beside a layer's attention part, as on `medium`.
WIDE_EXCHANGE = dict(top_k=4, d_expert=64, num_experts=16)
# Rates timed on this machine's CPU (rank 0 of `medium`, EP=2), frozen so the plans do not
# move with the load: with them, before the entry check counted the exchange's rows, rank 1
# ran out in micro-batch 1, layer 3's dispatch (the regrouping copy of its received rows),
# every step, at 0.6x.
RATES = {"format": FORMAT, "version": VERSION,
         "stage_s_per_token": {"gate_up": 4.30e-06, "silu": 3.75e-07, "act": 1.31e-07,
                               "down": 2.01e-06},
         "d2h_s_per_byte": 9.65e-11, "h2d_s_per_byte": 1.40e-10, "copies_overlap": False}


def adaptive_steps_worker(rank: int, world_size: int, store_path: str, out_dir: str,
                          fraction: float, steps: int) -> None:
    """Adaptive at `fraction` of this rank's true peak for `steps` steps; writes its records,
    every eviction the window asked for (where: the layer's entry, its dispatch or its
    decision) with each dispatch's exact overflow, then one more step's dispatch peaks.
    A failing rank destroys its group and raises (as plain_and_guarded_worker)."""
    init_gloo(rank, world_size, store_path)
    try:
        _adaptive_steps(rank, out_dir, fraction, steps)
    except BaseException:
        dist.destroy_process_group()
        raise
    close_gloo()


def _case(rank: int) -> tuple:
    """(the EP layout, this rank's two micro-batches, this rank's true all-saved peak)."""
    case = ep_case(rank, "small", **WIDE_EXCHANGE)
    return case.layout, case.batches, case.peak


def _adaptive_steps(rank: int, out_dir: str, fraction: float, steps: int) -> None:
    layout, batches, peak = _case(rank)
    guard = spikeguard.attach(layout.build(), budget=int(fraction * peak), policy="adaptive")
    use_rates(guard.cost, RATES)
    asked = _record_evictions(guard)
    for _ in range(steps):
        guard.run_step(lambda: plain_step(guard.model, batches))
    keys = ("peak_bytes", "budget_bytes", "safety_net_reruns", "decisions", "evicted_bytes",
            "full_layers")
    records = [{k: h[k] for k in keys} for h in guard.history]
    peaks = _dispatch_peaks(guard)
    guard.run_step(lambda: plain_step(guard.model, batches))
    guard.detach()
    (Path(out_dir) / f"steps_rank{rank}.json").write_text(json.dumps(records))
    (Path(out_dir) / f"asked_rank{rank}.json").write_text(json.dumps(asked))
    (Path(out_dir) / f"dispatch_rank{rank}.json").write_text(json.dumps(peaks))


def _dispatchers(guard) -> list:
    return [b.dispatcher for b in guard.moe_blocks if isinstance(b.dispatcher, ExpertParallelDispatcher)]


def _record_evictions(guard) -> list:
    """[where, step, asked bytes, the dispatch's exact overflow or None] of every eviction
    the window asks for, through the real evictor (recorded, then done as asked)."""
    asked, where = [], ["decision"]

    def evict(evictor, num_bytes, real=TrackerEvictor.evict):
        asked.append([where[0], len(guard.history), num_bytes, where[1] if where[0] == "dispatch"
                      else None])
        return real(evictor, num_bytes)

    def at(name, call, arg):
        # at the dispatch, `arg` is its exchange bytes: the overflow they make now
        where[:] = [name, guard.ledger.in_use() + arg - guard.budget_bytes]
        try:
            return call(arg)
        finally:
            where[:] = ["decision"]

    TrackerEvictor.evict = evict
    window = guard.window
    window.layer_cannot_fit = functools.partial(at, "entry", window.layer_cannot_fit)
    for dispatcher in _dispatchers(guard):
        dispatcher.make_room = functools.partial(at, "dispatch", dispatcher.make_room)
    return asked


def _dispatch_peaks(guard) -> list:
    """[exchange bytes, the device's peak above its in-use after make_room, that in-use,
    the budget] of every forward dispatch from now on (the device's peak is reset at each:
    the step's own peak is no longer recorded right)."""
    peaks, meter = [], guard.meter
    for dispatcher in _dispatchers(guard):
        def room(num_bytes, made=dispatcher.make_room):
            made(num_bytes)
            if guard.in_forward:
                peaks.append([num_bytes, 0, meter.allocated(), guard.budget_bytes])
                meter.reset_peak()

        def dispatch(*args, real=dispatcher.dispatch):
            out = real(*args)
            if guard.in_forward:
                peaks[-1][1] = meter.peak() - peaks[-1][2]
            return out

        dispatcher.make_room, dispatcher.dispatch = room, dispatch
    return peaks


def plain_and_guarded_worker(rank: int, world_size: int, store_path: str, out_dir: str,
                             fraction: float) -> None:
    """The same layout, seeds and data as `adaptive_steps_worker`: the plain model (no
    guard) runs one step; then adaptive at `fraction` runs a calibrating step and one more
    under the independent meter (baseline: the model's state after attach; the guard's
    host memory marked as host), recording what each forward dispatch's `make_room` was
    asked and what the meter saw leave the device during it. Saves both runs' gradients
    (this rank's, before any all-reduce), the record, the meter's peak and the budget.
    A rank that fails destroys its group and raises, rather than wait in close_gloo's
    barrier for a peer that is waiting in a collective (the spawn would hang to its end)."""
    init_gloo(rank, world_size, store_path)
    try:
        _plain_and_guarded(rank, out_dir, fraction)
    except BaseException:
        dist.destroy_process_group()
        raise
    close_gloo()   # the models, and with them every reference to the group, are gone here


def _plain_and_guarded(rank: int, out_dir: str, fraction: float) -> None:
    layout, batches, peak = _case(rank)
    plain = layout.build()
    plain_step(plain, batches)
    expected = {n: p.grad for n, p in plain.named_parameters()}
    del plain
    guard = spikeguard.attach(layout.build(), budget=int(fraction * peak), policy="adaptive")
    use_rates(guard.cost, RATES)
    guard.run_step(lambda: plain_step(guard.model, batches))
    meter = LiveMeter(baseline_tensors=model_state_tensors(guard.model))
    rooms = _rooms_seen(guard, meter)
    with meter, host_memory_marked(meter):
        guard.run_step(lambda: plain_step(guard.model, batches))
    torch.save({"expected": expected,
                "grads": {n: p.grad for n, p in guard.model.named_parameters()},
                "record": guard.history[-1], "rooms": rooms, "meter_peak": meter.peak_bytes,
                "budget": guard.budget_bytes, "elsewhere": meter.freed_elsewhere},
               Path(out_dir) / f"grads_rank{rank}.pt")
    guard.detach()


def _rooms_seen(guard, meter) -> list:
    """[exchange bytes, their overflow over the budget by the ledger, bytes the meter saw
    leave the device during make_room] of every forward dispatch (the real make_room runs)."""
    rooms = []
    for dispatcher in _dispatchers(guard):
        def room(num_bytes, made=dispatcher.make_room):
            over, before = guard.ledger.in_use() + num_bytes - guard.budget_bytes, meter.live_bytes
            made(num_bytes)
            if guard.in_forward:
                rooms.append([num_bytes, over, before - meter.live_bytes])
        dispatcher.make_room = room
    return rooms
