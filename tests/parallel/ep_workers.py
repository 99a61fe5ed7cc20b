"""Spawned rank functions for the expert-parallel tests (importable by the child processes).

B = sequences, T = tokens per sequence. Each rank runs one micro-batch, its shard of the
same global batch, through the EP layout, once per scenario, and saves its gradients (the
expert slice plus the all-reduced replicated ones) and the guard's step record to
`out_dir/{scenario}_rank{r}.pt`; the parent compares.
"""

from __future__ import annotations

from pathlib import Path

import torch

import spikeguard
from spikeguard.errors import UsageError
from spikeguard.model import build_model, model_config
from spikeguard.parallel import allreduce_replicated_grads, parallelize_experts
from spikeguard.parallel.launch_utils import close_gloo, init_gloo

HUGE = "1GiB"


def global_batch(num_sequences: int, seq_len: int, vocab_size: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7)
    return torch.randint(0, vocab_size, (num_sequences, seq_len + 1), generator=gen)


def shard(tokens_BT: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    return tokens_BT.chunk(world_size)[rank]


def _resolve_budget(spec, peaks: dict):
    """'tight': halfway between the least the expert path can keep (measured under the
    experts / offload policies on this rank) and keeping everything; forces the adaptive
    planner to recompute or offload, yet leaves the attention part room (no safety net)."""
    if spec != "tight":
        return spec
    return (peaks["none"] + min(peaks["experts"], peaks["offload"])) // 2


def _try_refused_layout(rank: int, world_size: int, group, out_dir: str) -> None:
    """EP size not dividing the experts: every rank must refuse, before changing anything."""
    model = build_model(model_config("tiny", num_experts=world_size + 1), seed=0)
    result = {"usage_error": False, "message": "", "unchanged": False}
    try:
        parallelize_experts(model, group)
    except UsageError as err:
        result["usage_error"], result["message"] = True, str(err)
    block = model.blocks[0].moe
    result["unchanged"] = (block.experts.w13_ED2F.shape[0] == world_size + 1
                           and type(block.dispatcher).__name__ == "LocalDispatcher")
    torch.save(result, Path(out_dir) / f"refused_rank{rank}.pt")


def step_worker(rank: int, world_size: int, store_path: str, out_dir: str, cfg_overrides: dict,
                num_sequences: int, scenarios: list) -> None:
    """scenarios: (name, policy_by_rank, budget_by_rank); policy "plain" = no guard."""
    init_gloo(rank, world_size, store_path)
    try:
        _run_scenarios(rank, world_size, torch.distributed.group.WORLD, out_dir, cfg_overrides,
                       num_sequences, scenarios)
    except BaseException:
        torch.distributed.destroy_process_group()
        raise
    close_gloo()  # the models, and with them every reference to the group, are gone here


def _run_scenarios(rank: int, world_size: int, group, out_dir: str, cfg_overrides: dict,
                   num_sequences: int, scenarios: list) -> None:
    cfg = model_config("tiny", **cfg_overrides)
    _try_refused_layout(rank, world_size, group, out_dir)
    tokens_BT = shard(global_batch(num_sequences, cfg.seq_len, cfg.vocab_size), rank, world_size)
    peaks: dict = {}
    for name, policy_by_rank, budget_by_rank in scenarios:
        policy, budget = policy_by_rank[rank], budget_by_rank[rank]
        model = parallelize_experts(build_model(cfg, seed=0), group)
        guard = None
        if policy != "plain":
            guard = spikeguard.attach(model, budget=_resolve_budget(budget, peaks), policy=policy)
        def micro_batch():
            loss = model(tokens_BT[:, :-1], tokens_BT[:, 1:]).loss / world_size
            loss.backward()
            return loss

        # run_step: its safety net reaches backward, and re-runs on every rank together.
        loss = guard.run_step(micro_batch) if guard else micro_batch()
        allreduce_replicated_grads(model, group)
        record = guard.history[-1] if guard else None
        if record is not None and budget == HUGE:
            peaks[policy] = record["peak_bytes"]
        torch.save({"grads": {n: p.grad for n, p in model.named_parameters()},
                    "record": record, "loss": loss.detach()},
                   Path(out_dir) / f"{name}_rank{rank}.pt")


def bytes_worker(rank: int, world_size: int, store_path: str, out_dir: str, num_sequences: int,
                 num_experts: int) -> None:
    """One guarded forward (everything saved, no limit) on this rank's shard; saves, per
    layer, the ledger's bytes per op, the rows this rank's experts received, the tokens."""
    init_gloo(rank, world_size, store_path)
    try:
        cfg = model_config("tiny", num_experts=num_experts)
        model = build_model(cfg, seed=0)
        parallelize_experts(model, torch.distributed.group.WORLD)
        guard = spikeguard.attach(model, budget=HUGE, policy="none")
        tokens_BT = shard(global_batch(num_sequences, cfg.seq_len, cfg.vocab_size), rank, world_size)
        with guard.step():
            out = model(tokens_BT[:, :-1], tokens_BT[:, 1:])
            ops = ("dispatch", "gate_up", "silu", "act", "down", "combine")
            found = {b.layer_idx: {"bytes": {op: guard.ledger.bytes_by(0, b.layer_idx, op) for op in ops},
                                   "received": sum(b.last_tokens_per_expert)}
                     for b in model.moe_blocks()}
            found["tokens"] = tokens_BT[:, :-1].numel()
            found["shape"] = guard.shape
            found["combine_per_token"] = guard.forecast.combine_bytes_per_token
            out.loss.backward()
        torch.save(found, Path(out_dir) / f"bytes_rank{rank}.pt")
        guard.detach()
        del model, guard, out
    except BaseException:
        torch.distributed.destroy_process_group()
        raise
    close_gloo()


def exchange_release_worker(rank: int, world_size: int, store_path: str, out_dir: str,
                            rounds: int) -> None:
    """`rounds` exchanges through the EP dispatcher's autograd (forward and backward), each
    with a tensor the caller then drops, and a flag point of the dispatcher's journal:
    saves how many inputs were still alive at the drop (a reference the backend kept past
    the exchange), every storage the independent meter saw freed off this thread (an
    output or a flag point's row the backend dropped after the program did), and whether
    every exchange was right."""
    from meter import LiveMeter
    from spikeguard.parallel.exchange_journal import ExchangeJournal
    from spikeguard.runtime.agreement import Note

    init_gloo(rank, world_size, store_path)
    try:
        group = torch.distributed.group.WORLD
        journal = ExchangeJournal(group, 2, 1)
        splits = [4] * world_size                  # rows to each rank; as many back
        late = {"forward": 0, "backward": 0}
        right = True
        with LiveMeter() as meter:
            for i in range(rounds):
                right &= _exchange_round(rank, world_size, group.group_name, splits, i, late)
                counts, notes = journal.flag_point(torch.ones(2 * world_size, dtype=torch.long),
                                                   Note(), torch.device("cpu"))
                right &= bool((counts == 1).all()) and not notes
                del counts
        torch.save({"late": late, "right": right, "elsewhere": meter.freed_elsewhere},
                   Path(out_dir) / f"release_rank{rank}.pt")
    except BaseException:
        torch.distributed.destroy_process_group()
        raise
    close_gloo()


def _exchange_round(rank: int, world_size: int, group_name: str, splits: list, i: int,
                    late: dict) -> bool:
    """One exchange forward and backward (exchange_release_worker); whether it was right."""
    import weakref

    from spikeguard.parallel.expert_parallel import _Exchange

    x = torch.full((sum(splits), 64), float(rank * 1000 + i), requires_grad=True)
    sent = x * 1                           # the exchange's input, dropped below
    alive = weakref.ref(sent)
    y = _Exchange.apply(sent, splits, splits, group_name)
    del sent
    home = torch.arange(world_size).repeat_interleave(splits[0]).float().unsqueeze(1)
    right = bool((y == home * 1000 + i).all())          # row block s from rank s
    late["forward"] += alive() is not None
    grad = torch.full_like(y, float(rank + 1))
    alive = weakref.ref(grad)
    y.backward(grad)
    del grad, y
    late["backward"] += alive() is not None
    return right and bool((x.grad == home + 1).all())   # block s's gradient from rank s
