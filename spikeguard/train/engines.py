"""What one process holds of the model and how it runs a step: the loop's one seam to the
layout (spikeguard.train.loop runs every layout through it).

    engine = LocalEngine(model, family, groups)      # one process, EP, DP, DP x EP
    engine = PipelineEngine(prank, family)            # PP, PP x EP, PP x DP (x EP)
    engine.attach_guards(lambda module, optimizer: spikeguard.attach(module, ...))
    out = engine.step(micro_batches)                  # forward, backward, clip, update

B = sequences per micro-batch, T = tokens per sequence, M = micro-batches per step.

A `family` (spikeguard.train.families) says how a model of its kind is fed and scored
(the built-in model: `model(idx, targets)`; a Hugging Face one: `model(input_ids=w,
labels=w)`), so the same engines serve every kind. Every engine draws nothing: the
loop draws the step's micro-batches before the step (a re-run by the guard's safety net
sees the same data).
"""

from __future__ import annotations

import contextlib

from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from spikeguard.model.dispatch import expert_imbalance
from spikeguard.parallel.expert_parallel import (allreduce_replicated_grads, expert_parameters,
                                                 parallelize_experts)
from spikeguard.parallel.agreement import job_flag_point
from spikeguard.parallel.gradients import clip_grads_, sum_grads
from spikeguard.parallel.summary import RoutingMonitor, ep_summary, pipeline_summary
from spikeguard.runtime.agreement import ABORT, JobEnds, Note, agreed_text
from spikeguard.runtime.net import failure_note

GuardMaker = Callable[[nn.Module, torch.optim.Optimizer], Any]


# ---- one process, or EP / DP / DP x EP without a pipeline -------------------------------
class LocalEngine:
    """The whole model on this process (its experts sharded over `groups.ep_group` under
    EP). Each rank's loss is scaled by 1/world, so that summing gradients gives the whole
    batch's: replicated ones over every rank, expert ones over the dp replicas (the
    reverse all-to-all already summed the ep peers' contributions)."""

    eval_micro_batches = 1   # a validation batch is one micro-batch's rows
    guards_before_first_forward = False

    def __init__(self, model: nn.Module, family, groups=None, *, grad_clip: float = 1.0,
                 skew_target: Optional[Callable[[int], tuple]] = None):
        self.model, self.family, self.groups = model, family, groups
        self.grad_clip, self.skew_target = grad_clip, skew_target
        world = groups.layout.nproc if groups is not None else 1
        # A family laid out by its own library (transformers' EP + FSDP2) comes sharded
        # and averages its gradients over the ranks itself.
        self.sharded = groups is not None and family.own_parallelism
        if groups is not None and groups.ep_group is not None and not self.sharded:
            parallelize_experts(model, groups.ep_group)
        self.loss_scale = 1.0 if self.sharded else 1.0 / world
        self.modules = [model]
        self.optimizers: list = []
        self.guards: list = []
        self._blocks = family.moe_blocks(model)

    # A checkpoint of the whole model keyed by global expert index reshards into another
    # EP x DP layout (spikeguard.train.checkpoint_state).
    reshardable = True

    @property
    def checkpoint_parts(self) -> list:
        """(module, optimizer) pairs a checkpoint saves of this rank."""
        return [(self.model, self.optimizers[0])]

    @staticmethod
    def tokens_per_step(mine: int) -> int:
        """The tokens a step line reports: this rank's (every rank trains as many)."""
        return mine

    def build_optimizers(self, make: Callable[[nn.Module], torch.optim.Optimizer]) -> None:
        self.optimizers = [make(self.model)]

    def attach_guards(self, make: GuardMaker) -> None:
        self.guards = [make(self.model, self.optimizers[0])]

    def step(self, batches: Sequence[tuple]) -> dict:
        model, family, M = self.model, self.family, len(batches)
        n = len(self._blocks)
        imbalance, received = [1.0] * n, [0] * n

        def micro_batches():
            sums = torch.zeros(3)
            imbalance[:], received[:] = [1.0] * n, [0] * n
            for batch in batches:
                self._before_micro_batch()
                loss, ce, aux = family.losses(model, batch)
                # Divided before backward: the accumulated gradients are the mean over
                # micro-batches (and, scaled by 1/world, over the ranks' shards).
                (loss / M * self.loss_scale).backward()
                sums += torch.stack([loss.detach(), ce.detach(), aux.detach()])
                # A spike is a property of one micro-batch (that is what memory sees): a
                # layer's imbalance for the step is its worst micro-batch.
                for i, counts in enumerate(self._micro_batch_counts()):
                    imbalance[i] = max(imbalance[i], expert_imbalance(counts))
                    received[i] = max(received[i], int(sum(counts)))
            return sums

        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        sums = _guarded(self.guards[0], micro_batches) if self.guards else micro_batches()
        # The reduction and the clipping on the device too (their temporaries count).
        on_device = getattr(self.guards[0], "on_device", None) if self.guards else None
        with on_device() if on_device is not None else contextlib.nullcontext():
            if self.groups is not None and not self.sharded:
                self._reduce_grads()
            grad_norm = self._clip_sharded() if self.sharded else self._clip()
        optimizer_steps(self.optimizers, self.guards)
        loss, ce, aux = (sums / M).tolist()
        out = {"loss": loss, "ce_loss": ce, "aux_loss": aux, "grad_norm": grad_norm}
        if self.guards:   # the loop's keys win over the guard's record: the whole step's
            out["peak_bytes"] = whole_step_peak(self.guards[0])
        if self._blocks:
            out.update(imbalance=max(imbalance), imbalance_per_layer=list(imbalance),
                       _received_per_layer=list(received))
        elif self.guards:
            last = self.guards[0].history[-1]
            out["imbalance"] = last.get("max_imbalance", 1.0)
            # The rows this rank's experts received per layer (under transformers' EP, the
            # window's counts are the received rows).
            out["_received_per_layer"] = last.get("received_per_layer", [])
        return out

    def _before_micro_batch(self) -> None:
        """Before each micro-batch's forward (a family that counts by difference)."""

    def _micro_batch_counts(self) -> list:
        """Per MoE layer (`self._blocks`), the tokens routed to each expert by the
        micro-batch that just ran its forward."""
        return [block.last_tokens_per_expert for block in self._blocks]

    def _reduce_grads(self) -> None:
        allreduce_replicated_grads(self.model, dist.group.WORLD)
        if self.groups.dp_group is not None:
            sum_grads(expert_parameters(self.model), self.groups.dp_group)

    def _clip(self) -> float:
        """The norm of the whole model's gradient, the same on every rank: replicated
        parameters once, the sharded experts summed over their ep peers."""
        if self.groups is None or self.groups.ep_group is None:
            return clip_grads_(self.model.parameters(), self.grad_clip).item()
        experts = {id(p) for p in expert_parameters(self.model)}
        return clip_grads_(self.model.parameters(), self.grad_clip,
                           sharded=lambda p: id(p) in experts,
                           shard_group=self.groups.ep_group).item()

    def _clip_sharded(self) -> float:
        """The whole model's gradient norm when every rank holds disjoint shards of it
        (FSDP2 over all ranks, experts whole on their EP rank): one sum over the world."""
        return clip_grads_(self.model.parameters(), self.grad_clip, sharded=lambda p: True,
                           shard_group=dist.group.WORLD).item()

    @torch.no_grad()
    def evaluate(self, batches: Sequence[tuple]) -> float:
        """Mean loss (cross-entropy, without the load-balancing term) over this rank's
        validation batches."""
        was_training = self.model.training
        self.model.eval()
        try:
            losses = [self.family.eval_loss(self.model, b) for b in batches]
        finally:
            self.model.train(was_training)
        return torch.stack(losses).mean().item()

    def summarize(self, record: dict, step: int) -> dict:
        received = record.pop("_received_per_layer", None)
        if self.groups is None:
            return {}
        target = self.skew_target(step) if self.skew_target is not None else None
        return ep_summary(record, received or [], target)

    def close(self) -> None:
        for guard in self.guards:
            guard.detach()
        self.guards = []


# ---- a pipeline rank -------------------------------------------------------------------
class PipelineEngine:
    """One rank of a pipeline (spikeguard.parallel.pipeline_training.PipelineRank): its
    stage module(s), one optimizer and one guard per module (interleaved: two, each with
    half the rank's budget), the schedule over the step's M micro-batches."""

    guards_before_first_forward = True   # the schedule is built with its guards, once

    def __init__(self, prank, family, *, grad_clip: float = 1.0):
        self.prank, self.family, self.grad_clip = prank, family, grad_clip
        self.modules = list(prank.modules.stages)
        self.optimizers: list = []
        self.guards: list = []
        self._peaks: list[int] = []   # each guard's whole-step peak, of the last step
        self.monitor = RoutingMonitor(prank)
        # A validation batch goes through the schedule whole: M micro-batches' rows.
        self.eval_micro_batches = prank.micro_batches

    reshardable = False   # each rank's stages are saved apart: resumed in the same layout

    @property
    def checkpoint_parts(self) -> list:
        return list(zip(self.modules, self.optimizers))

    def tokens_per_step(self, mine: int) -> int:
        """The cluster's tokens: every data shard trains `mine`."""
        return mine * self.groups.num_shards

    @property
    def groups(self):
        return self.prank.groups

    def build_optimizers(self, make: Callable[[nn.Module], torch.optim.Optimizer]) -> None:
        self.optimizers = [make(m) for m in self.modules]

    def attach_guards(self, make: GuardMaker) -> None:
        optimizer_of = {id(m): o for m, o in zip(self.modules, self.optimizers)}
        self.guards = self.prank.attach_guards(lambda m: make(m, optimizer_of[id(m)]))

    def step(self, batches: Sequence[tuple]) -> dict:
        idx_BT = torch.cat([b[0] for b in batches])
        targets_BT = torch.cat([b[1] for b in batches])
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        self.monitor.begin_step()
        losses = self.prank.step(idx_BT, targets_BT)
        grad_norm = self.prank.clip_grad_norm_(self.grad_clip).item()
        optimizer_steps(self.optimizers, self.guards)
        self._peaks = [whole_step_peak(g) for g in self.guards]
        return {"loss": (sum(x.item() for x in losses) / len(losses)) if losses else None,
                "grad_norm": grad_norm}

    def evaluate(self, batches: Sequence[tuple]) -> float:
        """The last stages' mean loss, the same on every rank."""
        losses = []
        for idx_BT, targets_BT in batches:
            losses += [x.item() for x in self.prank.evaluate(idx_BT, targets_BT)]
        mine = sum(losses) / len(losses) if losses else None
        everyone: list = [None] * self.groups.layout.nproc
        dist.all_gather_object(everyone, mine)
        values = [v for v in everyone if v is not None]
        return sum(values) / len(values)

    def summarize(self, record: dict, step: int) -> dict:
        return pipeline_summary(self.prank, self.guards, self.monitor, record, self._peaks)

    def close(self) -> None:
        self.monitor.close()
        self.prank.close()
        self.guards = []


def whole_step_peak(guard) -> int:
    """The device's peak over the whole step just run: the guard's record of it (every
    attempt, closed before the optimizer step) and its device's since (the gradient
    reduction and clip, the optimizer step, AdamW's temporaries: the device's whole count,
    as the benches take it). A stand-in guard without a device: its record's."""
    recorded = guard.history[-1]["peak_bytes"] if guard.history else 0
    meter = getattr(guard, "meter", None)
    return max(recorded, meter.peak()) if meter is not None else recorded


def optimizer_steps(optimizers, guards) -> None:
    """Each optimizer's step (on the device through the guard's step hooks). The device
    refuses inside it as a GPU does, at the allocation: the update is half applied and not
    re-runnable, so the run ends here. On several processes every rank then makes one flag
    point over the job (an optimizer step makes no collective, so every rank reaches it),
    and every rank ends with the same line naming the rank that ran out; alone, the one
    line names the optimizer step."""
    oom = None
    for opt in optimizers:
        try:
            opt.step()
        except torch.OutOfMemoryError as err:
            if not guards or not hasattr(guards[0], "device_oom"):
                raise
            oom = guards[0].device_oom(err)
            oom.__context__ = None
            break
    if guards and hasattr(guards[0], "device_oom"):
        ended = _agreed_after_optimizers(guards[0], oom)
        if ended is not None:
            raise ended
    if oom is not None:
        raise oom


def _agreed_after_optimizers(guard, oom) -> Optional[Exception]:
    """The flag point after the optimizer steps: the job's agreed end if any rank's ran
    out (None on one process: `oom` stands as it is)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    note = (failure_note(guard, ABORT, oom, dist.get_rank()) if oom is not None else Note())
    notes = job_flag_point(note, guard.device)
    if not notes:
        return None
    ended = JobEnds(notes, f"{agreed_text(notes)}; the update may be half applied, so the "
                           "run ends")
    ended.budget_bytes = guard.budget_bytes
    return ended


def _guarded(guard, micro_batches):
    """The step under the guard: its safety net reaches backward (`run_step`); a guard
    without one (a test's stand-in) opens its forward-only step scope."""
    if hasattr(guard, "run_step"):
        return guard.run_step(micro_batches)
    with guard.step():
        return micro_batches()
