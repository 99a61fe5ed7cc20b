"""What the training loop does differently on an expert-parallel rank.

Each rank trains on its own shard of the data (its own generator), scales its loss by
1/world so that the summed replicated gradients equal one big batch's, all-reduces those
gradients after backward, steers routing with the skew injector when one is given, and
gathers a cluster summary per step: the peak of every rank and which rank and layer
received the most tokens (max/mean over ranks of the routed copies each rank received).
"""

from __future__ import annotations

import gc
from typing import Any, Optional

import torch.distributed as dist
from torch import nn

from spikeguard.parallel.expert_parallel import allreduce_replicated_grads
from spikeguard.parallel.launch import Worker


class ExpertParallelHooks:
    def __init__(self, worker: Worker, injector: Optional[Any] = None):
        self.worker = worker
        self.injector = injector
        self.seed_offset = 1000 * worker.rank
        self.loss_scale = 1.0 / worker.world_size
        self.is_main = worker.is_main
        self._target: Optional[tuple[bool, int, float]] = None  # the skew of this step

    def close(self, clean: bool) -> None:
        """Leave the group. After a clean run: wait for every rank, then tear down (a
        process exiting with a live gloo group can abort). After a failure: nothing that
        talks to the peers, which may be blocked in a collective; torchrun stops them."""
        if self.injector is not None:
            self.injector.detach()
            self.injector = None
        if clean and dist.is_initialized():
            # As launch_utils.close_gloo: the group's threads end only once nothing refers
            # to it (models do through their dispatchers), so destroy, drop, and collect
            # while the interpreter is whole; else a rank can abort at exit (torch 2.13).
            dist.barrier(group=self.worker.group)
            dist.destroy_process_group()
            self.worker.group = None
            gc.collect()

    def before_step(self, step: int) -> None:
        if self.injector is not None:
            self.injector.set_step(step)
            self._target = self.injector.schedule._draw(step)

    def after_backward(self, model: nn.Module) -> None:
        allreduce_replicated_grads(model, self.worker.group)

    def summarize(self, record: dict, received_per_layer: list[int]) -> dict:
        """Cluster fields of one step, the same on every rank."""
        mine = {"peak_bytes": record.get("peak_bytes", 0), "received": received_per_layer,
                "decisions": record.get("decisions")}
        everyone: list = [None] * self.worker.world_size
        dist.all_gather_object(everyone, mine, group=self.worker.group)
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
            "rank": self.worker.rank,
            "rank_imbalance": rank_imbalance,          # [layer][rank], max/mean over ranks
            "max_rank_imbalance": worst[0], "hot_rank": worst[1], "hot_layer": worst[2],
            "rank_peak_bytes": peaks, "max_peak_bytes": max(peaks),
            "peak_rank": max(range(len(peaks)), key=peaks.__getitem__),
            **({"rank_decisions": [r["decisions"] for r in everyone]}
               if mine["decisions"] is not None else {}),
            **({"skew_spike": self._target[0], "skew_hot_rank": self._target[1],
                "skew_target": self._target[2]} if self._target is not None else {}),
        }
