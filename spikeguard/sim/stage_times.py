"""A stage's busy time per micro-batch, as the walk (spikeguard.sim.walk) and its chunks
price it: forward FLOPs at the device's achieved rate, backward `device.backward_ratio`
times that, four all-to-all exchanges a layer, host copies at the cost model's rates.
"""

from __future__ import annotations


class StageTimes:
    """Mixed into StageWalker, whose `dm`, `cfg`, `ep`, `flop_rate` and `planner` it reads."""

    def layer_compute_s(self, count: int) -> float:
        dm = self.dm
        return (dm.dense_flops_per_token * dm.tokens + dm.expert_flops_per_copy * count) / self.flop_rate

    def a2a_s(self, count: int) -> float:
        """One exchange (dispatch or combine): the larger of what this rank sends (its
        T*K copies) and receives (`count`), the off-rank share of it, at link speed."""
        if self.ep == 1:
            return 0.0
        rows = max(self.dm.tokens * self.cfg.model.top_k, count) * (self.ep - 1) / self.ep
        return rows * self.dm.a2a_bytes_per_copy / self.cfg.device.interconnect_bytes_per_s

    def base_s(self, counts: tuple[int, ...], head_flops: float) -> float:
        """Forward and backward without any memory policy: the forward's FLOPs, backward
        `device.backward_ratio` times that (2 on GPUs), and 4 exchanges a layer."""
        compute = sum(self.layer_compute_s(c) for c in counts) + head_flops / self.flop_rate
        return (1 + self.cfg.device.backward_ratio) * compute + 4 * sum(self.a2a_s(c) for c in counts)

    def copy_s(self, num_bytes: int) -> float:
        """A host round trip as the planner's cost model prices it (hidden on a device
        whose copies overlap)."""
        cost = self.planner.cost
        return 0.0 if cost.copies_overlap else num_bytes * (cost.d2h_s_per_byte + cost.h2d_s_per_byte)
