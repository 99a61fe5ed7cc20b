"""Spawned rank functions for tests/parallel/test_parallel_true_device.py.

B = sequences, T = tokens per sequence. Every rank builds the same `tiny` model (seed 0),
shards its experts over the group (parallelize_experts), accumulates one warm-up backward
before the guard is attached (so a step's "gradients before" are not all None), then runs
one guarded step of two micro-batches of its own data with `guard.run_step`. It saves its
gradients (expert slice plus the all-reduced replicated ones) and the step record to
`out_dir/{scenario}_rank{r}.pt`; the parent compares.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path

import torch

import spikeguard
from spikeguard.model import build_model, model_config
from spikeguard.parallel import allreduce_replicated_grads, parallelize_experts
from spikeguard.parallel.launch_utils import close_gloo, init_gloo
from spikeguard.plan.catalogue import ALL_SAVE
from spikeguard.runtime import device_state

from meter import LiveMeter, model_state_tensors

HUGE = 1 << 40
# The tests run `tiny`; scripts/recovery_table.py sets SPIKEGUARD_TABLE_PRESET for `small`
# (spawned ranks re-import this module, so the choice travels in the environment).
CFG = model_config(os.environ.get("SPIKEGUARD_TABLE_PRESET", "tiny"))
MICRO_BATCH_SIZES = (4, 8)   # sequences per micro-batch on every rank


def _batch(num_sequences: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randint(0, CFG.vocab_size, (num_sequences, CFG.seq_len), generator=gen),
            torch.randint(0, CFG.vocab_size, (num_sequences, CFG.seq_len), generator=gen))


def _data(rank: int) -> list:
    return [_batch(b, 1000 * rank + i) for i, b in enumerate(MICRO_BATCH_SIZES)]


def _warm_model(rank: int, world_size: int):
    """The EP model with one warm-up backward accumulated (identical in every scenario)."""
    model = parallelize_experts(build_model(CFG, seed=0), torch.distributed.group.WORLD)
    x, y = _batch(2, 500 + rank)
    (model(x, y).loss / world_size).backward()
    return model


def blind_prevention(guard) -> None:
    """Disable everything that would keep the step under the budget before the device
    refuses: every layer saves everything, no layer is recomputed whole at entry, and no
    layer's own forward and backward peaks are checked (no eviction to host). What
    remains is the step-level safety net."""
    guard.decide = lambda layer, num_routed: guard.planner.fixed(ALL_SAVE, num_routed)
    # `decide` replaced whole (where the layer's own peaks are checked and evicted for),
    # not the slopes set to 0: each step without a re-run calibrates them again.
    guard.window.layer_cannot_fit = lambda layer: False


def _step_fn(model, data, world_size: int, meter=None):
    def fn():
        for x, y in data:
            if meter is not None:
                meter.phase = "forward"
            loss = model(x, y).loss / world_size
            if meter is not None:
                meter.phase = "backward"
            loss.backward()
    return fn


def _phase_peaks(model, guard, data, world_size: int) -> dict:
    """The ceiling's forward and backward peaks on this rank, from the independent meter
    (gloo's own buffers, allocated on its threads, are not seen: they only add margin).
    The guard's host copy of the gradients before the step is host memory: marked so."""
    meter = LiveMeter(baseline_tensors=model_state_tensors(model))
    peaks = {"forward": 0, "backward": 0}
    add = meter._add

    def tracked(num_bytes):
        add(num_bytes)
        if meter.phase in peaks:
            peaks[meter.phase] = max(peaks[meter.phase], meter.live_bytes)
    meter._add = tracked
    with meter, snapshots_on_host(meter):
        guard.run_step(_step_fn(model, data, world_size, meter))
    return peaks


@contextlib.contextmanager
def snapshots_on_host(meter):
    """The guard's copy of the gradients before a step is host memory: marked so for the
    meter (which otherwise counts every storage made inside it)."""
    snapshot_init = device_state.GradSnapshot.__init__

    def host_snapshot(self, *args):
        with meter.host_scope():
            snapshot_init(self, *args)
    device_state.GradSnapshot.__init__ = host_snapshot
    try:
        yield
    finally:
        device_state.GradSnapshot.__init__ = snapshot_init


def _save(model, guard, name: str, rank: int, out_dir: str, **extra) -> None:
    allreduce_replicated_grads(model, torch.distributed.group.WORLD)
    torch.save({"grads": {n: p.grad for n, p in model.named_parameters()},
                "record": guard.history[-1], **extra},
               Path(out_dir) / f"{name}_rank{rank}.pt")


def _forced_step(rank, world_size, data, out_dir, name, budget, blind, **extra) -> None:
    """One run_step of the warm model under `budget` (prevention blinded where `blind`),
    under the independent meter; saved as `name` with the meter's peak and the budget."""
    model = _warm_model(rank, world_size)
    guard = spikeguard.attach(model, budget=budget, policy="adaptive")
    if blind:
        blind_prevention(guard)
    meter = LiveMeter(baseline_tensors=model_state_tensors(model))
    with meter, snapshots_on_host(meter):
        guard.run_step(_step_fn(model, data, world_size))
    _save(model, guard, name, rank, out_dir, budget=budget, meter_peak=meter.peak_bytes, **extra)
    guard.detach()


def forced_backward_oom_worker(rank: int, world_size: int, store_path: str, out_dir: str,
                               forced_rank: int) -> None:
    """'ceiling': adaptive, huge budget, uninterrupted. 'forced': the same job with the
    prevention blinded on `forced_rank` under a budget halfway between that rank's
    forward and backward peaks, so its device refuses in backward; the others keep the
    huge budget."""
    init_gloo(rank, world_size, store_path)
    try:
        data = _data(rank)
        model = _warm_model(rank, world_size)
        guard = spikeguard.attach(model, budget=HUGE, policy="adaptive")
        peaks = _phase_peaks(model, guard, data, world_size)
        _save(model, guard, "ceiling", rank, out_dir, peaks=peaks)
        guard.detach()
        del model, guard

        budget = HUGE
        if rank == forced_rank:
            budget = (peaks["forward"] + peaks["backward"]) // 2
        _forced_step(rank, world_size, data, out_dir, "forced", budget, rank == forced_rank)
    except BaseException:
        torch.distributed.destroy_process_group()
        raise
    close_gloo()


def mixed_policy_run_step_worker(rank: int, world_size: int, store_path: str, out_dir: str,
                                 num_steps: int, policies: tuple) -> None:
    """Rank r under policies[r], every budget huge, `num_steps` steps with run_step and
    close_gloo's barrier: no rank may wait on a collective the others skip."""
    init_gloo(rank, world_size, store_path)
    try:
        model = parallelize_experts(build_model(CFG, seed=0), torch.distributed.group.WORLD)
        guard = spikeguard.attach(model, budget=HUGE, policy=policies[rank])
        for step in range(num_steps):
            guard.run_step(_step_fn(model, [_batch(4, 100 * step + rank)], world_size))
            model.zero_grad(set_to_none=True)
        torch.save({"steps": len(guard.history)}, Path(out_dir) / f"mixed_rank{rank}.pt")
        guard.detach()
        del model, guard
    except BaseException:
        torch.distributed.destroy_process_group()
        raise
    close_gloo()


def _metered_peak(model, guard, data, world_size: int) -> tuple[int, int]:
    """(whole step's peak, forward's peak) of one run_step, from the independent meter."""
    peaks = _phase_peaks(model, guard, data, world_size)
    return max(peaks.values()), peaks["forward"]


def forced_forward_oom_worker(rank: int, world_size: int, store_path: str, out_dir: str,
                              forced_rank: int) -> None:
    """'fwd_ceiling': adaptive, huge budget. Then the budget of `forced_rank` halfway
    between full recompute's whole-step peak and the ceiling's forward peak, its
    prevention blinded: its forward runs out (everything saved), the micro-batch's re-run
    with full recompute fits, forward and backward. Skipped (saved as such) if this model
    has no such budget."""
    init_gloo(rank, world_size, store_path)
    try:
        data = _data(rank)
        model = _warm_model(rank, world_size)
        guard = spikeguard.attach(model, budget=HUGE, policy="adaptive")
        _, forward_peak = _metered_peak(model, guard, data, world_size)
        _save(model, guard, "fwd_ceiling", rank, out_dir)
        guard.detach()
        model = _warm_model(rank, world_size)
        guard = spikeguard.attach(model, budget=HUGE, policy="full")
        full_peak, _ = _metered_peak(model, guard, data, world_size)
        guard.detach()
        del model, guard

        window = torch.tensor([full_peak, forward_peak])
        torch.distributed.broadcast(window, src=forced_rank)
        full_peak, forward_peak = window.tolist()
        budget = HUGE
        if rank == forced_rank:
            budget = (full_peak + forward_peak) // 2
        _forced_step(rank, world_size, data, out_dir, "fwd_forced", budget,
                     rank == forced_rank, full_peak=full_peak, forward_peak=forward_peak)
    except BaseException:
        torch.distributed.destroy_process_group()
        raise
    close_gloo()


UNSETTLED_BUDGET = 256 << 20


def unsettled_backward_worker(rank: int, world_size: int, store_path: str,
                              out_dir: str) -> None:
    """Rank 0's caller keeps each micro-batch's loss (and so its whole graph) and, as its
    backward starts, fills the device to the limit: the backward is refused, and freeing
    the attempt frees nothing the caller still holds, so rank 0 cannot make even the zero
    rows its peer waits in, nor a flag point's row. Saved: each rank's line (or the type
    of whatever else ended its step) and how long the step took to end."""
    init_gloo(rank, world_size, store_path)
    from spikeguard.runtime.agreement import JobEnds
    model = _warm_model(rank, world_size)
    guard = spikeguard.attach(model, budget=UNSETTLED_BUDGET, policy="adaptive")
    held, ballast = [], []

    def fill(grad):
        ballast.append(torch.empty(UNSETTLED_BUDGET - guard.ledger.in_use(), dtype=torch.uint8))

    def fn():
        for x, y in _data(rank):
            loss = model(x, y).loss / world_size
            if rank == 0:
                held.append(loss)
                loss.register_hook(fill)
            loss.backward()
    start = time.perf_counter()
    try:
        guard.run_step(fn)
        result = {"ended": None}
    except JobEnds as err:
        result = {"ended": str(err)}
    except BaseException as err:   # noqa: BLE001 (what the test must not see)
        result = {"ended": None, "raised": type(err).__name__, "text": str(err)[:300]}
    result["seconds"] = time.perf_counter() - start
    (Path(out_dir) / f"unsettled_rank{rank}.json").write_text(json.dumps(result))
    os._exit(0)   # the job's groups are aborted: nothing to tear down
