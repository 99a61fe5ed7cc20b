"""One rank of a pipeline x data x expert parallel job: stages, guards, schedule, reduction.

    groups = MeshGroups.build(ParallelLayout(nproc=4, pp=2, ep=2))
    rank = PipelineRank(build_model(cfg), groups, micro_batches=4, batch_size=2)
    rank.attach_guards(lambda module: spikeguard.attach(module, budget=..., policy=...))
    losses = rank.step(idx_BT, targets_BT)     # M*B sequences: this data shard's batch

Order matters and is fixed here: cut the stages, shard their experts (new parameters),
attach the guards (they count the parameters), then build the PipelineStages (static
shapes: no inference forward) and the schedule, whose action list the guards' residency
forecast reads.

Gradients, with S = dp x ep data shards of M micro-batches each: every micro-batch's loss
is a mean over its tokens; the schedule divides the accumulated gradients by M; the
replicated ones are summed over the S shards (the dp x ep replicate group) and an
expert's, which already holds its ep peers' contributions (the reverse all-to-all), over
dp, then each is divided by S. That is the single-process gradient of the mean loss over
all S x M micro-batches, up to float rounding (tests/parallel/test_parallel_pp.py states
the tolerance).

The replicas reduce after the step's agreement, not during the schedule's last backward
as DDP's buckets would: a rank refused in that backward plays the rest of the schedule as
a ghost (spikeguard.parallel.pipeline_recovery), and a ghost cannot issue the buckets its
replicas have launched and not yet the rest, in their order (with small buckets torch's
reducer failed its own assertion in the re-run). Reducing after the step, a failed step
launches no reduction at all; the cost is the overlap of that one backward with the
all-reduce.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from spikeguard.errors import DeviceOutOfMemory, UsageError
from spikeguard.parallel.expert_parallel import (allreduce_replicated_grads, expert_parameters,
                                                 parallelize_experts)
from spikeguard.parallel.gradients import clip_grads_, sum_grads
from spikeguard.parallel.mesh import SCHEDULES, MeshGroups
from spikeguard.plan.residency import Residency
from spikeguard.parallel.pipeline_recovery import PipelineRecovery
from spikeguard.parallel.pipeline_stages import pipeline_stage, stage_loss, stage_module
from spikeguard.runtime.agreement import unrecoverable
from spikeguard.runtime.pipeline_view import no_output_head, use_schedule
from spikeguard.runtime.step import run_steps



class RankModules(nn.Module):
    """The stage modules one rank holds (two under the interleaved schedule)."""

    def __init__(self, modules: list[nn.Module]):
        super().__init__()
        self.stages = nn.ModuleList(modules)

    def moe_blocks(self):
        return [b for m in self.stages for b in m.moe_blocks()]


class PipelineRank:
    def __init__(self, model: nn.Module, groups: MeshGroups, *, micro_batches: int,
                 batch_size: int, schedule: str = "1f1b", residency: bool = True):
        if schedule not in SCHEDULES:
            raise UsageError(f"unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
        pp = groups.layout.pp
        self.groups, self.schedule_name = groups, schedule
        self.micro_batches, self.batch_size = micro_batches, batch_size
        self.seq_len = model.cfg.seq_len
        per_rank = 2 if schedule == "interleaved" else 1
        self.num_stages = pp * per_rank
        # Interleaved (loop) placement: rank r holds stages r and r + pp.
        self.stage_ids = [groups.pp_rank + k * pp for k in range(per_rank)]
        self.modules = RankModules([stage_module(model, s, self.num_stages)
                                    for s in self.stage_ids])
        if groups.ep_group is not None:
            for module in self.modules.stages:
                parallelize_experts(module, groups.ep_group)
        self.guards: list = []
        self.residencies: list[Residency] = []
        self.use_residency = residency
        self.schedule = None
        self.recovery: Optional[PipelineRecovery] = None
        self.keep_grads = False
        self.has_first = 0 in self.stage_ids
        self.has_last = self.num_stages - 1 in self.stage_ids

    # ---- building ---------------------------------------------------------------------
    def attach_guards(self, attach: Callable[[nn.Module], object]) -> list:
        """One guard per stage module (under the interleaved schedule each chunk has its
        own guard and budget: a shared per-rank ledger is not built)."""
        if self.schedule is not None:
            raise UsageError("attach the guards before the first step")
        self.guards = [attach(m) for m in self.modules.stages]
        for guard, module in zip(self.guards, self.modules.stages):
            if not module.is_last:   # the head is on another stage
                no_output_head(guard)
        return self.guards

    def _build(self) -> None:
        from torch.distributed.pipelining import Schedule1F1B, ScheduleInterleaved1F1B

        shape = (self.batch_size, self.seq_len)
        # What the stages allocate here lives on the device from now on (a CUDA device
        # counts it): made with the guards' devices active, the emulated one does too (the
        # independent meter saw 56-76 KiB more than the device on PP=2 x EP=2).
        with contextlib.ExitStack() as active:
            for guard in self.guards:
                active.enter_context(guard.meter.active())
            stages = [pipeline_stage(m, s, self.num_stages, shape, group=self.groups.pp_group)
                      for m, s in zip(self.modules.stages, self.stage_ids)]
            loss_fn = stage_loss
            if self.guards:   # a rank that runs out plays the rest of the step as a ghost
                self.recovery = PipelineRecovery(
                    self.guards, stages, self.guards[0].net.agreement)
                loss_fn = functools.partial(self.recovery.loss, stage_loss)
                # Whether some rank of the job may re-run a step (every rank builds).
                adaptive = torch.tensor([int(any(g.policy == "adaptive" for g in self.guards))])
                dist.all_reduce(adaptive, op=dist.ReduceOp.MAX)
                self.keep_grads = bool(adaptive.item())
            if self.schedule_name == "interleaved":
                self.schedule = ScheduleInterleaved1F1B(stages, self.micro_batches,
                                                        loss_fn=loss_fn)
            else:
                self.schedule = Schedule1F1B(stages[0], self.micro_batches, loss_fn=loss_fn)
        self.residencies = [use_schedule(g, self.schedule, s, self.groups.pp_rank,
                                         enabled=self.use_residency)
                            for g, s in zip(self.guards, self.stage_ids)]

    # ---- one optimizer step -----------------------------------------------------------
    def step(self, idx_BT: torch.Tensor, targets_BT: torch.Tensor) -> list[torch.Tensor]:
        """Forward and backward of this shard's M micro-batches; the last stage's losses."""
        if self.schedule is None:
            self._build()
        losses: list = []

        attempts = [0]

        def micro_batches() -> None:
            losses.clear()   # a re-run of the step by the guards' safety net starts afresh
            if self.recovery is not None:
                self.recovery.begin_step(rerun=attempts[0] > 0)
            attempts[0] += 1
            for residency in self.residencies:
                residency.begin_step()
            args = (idx_BT,) if self.has_first else ()
            kwargs = {"target": targets_BT, "losses": losses} if self.has_last else {}
            with _unwrapped_errors():
                # return_outputs=False: the last stage would otherwise keep every
                # micro-batch's log-probabilities (B x T x V each) until the step ends.
                self.schedule.step(*args, return_outputs=False, **kwargs)

        # One step of every guard of this rank. A micro-batch's forward that runs out is
        # run again inside the stage (its EP group agrees); any other failure makes this
        # rank a ghost for the rest of the schedule, and at its end every rank of the job
        # holds the same notes: all re-run the step together, or all end the job
        # (spikeguard.parallel.pipeline_recovery).
        if self.guards:
            run_steps(self.guards, micro_batches, step_end=self.recovery.step_end,
                      keep_grads=self.keep_grads)
        else:
            micro_batches()
        self._reduce_grads()
        return losses

    @torch.no_grad()
    def evaluate(self, idx_BT: torch.Tensor, targets_BT: torch.Tensor) -> list[torch.Tensor]:
        """Forward only, through the same schedule (the guards see no micro-batch)."""
        if self.schedule is None:
            self._build()
        losses: list = []
        args = (idx_BT,) if self.has_first else ()
        kwargs = {"target": targets_BT, "losses": losses} if self.has_last else {}
        if self.recovery is not None:   # a rank that runs out plays the rest as a ghost,
            self.recovery.begin_step(rerun=True)   # and the whole job ends on its note
        with _unwrapped_errors():
            self.schedule.eval(*args, **kwargs)
        if self.recovery is not None:
            notes = self.recovery.step_end()
            if notes:
                # an evaluation saves nothing for backward: no policy would fit it
                raise unrecoverable(notes, self.guards[0].budget_bytes, tried_full=True)
        return losses

    def _reduce_grads(self) -> None:
        """The replicas' gradients, after the step's agreement (see the module's docstring):
        in place, one collective per parameter, no flat copy on the device."""
        group = self.groups.replicate_group
        if group is None:
            return
        for module in self.modules.stages:
            allreduce_replicated_grads(module, group)   # all but the sharded experts
            if self.groups.dp_group is not None:
                sum_grads(expert_parameters(module), self.groups.dp_group)
            for p in module.parameters():
                if p.grad is not None:
                    p.grad /= self.groups.num_shards

    # ---- gradient norm over the whole mesh -------------------------------------------
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """clip_grad_norm_ over the whole model: the replicated parameters of a stage are
        equal on its dp x ep replicas (counted once), the experts are summed over the ep
        peers, the stages over the pipeline."""
        experts = {id(p) for m in self.modules.stages for p in expert_parameters(m)}
        return clip_grads_(self.modules.parameters(), max_norm,
                           sharded=lambda p: id(p) in experts,
                           shard_group=self.groups.ep_group, stage_group=self.groups.pp_group)

    def close(self) -> None:
        for guard in self.guards:
            guard.detach()
        self.guards, self.residencies, self.schedule = [], [], None


@contextlib.contextmanager
def _unwrapped_errors():
    """torch 2.13's PipelineStage re-raises any error of a stage's forward as a RuntimeError
    ("[Stage 0] failed to run forward"): give back the guard's own out-of-memory or usage
    error, so the command line reports it in one line with its exit code."""
    try:
        yield
    except RuntimeError as err:
        cause = err.__cause__
        if isinstance(cause, (DeviceOutOfMemory, UsageError, torch.OutOfMemoryError)):
            raise cause from None
        raise
