"""Spawned rank functions for tests/parallel/test_parallel_calm_forward_ep.py.

Every rank builds the same `tiny` model (seed 0) and shards its experts over the group
(parallelize_experts); its micro-batches are its own data. B = sequences per micro-batch.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

import spikeguard
from spikeguard.model import build_model, model_config
from spikeguard.parallel import parallelize_experts
from spikeguard.parallel.launch_utils import close_gloo, init_gloo

from host_marks import metered
from pp_workers import SPIKE_BIAS   # a selection-only bias: every token picks those experts

CFG = model_config("tiny")
HUGE = 1 << 40
# Sequences per micro-batch, per step, per rank: rank 0's third step starts with a shape
# it has not seen (a hooked forward) while rank 1's is calm, so the ranks run calm and
# hooked forwards side by side and their collectives must still meet.
SHAPES = {0: [(4, 8), (4, 8), (6, 8)], 1: [(4, 8), (4, 8), (4, 8)]}


@contextlib.contextmanager
def _gloo(rank: int, world_size: int, store_path: str):
    """The default group around a worker's body: closed on success (close_gloo), destroyed
    where the body raised, so that the spawn reports the error instead of a peer waiting
    in the closing barrier."""
    init_gloo(rank, world_size, store_path)
    try:
        yield
    except BaseException:
        torch.distributed.destroy_process_group()
        raise
    close_gloo()


def _data(rank: int, step: int, sizes) -> list:
    gen = torch.Generator().manual_seed(1000 * rank + step)
    return [torch.randint(0, CFG.vocab_size, (b, CFG.seq_len + 1), generator=gen)
            for b in sizes]


def _model():
    return parallelize_experts(build_model(CFG, seed=0), torch.distributed.group.WORLD)


def _step_fn(model, batches, watch=None):
    """`watch(i, ended)`: called before micro-batch i's forward (False) and after (True)."""
    def fn():
        for i, t in enumerate(batches):
            if watch is not None:
                watch(i, False)
            loss = model(t[:, :-1], t[:, 1:]).loss
            if watch is not None:
                watch(i, True)
            loss.backward()
    return fn


def _side_by_side(policy: str, budget: int, steps: list) -> dict:
    """The plain model, `policy` with calm forwards and with them off, step by step in
    turn (each rank in the same order; `steps`: each step's micro-batches): per model and
    step the local gradients and the independent meter's peak (the guard's host copies
    marked as host), per guard its records."""
    models = {name: _model() for name in ("plain", "calm", "hooked")}
    guards = {name: spikeguard.attach(models[name], budget=budget, policy=policy)
              for name in ("calm", "hooked")}
    guards["hooked"].calm.enabled = False
    out = {name: {"grads": [], "peaks": []} for name in models}
    for batches in steps:
        for name, model in models.items():
            model.zero_grad(set_to_none=True)
            fn = _step_fn(model, batches)
            with metered(model) as meter:
                fn() if name == "plain" else guards[name].run_step(fn)
            out[name]["peaks"].append(meter.peak_bytes)
            out[name]["grads"].append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name, guard in guards.items():
        out[name]["history"] = guard.history
        guard.detach()
    return out


def side_by_side_worker(rank: int, world_size: int, store_path: str, out_dir: str) -> None:
    """`none` at a huge budget, side by side (`_side_by_side`), over SHAPES' steps."""
    with _gloo(rank, world_size, store_path):
        steps = [_data(rank, step, sizes) for step, sizes in enumerate(SHAPES[rank])]
        out = _side_by_side("none", HUGE, steps)
        torch.save(out, Path(out_dir) / f"side_by_side_rank{rank}.pt")


def out_of_memory_worker(rank: int, world_size: int, store_path: str, out_dir: str,
                         calm: bool) -> None:
    """`none` under a budget its calm steps fit, calm forwards on or off: two steps, then a
    third whose first forward on rank 0 starts beside a device tensor that leaves it half
    the room that forward grew by on the step before (the same shapes), so it runs out
    inside the forward (and the attempt, freed, leaves room for what the peer waits in).
    Saved: each rank's line, and its record of calm forwards."""
    with _gloo(rank, world_size, store_path):
        batches = _data(rank, 0, (4, 8))
        probe_model = _model()
        probe = spikeguard.attach(probe_model, budget=HUGE, policy="none")
        probe.run_step(_step_fn(probe_model, batches))
        budget = int(1.2 * probe.history[-1]["peak_bytes"])
        probe.detach()
        del probe_model, probe

        model = _model()
        guard = spikeguard.attach(model, budget=budget, policy="none")
        guard.calm.enabled = calm
        seen, ballast = [], []

        def note(i, ended):   # the device's figure before micro-batch 0's forward, after
            if i == 0:
                seen.append(guard.ledger.in_use())

        def crowd(i, ended):  # rank 0, step 3: before micro-batch 0's forward, beside it
            if i == 0 and rank == 0 and not ended:
                start, grown = seen[0], seen[1] - seen[0]
                ballast.append(torch.empty(budget - start - grown // 2, dtype=torch.uint8))
                ballast[-1].fill_(1)

        guard.run_step(_step_fn(model, batches))
        guard.run_step(_step_fn(model, batches, note))
        line = ""
        try:
            guard.run_step(_step_fn(model, batches, crowd))
        except spikeguard.DeviceOutOfMemory as err:
            line = str(err)
        ballast.clear()
        torch.save({"line": line, "budget": budget,
                    "calm": [r["calm_forwards"] for r in guard.history]},
                   Path(out_dir) / f"oom_{'calm' if calm else 'hooked'}_rank{rank}.pt")
        guard.detach()


def _calm_peak(rank: int) -> int:
    """This rank's true peak of a calm step with everything kept (`none`, huge budget)."""
    model = _model()
    probe = spikeguard.attach(model, budget=HUGE, policy="none")
    probe.run_step(_step_fn(model, _data(rank, 0, (4, 4))))
    peak = probe.history[-1]["peak_bytes"]
    probe.detach()
    return peak


def adaptive_spike_worker(rank: int, world_size: int, store_path: str, out_dir: str,
                          factor: float) -> None:
    """Adaptive at `factor` x this rank's calm all-kept peak, calm forwards on and off, and
    the plain model, step by step in turn (`_side_by_side`): 5 calm steps, then a step
    whose micro-batches on every rank are one token repeated (every copy of it routed to
    the same experts: a spike on the rank that holds them), then a calm one. Saved with
    the budget."""
    with _gloo(rank, world_size, store_path):
        budget = int(factor * _calm_peak(rank))
        steps = [_data(rank, step, (4, 4)) for step in range(7)]
        steps[5] = [torch.full_like(t, 7) for t in steps[5]]
        out = _side_by_side("adaptive", budget, steps)
        out["budget"] = budget
        torch.save(out, Path(out_dir) / f"adaptive_{factor}_rank{rank}.pt")


def _forced_spike(model, on: bool) -> None:
    """Every router's bias toward ep rank 0's experts (`on`), or none (an even split is
    left to the data)."""
    for block in model.moe_blocks():
        bias = block.router.expert_bias_E
        with torch.no_grad():
            bias.zero_()
            if on:
                bias[:bias.numel() // torch.distributed.get_world_size()] = SPIKE_BIAS


def spike_memory_worker(rank: int, world_size: int, store_path: str, out_dir: str,
                        factor: float, calm_steps: int, after: int) -> None:
    """Adaptive at `factor` x this rank's calm all-kept peak, one guard: `calm_steps` calm
    steps of 2 micro-batches (the routed history fills at 16 forwards), then a step whose
    first micro-batch every rank routes to ep rank 0's experts, then `after` calm steps.
    Saved: the records and the budget."""
    with _gloo(rank, world_size, store_path):
        budget = int(factor * _calm_peak(rank))
        model = _model()
        guard = spikeguard.attach(model, budget=budget, policy="adaptive")
        spike = calm_steps

        def steer(i, ended):
            _forced_spike(model, not ended and i == 0 and step == spike)

        for step in range(calm_steps + 1 + after):
            model.zero_grad(set_to_none=True)
            guard.run_step(_step_fn(model, _data(rank, step, (4, 4)), steer))
        torch.save({"history": guard.history, "budget": budget},
                   Path(out_dir) / f"spike_memory_{factor}_rank{rank}.pt")
        guard.detach()


def ballast_worker(rank: int, world_size: int, store_path: str, out_dir: str,
                   fraction: float) -> None:
    """Adaptive at 1.1x this rank's calm all-kept peak, one guard, 8 steps of 2
    micro-batches (both ranks run both forwards calm on step 6 with this data); on step 6 a
    device tensor of `fraction` of the budget made as micro-batch 0's first MoE block
    starts (after the calm forward's start proof, before the layer's check) and dropped as
    its forward returns. Saved: the records, the independent meter's peaks, the budget."""
    with _gloo(rank, world_size, store_path):
        budget = int(1.1 * _calm_peak(rank))
        model = _model()
        guard = spikeguard.attach(model, budget=budget, policy="adaptive")
        ballast, peaks, on = [], [], [False]

        def crowd(module, args):
            if on[0]:
                ballast.append(torch.ones(int(fraction * budget), dtype=torch.uint8))

        def watch(i, ended):
            on[0] = step == 6 and i == 0 and not ended
            ballast.clear()

        model.blocks[0].moe.register_forward_pre_hook(crowd)
        for step in range(8):
            model.zero_grad(set_to_none=True)
            with metered(model) as meter:
                guard.run_step(_step_fn(model, _data(rank, step, (4, 4)), watch))
            peaks.append(meter.peak_bytes)
        torch.save({"history": guard.history, "peaks": peaks, "budget": budget},
                   Path(out_dir) / f"ballast_{fraction}_rank{rank}.pt")
        guard.detach()
