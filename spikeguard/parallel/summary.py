"""The step as the cluster saw it: one all-gather per step, the same record on every rank.

`ep_summary` (expert / data parallel, no pipeline): the routed copies each rank received
per layer against the ranks' mean (max/mean: the hot rank and layer), every rank's peak
and decisions. `pipeline_summary`: the worst peak and its rank and stage, each rank's
decisions, and where the step's spike was (rank, stage, layer, micro-batch), from the
`RoutingMonitor` of each rank's stage modules.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from spikeguard.model.dispatch import expert_imbalance
from spikeguard.parallel.mesh import ParallelLayout


def ep_summary(record: dict, received_per_layer: list[int],
               target: Optional[tuple[bool, int, float]] = None) -> dict:
    """Cluster fields of one step without a pipeline, the same on every rank: each rank's
    routed copies per layer against the mean over the ranks (the hot rank and layer), the
    peaks and decisions of every rank, and the skew schedule's `target` of the step."""
    mine = {"peak_bytes": record.get("peak_bytes", 0), "received": received_per_layer,
            "decisions": record.get("decisions"), "moves": _moves([record])}
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    num_layers = len(received_per_layer)
    rank_imbalance = []
    for layer in range(num_layers):
        loads = [r["received"][layer] for r in everyone]
        mean = sum(loads) / len(loads)
        rank_imbalance.append([load / mean if mean else 1.0 for load in loads])
    worst = max(((ratios[r], r, layer) for layer, ratios in enumerate(rank_imbalance)
                 for r in range(len(ratios))), default=(1.0, 0, 0))
    peaks = [r["peak_bytes"] or 0 for r in everyone]
    return {
        "rank": dist.get_rank(),
        "rank_imbalance": rank_imbalance,          # [layer][rank], max/mean over ranks
        "max_rank_imbalance": worst[0], "hot_rank": worst[1], "hot_layer": worst[2],
        "rank_peak_bytes": peaks, "max_peak_bytes": max(peaks),
        "peak_rank": max(range(len(peaks)), key=peaks.__getitem__),
        **({"rank_decisions": [r["decisions"] for r in everyone]}
           if mine["decisions"] is not None else {}),
        **_rank_moves([r["moves"] for r in everyone]),
        **({"skew_spike": target[0], "skew_hot_rank": target[1],
            "skew_target": target[2]} if target is not None else {}),
    }


def pipeline_summary(prank, guards: list, monitor: "RoutingMonitor", record: dict,
                     peaks: Sequence[int] = ()) -> dict:
    """Cluster fields of one pipeline step (see cluster_summary), from this rank's part;
    `peaks`: each guard's peak over the whole step, its optimizer step included (the
    guard's record ends before it), in place of the record's."""
    groups = prank.groups
    mine = {
        "rank": dist.get_rank(), "stages": prank.stage_ids,
        "coords": {"pp": groups.pp_rank, "dp": groups.dp_rank, "ep": groups.ep_rank},
        "loss": record.get("loss"),
        "guards": [{**g.history[-1], "peak_bytes": p} for g, p in zip(guards, peaks)]
        if peaks else [g.history[-1] for g in guards],
        "residency": [r.log[0] if r.log else None for r in prank.residencies],
        "routing": monitor.routing,
    }
    everyone: list = [None] * groups.layout.nproc
    dist.all_gather_object(everyone, mine)
    return {**{k: v for k, v in mine.items() if k != "loss"},
            **cluster_summary(everyone, groups.layout)}


class RoutingMonitor:
    """Routed copies each MoE layer of this rank received, per micro-batch of the step,
    counted in forward only (a recompute in backward re-runs the layer, not the routing).

    A safety net's re-run sees the same data, hence the same routing: the micro-batch net
    re-runs a forward inside its stage's call (its layers report again, and their record
    is replaced), and the step-level net runs the whole schedule again (the stages'
    forwards start again from the first micro-batch: they are numbered modulo the step's
    micro-batches). So each (layer, micro-batch) of the step has one record, its last."""

    def __init__(self, prank):
        self._imbalance = expert_imbalance
        self._per_step = prank.micro_batches
        self._records: dict[tuple[int, int], dict] = {}
        self._forward = {}
        self._handles = []
        for module in prank.modules.stages:
            state = {"mb": -1, "active": False}
            self._forward[id(module)] = state
            self._handles.append(module.register_forward_pre_hook(self._enter(state)))
            self._handles.append(module.register_forward_hook(self._leave(state)))
            for local, block in enumerate(module.moe_blocks()):
                self._handles.append(block.register_forward_hook(
                    self._record(state, module.first_layer + local)))

    @property
    def routing(self) -> list:
        """This step's records, one per (layer, micro-batch), in the order first seen."""
        return list(self._records.values())

    def begin_step(self) -> None:
        self._records = {}
        for state in self._forward.values():
            state["mb"] = -1

    def _enter(self, state):
        def hook(module, args):
            if torch.is_grad_enabled():
                state["mb"] = (state["mb"] + 1) % self._per_step
                state["active"] = True
        return hook

    def _leave(self, state):
        def hook(module, args, output):
            state["active"] = False
        return hook

    def _record(self, state, layer: int):
        def hook(block, args, output):
            if state["active"]:
                counts = block.last_tokens_per_expert
                self._records[layer, state["mb"]] = {
                    "layer": layer, "micro_batch": state["mb"], "received": int(sum(counts)),
                    "imbalance": self._imbalance(counts)}
        return hook

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def cluster_summary(everyone: list, layout: ParallelLayout) -> dict:
    """The step as the cluster saw it, the same on every rank: the loss (last stages'
    mean), the worst peak and its rank and stage, each rank's decisions, and the spike:
    the (rank, stage, layer, micro-batch) that received the most routed copies relative
    to its expert-parallel peers (max / mean), or, without EP, the worst max/mean tokens
    per expert."""
    losses = [r["loss"] for r in everyone if r["loss"] is not None]
    out: dict[str, Any] = {"loss": sum(losses) / len(losses) if losses else float("nan")}
    peaks = [max((g["peak_bytes"] for g in r["guards"]), default=0) for r in everyone]
    if any(r["guards"] for r in everyone):
        peak_rank = max(range(len(peaks)), key=peaks.__getitem__)
        out.update(max_peak_bytes=peaks[peak_rank], peak_rank=peak_rank,
                   peak_stage=everyone[peak_rank]["stages"][0], rank_peak_bytes=peaks,
                   peak_bytes=peaks[peak_rank],
                   budget_bytes=everyone[peak_rank]["guards"][0]["budget_bytes"],
                   rank_decisions=[_sum_decisions(r["guards"]) for r in everyone],
                   **_rank_moves([_moves(r["guards"]) for r in everyone]))
    by_key: dict = {}
    for r in everyone:
        c = r["coords"]
        for e in r["routing"]:
            by_key.setdefault((c["pp"], c["dp"], e["layer"], e["micro_batch"]), []).append(
                (r["rank"], e))
    best: Optional[tuple] = None
    for (pp, _, layer, mb), peers in by_key.items():
        mean = sum(e["received"] for _, e in peers) / len(peers)
        for rank, e in peers:
            ratio = e["received"] / mean if layout.ep > 1 and mean else e["imbalance"]
            if best is None or ratio > best[0]:
                best = (ratio, rank, pp, layer, mb)
    imbalance = max((e["imbalance"] for r in everyone for e in r["routing"]), default=1.0)
    out["imbalance"] = imbalance
    if best is not None:
        ratio, rank, stage, layer, mb = best
        out["spike"] = {"ratio": ratio, "rank": rank, "stage": stage, "layer": layer,
                        "micro_batch": mb, "measure": "rank" if layout.ep > 1 else "expert"}
    return out


MOVES = ("evicted_bytes", "prefetched_bytes")


def _moves(records: list) -> dict:
    """Bytes a rank's guards (one per stage) evicted to host and prefetched back."""
    return {k: sum(int(r.get(k) or 0) for r in records) for k in MOVES}


def _rank_moves(per_rank: list) -> dict:
    """`rank_evicted_bytes` / `rank_prefetched_bytes`: every rank's, so that the step line
    and the run summary show each rank's evictions, not rank 0's alone."""
    return {f"rank_{k}": [m[k] for m in per_rank] for k in MOVES}


def _sum_decisions(guards: list) -> dict:
    total = {"save": 0, "recompute": 0, "offload": 0}
    for g in guards:
        for k in total:
            total[k] += g["decisions"].get(k, 0)
    return total
