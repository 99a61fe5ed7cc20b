"""What a pipeline stage tells its guard: the two doors through which the pipeline's
trainer (spikeguard.parallel.pipeline_training) changes what a guard expects, so that no
room outside runtime reaches into a guard's parts.

    use_schedule(guard, schedule, stage_index, pp_rank)   # the warm-up's residents
    no_output_head(guard)                                  # the head is on another stage
"""

from __future__ import annotations

from spikeguard.plan.residency import Residency, schedule_residency


def use_schedule(guard, schedule, stage_index: int, pp_rank: int,
                 enabled: bool = True) -> Residency:
    """Give `guard`'s forecast the schedule's residency for `stage_index` (on `pp_rank`),
    read from the guard's own position, offload engine and ledger."""
    residency = schedule_residency(
        schedule, stage_index, pp_rank, micro_batch=lambda: guard.ctx.micro_batch,
        host_bytes=guard.engine.host_bytes_by_layer,
        device_bytes=lambda mb: guard.ledger.bytes_by(micro_batch=mb), enabled=enabled)
    guard.forecast.residency = residency
    return residency


def no_output_head(guard) -> None:
    """This stage holds no output head: nothing of the head's to forecast or to room for."""
    guard.forecast.head_bytes_per_token = 0.0
    guard.layer_room.no_head()
