"""The guard: the public API that attaches spikeguard to a model.

    guard = spikeguard.attach(model, budget="2GiB", policy="adaptive", optimizer=opt)
    def step():
        for micro_batch in batches:
            model(micro_batch.x, micro_batch.y).loss.backward()
    guard.run_step(step)   # or `with guard.step(): step()`, whose net reaches forward only
    guard.history[-1]      # peak_bytes (the device's true peak), budget_bytes, decisions, ...
    guard.detach()

The device is the allocator's (spikeguard.memory.device): on CPU an emulated one that
counts every live storage. Every forward of the model is one micro-batch. In each MoE layer the guard's expert
runner is the decision window: the planner picks a plan from the exact routed counts, the
executor runs the expert path under it. Static policies share the same executor.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import inspect
import logging
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from spikeguard.errors import BudgetInfeasible, DeviceOutOfMemory, UsageError
from spikeguard.runtime.adapter import SHARED_POLICIES, find_adapter
from spikeguard.memory.budget import format_bytes, parse_bytes
from spikeguard.memory.ledger import Ledger, storage_key
from spikeguard.memory.static import static_bytes
from spikeguard.model.moe import MoEBlock
from spikeguard.plan.catalogue import OPS, Action, LayerPlan
from spikeguard.plan.cost import CostModel
from spikeguard.plan.forecast import Forecast, head_bytes_estimate, shared_bytes_estimate
from spikeguard.runtime.device_state import (PHASE_BACKWARD, PHASE_FORWARD, PHASE_IDLE,
                                             PHASE_NAMES, PHASE_OPTIMIZER, GradSnapshot,
                                             decode_where, move_state_to_device, oom_text,
                                             place_text, where_code)
from spikeguard.runtime.executor import ExpertPathExecutor
from spikeguard.runtime.history import StepRecorder
from spikeguard.runtime.hooks import Context, SavedTensorTracker
from spikeguard.plan.layer_room import LayerRoom
from spikeguard.runtime.layer_room import LayerPeaks, head_logit_bytes
from spikeguard.runtime.offload import OffloadEngine
from spikeguard.runtime.step import run_steps, step_context
from spikeguard.runtime.policies import POLICIES
from spikeguard.runtime.window import DecisionWindow

log = logging.getLogger("spikeguard")
CUDA_MARGIN_FRACTION = 0.05  # of capacity left to the allocator's fragmentation and NCCL
# Under "full" the whole layer is recomputed; recorded as every operator recomputed.
FULL_RECOMPUTE = LayerPlan(tuple(Action.RECOMPUTE for _ in OPS))


def attach(model: nn.Module, budget=None, policy: str = "adaptive",
           optimizer: Optional[torch.optim.Optimizer] = None,
           shared_policy: str = "keep") -> "Guard":
    """Attach a guard to a model with MoE blocks; see the module docstring."""
    return Guard(model, budget=budget, policy=policy, optimizer=optimizer,
                 shared_policy=shared_policy)


class Guard(DecisionWindow):
    """Keeps one model's training under a device memory budget."""

    def __init__(self, model: nn.Module, *, budget=None, policy: str = "adaptive",
                 optimizer: Optional[torch.optim.Optimizer] = None, shared_policy: str = "keep"):
        if not isinstance(model, nn.Module):
            raise UsageError(f"attach() needs a torch.nn.Module, got {type(model).__name__}")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise UsageError(f"optimizer must be a torch.optim.Optimizer or None, "
                             f"got {type(optimizer).__name__}")
        if policy not in POLICIES:
            raise UsageError(f"unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")
        if shared_policy not in SHARED_POLICIES:
            raise UsageError(f"unknown shared_policy {shared_policy!r}; choose one of "
                             f"{', '.join(SHARED_POLICIES)}")
        if getattr(model, "_spikeguard", None) is not None:
            raise UsageError("this model already has a spikeguard attached; detach() it first")
        # The blocks, found by the adapter of their family (spikeguard.integrations).
        self.adapter = find_adapter(model)
        self.moe_blocks = self.adapter.blocks
        self.model = model
        self.policy = policy
        self.device = next(model.parameters()).device
        # The expert-parallel group, if parallelize_experts() was applied before attach.
        self.group = self.adapter.group()
        self.budget_bytes = self._resolve_budget(budget)
        self.ledger = Ledger(self.budget_bytes, self.device)
        self.meter = self.ledger.meter   # the device: its figure is the truth
        self.optimizer = optimizer
        self._phase = PHASE_IDLE
        self._move_state_to_device()
        self.ctx = Context()
        self.cost = CostModel()
        self.engine = OffloadEngine(self.ledger, self.device, self.cost.observe_copy)
        self.tracker = SavedTensorTracker(self.ledger, self.engine, self.ctx)
        self.shape = self.adapter.byte_model(self.device)
        self.adapter.calibrate(self.cost, self.shape, self.device)
        self.planner = self.adapter.planner(self.shape, self.cost)
        shared = self.adapter.shared_modules(self.moe_blocks[0])
        self.forecast = Forecast(num_layers=len(self.moe_blocks),
                                 # what the head keeps, and its backward's gradient
                                 head_bytes_per_token=head_bytes_estimate(model)
                                 + 2 * head_logit_bytes(model),
                                 post_bytes_per_token=shared_bytes_estimate(
                                     shared[0] if shared else None))
        if self.group is not None:
            # Rows back from the reverse all-to-all and their weighted copy, plus weights.
            top_k = self.adapter.top_k()
            b = self.shape.elem_bytes
            self.forecast.combine_bytes_per_token = top_k * (2 * self.shape.d_model * b + b)
        self.executor = ExpertPathExecutor(self.ledger, self.ctx, self.cost.observe)
        self.history: list[dict] = []
        self._step: Optional[StepRecorder] = None
        self._step_defers, self._held_overflow = False, (0, 0)   # see _attempt
        self._full_recompute = policy == "full"   # new layers start fully recomputed
        self._in_full_region = False                # inside a whole-layer checkpoint
        self._in_forward = False                    # False during backward's recompute
        self._max_routed = 0                        # largest routed count this micro-batch
        self._mb_tokens = 0
        self._layer_bytes_per_token = 0.0           # attention part, measured (max seen)
        self._routed_per_token = 0.0                # routed copies per token (max seen)
        self._handles: list = []
        self._trained = [p for p in model.parameters() if p.requires_grad]
        self._grads_to_come = 0
        self._layer_entry_in_use = 0
        # Micro-batch -> its predicted backward working set, until its backward is done
        # (a pipeline holds several micro-batches; see plan/room.py).
        self._pending_backward: dict[int, int] = {}
        self.layer_room = LayerPeaks(LayerRoom.from_shape(self.shape.bytes_per_token(),
                                                          head_logit_bytes(model)),
                                     len(self.moe_blocks))
        self._install()
        # Shared experts and dense layers: a static policy, set once ("keep" or "recompute").
        self._recomputed_modules = self.adapter.apply_shared_policy(shared_policy, self)
        self.ledger.set_static(self._static_bytes())

    # ---- life cycle -------------------------------------------------------------------
    def _resolve_budget(self, budget) -> int:
        if budget is not None:
            return parse_bytes(budget)
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            return int(total * (1 - CUDA_MARGIN_FRACTION))
        raise UsageError("on CPU there is no device memory to measure: give a budget "
                         "(e.g. budget='512MiB'); the CPU allocator emulates a device of that size")

    def _static_bytes(self) -> int:
        self.tracker.static_keys = {storage_key(p) for p in self.model.parameters()}
        return static_bytes(self.model, self.optimizer)

    def _move_state_to_device(self) -> None:
        move_state_to_device(self.model, self.optimizer, self.meter)

    def _install(self) -> None:
        self.model._spikeguard = self
        self._orig_forward = self.model.forward
        self.model.forward = functools.partial(self._guarded_forward, self._orig_forward)
        self._wrapped_layers = []
        # Keep the signature visible (transformers' Trainer reads forward's parameters).
        self.model.forward.__signature__ = inspect.signature(self._orig_forward)
        for block in self.moe_blocks:
            self.adapter.install(block, self)
            layer = self.adapter.parent_layer(block)
            self._wrapped_layers.append(layer)
            layer.forward = functools.partial(self._layer_forward, layer, layer.forward,
                                              self.adapter.layer_index(block))
            self._handles.append(block.register_forward_pre_hook(self._enter_moe))
            for shared in self.adapter.shared_modules(block):
                self._handles.append(shared.register_forward_pre_hook(self._enter_shared))
            self._handles.append(block.register_forward_hook(self._leave_moe))
        last = self._wrapped_layers[-1]
        self._handles.append(last.register_forward_hook(self._enter_head))
        if self.optimizer is not None:
            # The optimizer step runs on the device too (its state, foreach temporaries).
            self._orig_opt_step = self.optimizer.step
            self.optimizer.step = functools.wraps(self._orig_opt_step)(
                functools.partial(self._optimizer_step, self._orig_opt_step))

    def detach(self) -> None:
        """Remove every hook and wrapper: the model computes exactly as before attach."""
        if getattr(self.model, "_spikeguard", None) is not self:
            raise UsageError("this guard is not attached (detach() was already called)")
        for handle in self._handles:
            handle.remove()
        for block in self.moe_blocks:
            self.adapter.uninstall(block)
        for module in self._wrapped_layers + self._recomputed_modules:
            del module.forward
        del self.model.forward
        if self.optimizer is not None:
            del self.optimizer.step
        self.model._spikeguard = None
        self.meter.close()

    def step(self):
        """One optimizer step: all micro-batches' forward and backward run inside.

        The safety net of this form reaches forward only (a context manager cannot re-run
        its own body): an out-of-memory error in backward ends the step. `run_step(fn)`
        owns the step's body and re-runs it whole when anything in it runs out."""
        return step_context(self)

    @property
    def full_recompute(self) -> bool:
        """Every layer recomputed whole (policy "full", or a safety-net re-run)."""
        return self._full_recompute

    @full_recompute.setter
    def full_recompute(self, on: bool) -> None:
        self._full_recompute = on

    def micro_batch_index(self) -> Optional[int]:
        """The number the next forward of the open step gets (None outside a step)."""
        return self._step.micro_batches if self._step is not None else None

    def run_step(self, fn: Callable[[], object]):
        """Run `fn()` (every micro-batch's forward and backward) as one guarded step, with
        the safety net that reaches backward (spikeguard.runtime.step). Returns fn's value."""
        return run_steps([self], fn)

    @contextlib.contextmanager
    def step_scope(self, defer: bool = False, recorder=None):
        """The device is active and enforcing; the step's recorder is open."""
        self.ledger.set_static(self._static_bytes())
        self._step = recorder or StepRecorder(self.engine.offloaded_bytes_total)
        self._step_defers, self._held_overflow = defer, (0, 0)
        with self.meter.active(), self.meter.enforcing(), self.meter.deferred(defer):
            self.meter.reset_peak()
            self._set_where(PHASE_FORWARD, -1)
            try:
                yield
            finally:
                self._set_where(PHASE_IDLE, -1)
                self._step.note_peak(self.meter.peak(), self.meter.peak_where())

    @property
    def in_full_region(self) -> bool:
        """Inside a whole-layer checkpoint: what runs there is recomputed already."""
        return self._in_full_region

    def take_step_overflow(self) -> tuple[int, int]:
        """(bytes, position code) of the furthest this deferred step went past the device,
        the device's own figure or a micro-batch's held by the net (`_attempt`); then
        forgotten. (0, 0) if it stayed under."""
        over = self.meter.take_overflow()
        mine = (over, self.meter.overflow_where()) if over else (0, 0)
        held, self._held_overflow = self._held_overflow, (0, 0)
        return max(mine, held)

    def finish_step(self) -> None:
        if self.policy == "adaptive" and not self._step.reruns:
            self.layer_room.calibrate(self.meter)
        peak, where = self._step.peak_bytes, self._step.peak_where
        phase, layer = decode_where(where)
        self.history.append(self._step.finish(
            step=len(self.history), policy=self.policy,
            layers=[self.adapter.layer_index(b) for b in self.moe_blocks], peak_bytes=peak,
            budget_bytes=self.budget_bytes, static_bytes=self.ledger.static_bytes,
            offloaded_bytes_now=self.engine.offloaded_bytes_total,
            peak_phase=PHASE_NAMES[phase], peak_layer=layer,
            reserved_bytes=self.meter.reserved()))
        self._step = None

    def abandon_step(self, snapshot: GradSnapshot, failed: tuple[int, int] = (0, 0)) -> None:
        """Free everything the failed step holds on the device and put the gradients back;
        first learn from it (`failed`: where and how far a refused allocation would have
        taken the device), so that the next step does not fail the same way."""
        if self.policy == "adaptive":
            self.layer_room.calibrate(self.meter, failed)
        self.ctx.tags.clear()
        for block in self.moe_blocks:
            _forget_aux_loss(block)
        gc.collect()   # the failed step's graph (and its saved tensors) go with it
        # torch 2.13 keeps the nodes still queued when a backward raised, and what they
        # saved, until the next backward runs on this thread: one empty backward frees them.
        (torch.ones((), requires_grad=True) * 1).backward()
        self.ledger.clear()
        self.tracker.holders.clear()
        self.engine.end_forward()
        snapshot.restore()
        self.meter.reset_peak()

    def _optimizer_step(self, orig_step, *args, **kwargs):
        """The optimizer step on the device; an out-of-memory here is not re-runnable (the
        update may be half applied), so it is reported, never retried."""
        with self.meter.active(), self.meter.enforcing():
            previous = self._set_where(PHASE_OPTIMIZER, -1)
            try:
                return orig_step(*args, **kwargs)
            except torch.OutOfMemoryError as err:
                raise self.device_oom(err) from None
            finally:
                self.meter.set_where(previous)

    def _set_where(self, phase: int, layer: int) -> int:
        self._phase = phase
        return self.meter.set_where(where_code(phase, layer, self.ctx.micro_batch))

    def device_oom(self, err: BaseException) -> DeviceOutOfMemory:
        if isinstance(err, DeviceOutOfMemory):
            return err
        place = place_text(self._phase, self.ctx.micro_batch, self.ctx.layer, self.ctx.op,
                           len(self.moe_blocks))
        asked, after = self.meter.last_refusal()
        return DeviceOutOfMemory(oom_text(place, self.meter, err), needed_bytes=after,
                                 budget_bytes=self.budget_bytes)

    # ---- forward: one call is one micro-batch -----------------------------------------
    def _guarded_forward(self, orig_forward, *args, **kwargs):
        with self.meter.active(), self.meter.enforcing():
            if not torch.is_grad_enabled():
                return orig_forward(*args, **kwargs)
            return self._guarded_micro_batch(orig_forward, args, kwargs)

    def _guarded_micro_batch(self, orig_forward, args, kwargs):
        mb = self._step.micro_batches if self._step else 0
        try:
            return self._attempt(orig_forward, mb, args, kwargs)
        except (DeviceOutOfMemory, torch.OutOfMemoryError) as err:
            if self.policy != "adaptive" or self._full_recompute:
                raise self.device_oom(err) from None
            message = str(self.device_oom(err))
        # Safety net: free this micro-batch and run it again with everything recomputed.
        self._abandon(mb)
        if self._step:
            self._step.safety_net_reruns += 1
        log.warning("micro-batch %d ran out of memory (%s); re-running it with full recompute",
                    mb, message)
        self._full_recompute = True
        try:
            return self._attempt(orig_forward, mb, args, kwargs, last_try=True)
        except (DeviceOutOfMemory, torch.OutOfMemoryError) as err:
            failure = str(self.device_oom(err))
        finally:
            self._full_recompute = False
        self._abandon(mb)
        needed = self._full_recompute_need(orig_forward, mb, args, kwargs)
        raise BudgetInfeasible(
            f"even full recompute does not fit: {failure}; try a budget of at least "
            f"{format_bytes(needed, round_up=True)}", needed_bytes=needed, budget_bytes=self.budget_bytes)

    def _attempt(self, orig_forward, mb, args, kwargs, last_try: bool = False):
        """One forward of a micro-batch. Under expert parallelism an "adaptive" rank that
        overflows finishes the forward anyway (its all-to-alls must match the others'),
        then the group agrees, one small all-reduce per micro-batch that every rank's
        guard issues whatever its policy: if any rank overflowed, every rank raises, so
        the adaptive ones take the safety net's re-run together. (A static policy that
        overflows raises at once: that is the crash a real job would have.)

        `last_try` (the net's full-recompute re-run) in a deferred step: the micro-batch
        is kept however far it went and its overflow held for the step's end, where every
        rank of the job agrees (runtime/step.py). Raising here would leave the forward on
        this expert-parallel group only: a pipeline peer outside it would go on with the
        step and meet this group's re-run in its sends and receives."""
        if self.group is None:
            return self._forward_micro_batch(orig_forward, mb, args, kwargs)
        adaptive = self.policy == "adaptive"
        self.ledger.overflow, self.ledger.defer_overflow = None, adaptive
        if self._step is not None:   # what the step reached before this attempt stands
            self._step.note_peak(self.meter.peak(), self.meter.peak_where())
        try:
            with self.meter.deferred(adaptive):
                out = self._forward_micro_batch(orig_forward, mb, args, kwargs)
        finally:
            self.ledger.defer_overflow = False
        over = self.meter.take_overflow() if adaptive else 0
        mine = self.ledger.overflow or (DeviceOutOfMemory(
            f"forward of micro-batch {mb} reached {format_bytes(over)} on a device of "
            f"{format_bytes(self.budget_bytes)}", needed_bytes=over,
            budget_bytes=self.budget_bytes) if over else None)
        flag = torch.tensor([0 if mine is None else 1], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        if flag.item() and last_try and self._step_defers:
            if mine is not None:
                reached = max(over, mine.needed_bytes or 0, self.budget_bytes + 1)
                self._held_overflow = max(self._held_overflow,
                                          (reached, self.meter.overflow_where()))
            return out
        if flag.item():
            del out
            if self._step is not None:
                # The attempt finished its forward, so it was counted: un-count it, or the
                # re-run and every later micro-batch would get the next number (and the
                # pipeline's residency would read the wrong schedule position).
                self._step.micro_batches -= 1
                self._step.decisions.subtract(self._step.attempt)
            gc.collect()
            self.meter.reset_peak()   # the refused attempt's figure is not a peak survived
            raise mine or DeviceOutOfMemory(
                "another rank of the expert-parallel group ran out of memory")
        return out

    def _full_recompute_need(self, orig_forward, mb, args, kwargs) -> int:
        """The peak this micro-batch reaches under full recompute, measured with the emulated
        budget lifted (CPU): its forward, and its backward when the output carries its loss
        (gradients restored afterwards); else the head's backward is estimated. On CUDA,
        where that cannot be tried, a quarter more than now."""
        if self.device.type == "cuda":
            return int(self.budget_bytes * 1.25)
        snapshot = GradSnapshot(self.model)
        self._full_recompute = True
        try:
            with self.meter.unlimited():
                self.meter.reset_peak()
                # Twice: the second backward accumulates into gradients that exist, the
                # peak of every micro-batch after a step's first.
                for _ in range(2):
                    out = self._forward_micro_batch(orig_forward, mb, args, kwargs)
                    loss = getattr(out, "loss", None)
                    if not (torch.is_tensor(loss) and loss.requires_grad):
                        head = self.layer_room.head_backward_per_token * _num_tokens(args, kwargs)
                        return max(self.meter.peak(), self.ledger.in_use() + int(head))
                    del out
                    loss.backward()
                    del loss
                return self.meter.peak()
        finally:
            self._full_recompute = False
            self._abandon(mb)
            snapshot.restore()

    def _forward_micro_batch(self, orig_forward, mb, args, kwargs):
        self.ctx.micro_batch, self.ctx.layer, self.ctx.op = mb, -1, "embed"
        self.tracker.forget_micro_batch(mb)  # stale holders of the last step's micro-batch
        self._max_routed = 0
        self._grads_to_come = sum(p.numel() * p.element_size() for p in self._trained
                                  if p.grad is None)
        self._mb_tokens = _num_tokens(args, kwargs)
        if self._step is not None:
            self._step.begin_attempt()
        if self.policy == "adaptive":  # static policies never rank plans
            self.planner.refresh()
        self._in_forward = True
        try:
            with self.tracker.hooks():
                out = orig_forward(*args, **kwargs)
        finally:
            self._in_forward = False
        self.engine.end_forward()
        self.ctx.tags.clear()
        # What runs next on this micro-batch is the head's backward.
        self.ctx.layer, self.ctx.op = len(self.moe_blocks), "head"
        self._set_where(PHASE_BACKWARD, len(self.moe_blocks))
        num_tokens = _num_tokens(args, kwargs)
        post = max(self.ledger.bytes_by(mb, self.adapter.layer_index(b), "shared")
                   for b in self.moe_blocks)
        # The head keeps its saved bytes until backward starts, and its backward adds the
        # logits' gradient and the softmax beside them: both are reserved as the head's.
        head = self.ledger.bytes_by(mb, len(self.moe_blocks), "head")
        self.forecast.observe(head + int(self.layer_room.head_backward_per_token * num_tokens),
                              post, num_tokens)
        # The head's backward is measured from what is in use when it starts: the loss's
        # gradient is its first (the caller may have dropped the logits by then).
        self.layer_room.record_head(mb, self.ledger.in_use(), num_tokens)
        loss = getattr(out, "loss", None)
        if torch.is_tensor(loss) and loss.requires_grad:
            loss.register_hook(functools.partial(self._head_backward_starts, mb, num_tokens))
        if self._step is not None:
            self._step.end_attempt()
        return out

    def _head_backward_starts(self, mb: int, num_tokens: int, grad) -> None:
        self.layer_room.record_head(mb, self.ledger.in_use(), num_tokens)

    def _abandon(self, mb: int) -> None:
        self.ctx.tags.clear()
        for block in self.moe_blocks:   # its graph reaches back through the whole forward
            _forget_aux_loss(block)
        gc.collect()  # the failed forward's graph holds ledger entries until collected
        for key in self.ledger.entries_of(mb):
            self.ledger.drop(key)
        self.tracker.forget_micro_batch(mb)

    def _layer_forward(self, layer, orig_forward, layer_idx, *args, **kwargs):
        if not self._in_forward:
            return self._layer_forward_body(layer, orig_forward, layer_idx, args, kwargs)
        self.ctx.layer, self.ctx.op = layer_idx, "attn"
        self._set_where(PHASE_FORWARD, layer_idx)
        self._layer_entry_in_use = self.ledger.in_use()
        if layer_idx == 0 and args and torch.is_tensor(args[0]) and args[0].requires_grad:
            # When backward reaches the first layer's input, the micro-batch's backward
            # through every guarded layer is done (recomputed whole or not).
            args[0].register_hook(functools.partial(self._backward_done, self.ctx.micro_batch))
        out = self._layer_forward_body(layer, orig_forward, layer_idx, args, kwargs)
        self._mark_backward(out, layer_idx, "combine")
        return out

    def _backward_done(self, mb: int, grad) -> None:
        self._pending_backward.pop(mb, None)

    def _mark_backward(self, t, layer: int, op: str) -> None:
        """When backward reaches `t`, the device's position becomes (backward, layer, op)."""
        t = t[0] if isinstance(t, (tuple, list)) else t
        if torch.is_tensor(t) and t.requires_grad:
            t.register_hook(functools.partial(self._enter_backward, self.ctx.micro_batch,
                                              layer, op))

    def _enter_backward(self, mb: int, layer: int, op: str, grad) -> None:
        self.ctx.micro_batch, self.ctx.layer, self.ctx.op = mb, layer, op
        self._set_where(PHASE_BACKWARD, layer)

    def _layer_forward_body(self, layer, orig_forward, layer_idx, args, kwargs):
        if torch.is_grad_enabled() and (self._full_recompute or self._layer_cannot_fit(layer_idx)):
            # The flag is set inside the checkpointed function, so backward's recompute
            # takes the same path as the forward did.
            kwargs = self.adapter.recompute_kwargs(layer, kwargs)
            return checkpoint(functools.partial(self._full_region, orig_forward, layer_idx), *args,
                              use_reentrant=False, **kwargs,
                              context_fn=functools.partial(create_selective_checkpoint_contexts,
                                                           self.adapter.layer_policy))
        return orig_forward(*args, **kwargs)

    def _full_region(self, orig_forward, layer_idx, *args, **kwargs):
        outer, self._in_full_region = self._in_full_region, True
        try:
            return orig_forward(*args, **kwargs)
        finally:
            self._in_full_region = outer
            if not self._in_forward and torch.is_grad_enabled():
                # Backward's recompute of the layer (stopped early by torch's non-reentrant
                # checkpoint, so no forward hook of the block runs): the block's aux loss
                # would keep the recomputed graph alive past backward.
                _forget_aux_loss(self.moe_blocks[layer_idx])

    def _enter_shared(self, module, args) -> None:
        if self._in_forward:
            self.ctx.tags.clear()  # combine is done: no tensor of the expert path is saved later
            self.ctx.op = "shared"

    def _enter_moe(self, block, args) -> None:
        if self._in_forward:
            self.ctx.op = "router"

    def _leave_moe(self, block, args, output) -> None:
        if self._in_forward:
            self.ctx.tags.clear()
            self.ctx.op = "attn"
        elif torch.is_grad_enabled():   # a recompute in backward re-ran the block: nothing
            _forget_aux_loss(block)     # reads its aux loss there (evaluation does)

    def _enter_head(self, module, args, output) -> None:
        if self._in_forward:
            self.ctx.layer, self.ctx.op = len(self.moe_blocks), "head"
            self._set_where(PHASE_FORWARD, len(self.moe_blocks))

    # ---- the decision window ----------------------------------------------------------
    def _run_experts(self, block: MoEBlock, dispatched) -> torch.Tensor:
        counts = dispatched.tokens_per_expert
        num_routed = dispatched.x_ND.shape[0]
        if not self._in_forward:  # evaluation under no_grad: nothing is kept, nothing to plan
            return block.experts(dispatched.x_ND, counts)
        if self._in_full_region:
            self._record(block.layer_idx, counts, FULL_RECOMPUTE)
            return block.experts(dispatched.x_ND, counts)
        decision = self.decide(block.layer_idx, num_routed)
        self._record(block.layer_idx, counts, decision.plan)
        self.executor.tag(dispatched.weight_N, "combine", Action.SAVE)
        self.executor.tag(dispatched.token_idx_N, "combine", Action.SAVE)
        y_ND = self.executor.run(block.experts, dispatched.x_ND, counts, decision.plan)
        self.ctx.op = "combine"
        self._mark_backward(y_ND, block.layer_idx, "experts")
        self._mark_backward(dispatched.x_ND, block.layer_idx, "dispatch")
        if dispatched.x_ND.requires_grad and block.layer_idx > 0:
            # When backward has passed this layer's experts, bring the layer below back.
            dispatched.x_ND.register_hook(functools.partial(
                _prefetch, self.engine, self.ctx.micro_batch, block.layer_idx - 1))
        return y_ND

    def _record(self, layer: int, counts: list[int], plan: LayerPlan) -> None:
        if self._step is not None:
            self._step.record_plan(layer, counts, plan.actions)


def _forget_aux_loss(block) -> None:
    if getattr(block, "last_aux_loss", None) is not None:
        block.last_aux_loss = None


def _prefetch(engine: OffloadEngine, micro_batch: int, layer: int, grad):
    engine.prefetch_layer(micro_batch, layer)
    return None


def _num_tokens(args, kwargs) -> int:
    """Tokens of the micro-batch: token ids (B, T), or a hidden state (B, T, D) as a
    pipeline stage after the first receives it."""
    for value in list(args) + list(kwargs.values()):
        if torch.is_tensor(value):
            if value.is_floating_point() and value.dim() >= 3:
                return value.numel() // value.shape[-1]
            return value.numel()
    return 0
