"""Spawned rank functions for the pipeline tests (importable by the child processes).

S = data shards (dp x ep), M = micro-batches per shard, B = sequences per micro-batch,
T = tokens per sequence. Each rank builds the mesh once, then per scenario a fresh model,
its PipelineRank (stage cut, experts sharded, guard, DDP, schedule), runs one step and
saves `out_dir/{scenario}_rank{r}.pt`: gradients under the full model's parameter names
(expert weights: this rank's slice, with its bounds), the guards' records, the residency
log, the last stage's losses, and how many forwards the stage module saw.
"""

from __future__ import annotations

from pathlib import Path

import torch

import spikeguard
from spikeguard.errors import DeviceOutOfMemory
from spikeguard.model import build_model, model_config
from spikeguard.parallel.launch_utils import close_gloo, init_gloo
from spikeguard.parallel.mesh import MeshGroups, ParallelLayout
from spikeguard.parallel.pipeline_training import PipelineRank

from host_marks import metered

HUGE = "1GiB"
SPIKE_BIAS = 100.0  # selection-only: every token picks the hot rank's experts


def global_batch(num_sequences: int, seq_len: int, vocab_size: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7)
    return torch.randint(0, vocab_size, (num_sequences, seq_len + 1), generator=gen)


def pp_worker(rank: int, world_size: int, store_path: str, out_dir: str, micro_batches: int,
              batch_size: int, runs: list) -> None:
    """runs: one per layout, dicts with prefix (of the saved files), pp, ep, cfg (model
    overrides) and scenarios: dicts with name, policy ("plain" = no guard), budget (bytes
    spec, or "calm*F": F times this rank's true peak in the scenario named "calm", or
    "range*F": the peak of scenario "full" (or "i_full" under the interleaved schedule)
    plus F of the way up to "calm"'s: a budget full recompute fits and keeping
    everything does not, whatever the share of parameters in the peak), and
    optionally schedule, residency (bool), spike (micro-batch forced onto ep rank 0's
    experts on stage 0), calm (every micro-batch's routing left unbiased), steps (that
    many steps, gradients set to None between them as a training loop does; the saved
    `steps` has every step's records, `records` the last step's), squeeze
    ((micro-batch, times): on rank 0 only, that micro-batch's first MoE layer allocates
    past the budget in its first `times` forwards, an allocation no plan foresees)."""
    init_gloo(rank, world_size, store_path)
    try:
        for run in runs:
            groups = MeshGroups.build(ParallelLayout(world_size, pp=run["pp"], ep=run["ep"]))
            peaks: dict = {}
            for scenario in run["scenarios"]:
                # Every rank has saved the previous scenario before any can fail in this one.
                torch.distributed.barrier()
                _run_scenario(rank, groups, Path(out_dir), run["prefix"], run["cfg"],
                              micro_batches, batch_size, scenario, peaks)
            del groups
    except BaseException:
        torch.distributed.destroy_process_group()
        raise
    close_gloo()


def _budget(spec, peaks: dict, schedule: str = "1f1b"):
    if isinstance(spec, str) and spec.startswith("calm*"):
        return int(peaks["calm"] * float(spec[5:]))
    if isinstance(spec, str) and spec.startswith("range*"):
        full = peaks["i_full" if schedule == "interleaved" else "full"]
        return int(full + (peaks["calm"] - full) * float(spec[6:]))
    return spec


def _run_scenario(rank, groups, out_dir, prefix, cfg_overrides, micro_batches, batch_size,
                  scenario, peaks) -> None:
    cfg = model_config(cfg_overrides.get("preset", "tiny"),
                       **{k: v for k, v in cfg_overrides.items() if k != "preset"})
    num_shards = groups.num_shards
    tokens = global_batch(num_shards * micro_batches * batch_size, cfg.seq_len, cfg.vocab_size)
    tokens = tokens.chunk(num_shards)[groups.data_shard]
    prank = PipelineRank(build_model(cfg, seed=0), groups, micro_batches=micro_batches,
                         batch_size=batch_size, schedule=scenario.get("schedule", "1f1b"),
                         residency=scenario.get("residency", True))
    policy = scenario["policy"]
    if policy != "plain":
        budget = _budget(scenario["budget"], peaks, scenario.get("schedule", "1f1b"))
        prank.attach_guards(lambda m: spikeguard.attach(m, budget=budget, policy=policy))
    forwards = [0]
    for module in prank.modules.stages:
        module.register_forward_pre_hook(_count(forwards))
        if scenario.get("spike") is not None or scenario.get("calm"):
            module.register_forward_pre_hook(
                _forced_routing(module, groups, scenario.get("spike"), forwards))
    if scenario.get("squeeze") is not None and rank == 0:
        _squeeze(prank.guards[0], prank.modules.stages[0], *scenario["squeeze"])
    if scenario.get("squeeze_backward") is not None:
        squeezed_rank, micro_batch = scenario["squeeze_backward"]
        if rank == squeezed_rank:
            _squeeze_backward(prank.guards[0], prank.modules.stages[0], micro_batch)
    result = {"rank": rank, "stage_ids": prank.stage_ids, "oom": None}
    try:
        steps = scenario.get("steps", 1)
        for step in range(steps):   # the last under the meter, where asked
            if step:
                prank.modules.zero_grad(set_to_none=True)
                forwards[0] = 0
            if scenario.get("meter") and step == steps - 1:
                losses, result["meter_peak"] = _metered_step(prank, tokens)
            else:
                losses = prank.step(tokens[:, :-1], tokens[:, 1:])
        result["losses"] = [x.detach() for x in losses]
    except DeviceOutOfMemory as err:
        result["oom"] = str(err)
        torch.save(result, out_dir / f"{prefix}{scenario['name']}_rank{rank}.pt")
        raise
    result["grads"] = _global_grads(prank)
    result["records"] = [g.history[-1] for g in prank.guards]
    result["steps"] = [[g.history[i] for g in prank.guards]
                       for i in range(min((len(g.history) for g in prank.guards), default=0))]
    result["residency"] = [r.log for r in prank.residencies]
    result["forwards"] = forwards[0]
    if result["records"]:
        peaks[scenario["name"]] = max(r["peak_bytes"] for r in result["records"])
    torch.save(result, out_dir / f"{prefix}{scenario['name']}_rank{rank}.pt")
    prank.close()


def _metered_step(prank: PipelineRank, tokens) -> tuple[list, int]:
    """The step under the independent meter (tests/meter.py): the rank's peak of live
    device bytes, its stage modules' state the baseline, the guard's host copies (the
    gradients before the step, the offload pool) marked as host (tests/host_marks.py)."""
    with metered(*prank.modules.stages, alive=_receive_buffers(prank)) as meter:
        losses = prank.step(tokens[:, :-1], tokens[:, 1:])
    return losses, meter.peak_bytes


def _receive_buffers(prank: PipelineRank) -> list:
    """The buffers torch's pipeline stages receive activations and gradients into: made at
    the first step (the meter sees them then), kept for every later one (the device
    counts them; the meter, entered after, must be told: 64 KiB on stage 0 here)."""
    stages = prank.recovery.stages if prank.recovery is not None else []
    return [info.buffer for stage in stages
            for infos in [*stage.args_recv_info.values(), *stage.grad_recv_info.values()]
            for info in infos if getattr(info, "buffer", None) is not None]


def _squeeze(guard, module, micro_batch: int, times: int) -> None:
    """The first MoE layer of `micro_batch` holds, for its forward, a temporary that takes
    the device 1 KiB past its budget, in the first `times` forwards of that micro-batch.
    The device refuses the allocation after it (as a GPU would) and the guard's net
    catches it; nothing in the planner knew of it."""
    block, left, held = module.moe_blocks()[0], [times], []

    def pre(mod, args):
        if guard.ctx.micro_batch == micro_batch and left[0] > 0 and torch.is_grad_enabled():
            left[0] -= 1
            room = guard.budget_bytes - guard.meter.allocated()
            held.append(torch.empty(max(room, 0) + 1024, dtype=torch.uint8))

    def post(mod, args, out):
        held.clear()

    block.register_forward_pre_hook(pre)
    block.register_forward_hook(post)


def _squeeze_backward(guard, module, micro_batch: int) -> None:
    """Once, in the backward of `micro_batch` through the stage's first MoE layer, a
    temporary that the device refuses (the room left plus 1 KiB): an allocation no plan
    foresees, in backward, where only the step can be re-run."""
    block, left = module.moe_blocks()[0], [1]

    def refuse(grad):
        if left[0] > 0:
            left[0] -= 1
            room = guard.budget_bytes - guard.meter.allocated()
            torch.empty(max(room, 0) + 1024, dtype=torch.uint8)
        return grad

    def pre(mod, args):
        x = args[0]
        if (guard.in_forward and guard.ctx.micro_batch == micro_batch and left[0] > 0
                and torch.is_tensor(x) and x.requires_grad):
            x.register_hook(refuse)

    block.register_forward_pre_hook(pre)


def _count(forwards):
    def hook(module, args):
        if torch.is_grad_enabled():
            forwards[0] += 1
    return hook


def _forced_routing(module, groups, spike_mb, forwards):
    """Stage 0's `spike_mb`-th forward sends every token to ep rank 0's experts; all other
    forwards (and all of a calm scenario) are steered to an even split by zero bias."""
    routers = [b.router for b in module.moe_blocks()]

    def hook(mod, args):
        hot = module.is_first and spike_mb is not None and forwards[0] - 1 == spike_mb
        for router in routers:
            with torch.no_grad():
                router.expert_bias_E.zero_()
                if hot:
                    per_rank = router.gate.out_features // groups.layout.ep
                    router.expert_bias_E[:per_rank] = SPIKE_BIAS
    return hook


def _global_grads(prank: PipelineRank) -> dict:
    """name in the full model -> (grad, expert slice or None)."""
    out = {}
    for module in prank.modules.stages:
        for name, p in module.named_parameters():
            if name.startswith("blocks."):
                _, local, rest = name.split(".", 2)
                name = f"blocks.{module.first_layer + int(local)}.{rest}"
            expert_slice = None
            if ".experts." in name and prank.groups.ep_group is not None:
                num_local = p.shape[0]
                lo = prank.groups.ep_rank * num_local
                expert_slice = (lo, lo + num_local)
            out[name] = (p.grad, expert_slice)
    return out
