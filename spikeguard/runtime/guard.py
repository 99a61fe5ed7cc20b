"""The guard: the public API that attaches spikeguard to a model.

    guard = spikeguard.attach(model, budget="2GiB", policy="adaptive", optimizer=opt)
    # optimizer: one, a list (several share the model's parameters out), or None; each
    # one's step runs on the device through its own step hooks (runtime/wiring.py)
    def step():
        for micro_batch in batches:
            model(micro_batch.x, micro_batch.y).loss.backward()
    guard.run_step(step)   # or `with guard.step(): step()`, whose net reaches forward only
    guard.history[-1]      # peak_bytes (the device's true peak), budget_bytes, decisions, ...
    with torch.no_grad():  # evaluation: outside a step, a forward with gradients is refused
        model(x)
    with guard.unguarded():   # ... unless said so: the model's own forward, nothing counted
        model(x).loss.backward()
    guard.detach()

The device is the allocator's (spikeguard.memory.device): on CPU an emulated one that counts every
live storage. Every forward of the model is one micro-batch. The guard is composed of named parts,
each in its own file (runtime/, plan/, memory/: the arguments, wiring, ledger, cost model, planner,
forecast, layer peaks, tracker, offload engine, executor, hookless layers, position, decision
window, safety nets, memory snapshots); it wires them to the model and owns the step's life cycle.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Callable, Optional

import torch
from torch import nn

from spikeguard.errors import DeviceOutOfMemory, UsageError
from spikeguard.runtime.adapter import find_adapter
from spikeguard.memory.ledger import Ledger, storage_key
from spikeguard.memory.snapshot import memory_snapshots
from spikeguard.memory.static import StaticWalk, optimizer_state_bytes
from spikeguard.plan.cost import CostModel
from spikeguard.plan.forecast import Forecast
from spikeguard.runtime.calm_forward import CalmForwards, seams_replaced
from spikeguard.runtime.fsdp import model_fsdp_bytes, reset_after_failed_attempt
from spikeguard.runtime.doors import net_door, window_door
from spikeguard.runtime.device_state import (
    HEAD_LAYER, PHASE_FORWARD, PHASE_IDLE, PHASE_NAMES, PHASE_OPTIMIZER, GradSnapshot,
    decode_where, move_state_to_device, resolve_budget)
from spikeguard.runtime import learned
from spikeguard.runtime.executor import ExpertPathExecutor
from spikeguard.runtime.grads import GradsToCome
from spikeguard.runtime.history import StepRecorder
from spikeguard.runtime.hookless import HooklessLayers
from spikeguard.runtime.hooks import Context, SavedTensorTracker
from spikeguard.runtime.layers import GuardedLayers
from spikeguard.plan.layer_room import LayerRoom
from spikeguard.runtime.layer_room import LayerPeaks, expert_weight_grads, head_logit_bytes
from spikeguard.runtime.net import MicroBatchNet, num_tokens
from spikeguard.runtime.offload import OffloadEngine
from spikeguard.runtime.position import Position, forget_aux_loss
from spikeguard.runtime.step import run_steps, step_context
from spikeguard.runtime.window import DecisionWindow
from spikeguard.runtime.guard_arguments import (
    Optimizers, OptimizerParameters, as_optimizers, attached_guard, check_arguments, mark_attached)
from spikeguard.runtime.wiring import ModelWiring

def attach(model: nn.Module, budget=None, policy: str = "adaptive",
           optimizer: Optimizers = None, shared_policy: str = "keep",
           memory_snapshot=None, adapters: tuple = ()) -> "Guard":
    """Attach a guard to a model with MoE blocks (the module docstring). `optimizer`: one,
    a list (several share the parameters out) or None; `memory_snapshot`: a folder for a
    snapshot of each out-of-memory (spikeguard.memory.snapshot); `adapters`: the block
    adapters to try (spikeguard.integrations.ADAPTERS, which `spikeguard.attach` gives)."""
    return Guard(model, budget=budget, policy=policy, optimizer=optimizer,
                 shared_policy=shared_policy, memory_snapshot=memory_snapshot,
                 adapters=adapters)


class Guard:
    """Keeps one model's training under a device memory budget."""

    def __init__(self, model: nn.Module, *, budget=None, policy: str = "adaptive",
                 optimizer: Optimizers = None, shared_policy: str = "keep",
                 memory_snapshot=None, adapters: tuple = ()):
        check_arguments(model, optimizer, policy, shared_policy, memory_snapshot)
        # The blocks, found by the adapter of their family (spikeguard.integrations).
        self.adapter = find_adapter(model, adapters)
        self.moe_blocks = self.adapter.blocks
        self.model = model
        self.policy = policy
        self.device = next(model.parameters()).device
        # The expert-parallel group, if parallelize_experts() was applied before attach.
        self.group = self.adapter.group()
        self.budget_bytes = resolve_budget(budget, self.device)
        self.ledger = Ledger(self.budget_bytes, self.device)
        self.meter = self.ledger.meter   # the device: its figure is the truth
        self.snapshots = memory_snapshots(memory_snapshot, self.meter, self.budget_bytes)
        self.optimizer = optimizer   # as given to attach
        self.optimizers = as_optimizers(optimizer)
        move_state_to_device(self.model, self.optimizers, self.meter)
        # Each optimizer's state from its own parameters (several share the model out).
        self.static_walk = StaticWalk(self.model, self.optimizers, lambda o: optimizer_state_bytes(
            OptimizerParameters(o), o)[0])
        self.ctx = Context()
        self.position = Position(self.ctx, self.meter, len(self.moe_blocks), self.budget_bytes)
        self.cost = CostModel()
        self.engine = OffloadEngine(self.ledger, self.device, self.cost.observe_copy)
        self.tracker = SavedTensorTracker(self.ledger, self.engine, self.ctx)
        self.shape = self.adapter.byte_model(self.device)
        self.adapter.calibrate(self.cost, self.shape, self.device)
        self.planner = self.adapter.planner(self.shape, self.cost)
        self.forecast = self._make_forecast()
        self.executor = ExpertPathExecutor(self.ledger, self.ctx, self.cost.observe)
        self.layer_room = LayerPeaks(LayerRoom.from_shape(
            self.shape.bytes_per_token(), head_logit_bytes(model),
            expert_weight_grads(self.moe_blocks)), len(self.moe_blocks),
            model_fsdp_bytes(model, self.adapter, self.moe_blocks), head_logit_bytes(model))
        self.window = DecisionWindow(
            policy=policy, budget_bytes=self.budget_bytes, ledger=self.ledger,
            planner=self.planner, shape=self.shape, ctx=self.ctx, tracker=self.tracker,
            engine=self.engine, forecast=self.forecast, layer_room=self.layer_room,
            num_layers=len(self.moe_blocks), on_cuda=self.device.type == "cuda",
            recorder=lambda: self._recorder, exchange_rows=self._exchange_rows())
        self.engine.on_reload = (   # a host copy came back: the open step counts it
            lambda n, where: self._recorder is not None and self._recorder.note_reload(n, where))
        self.hookless = HooklessLayers(
            self.window, self.tracker, self.ledger, self.shape, exact_routing=self.group is None,
            last_layer=max(self.adapter.layer_index(b) for b in self.moe_blocks))
        agreement = self.adapter.agreement()   # None without a group: a rank decides alone
        if agreement is not None:
            agreement.device = self.device
        self.layers = GuardedLayers(
            self.adapter, self.moe_blocks, self.position, self.window, self.ledger, self.hookless,
            policy == "full", agreement if self.adapter.layer_fallback_agreed else None)
        self.layers.agree_at_attach(policy)
        self.calm = CalmForwards(self.hookless, self.position,
                                 lambda: not seams_replaced(self, self.planner, self.window))
        # Whether some rank of the group is adaptive (then any rank may have to re-run a
        # step its peer failed, and keeps the gradients to put back); every rank attaches.
        self.group_adaptive = (agreement.any_rank(policy == "adaptive")
                               if agreement is not None else policy == "adaptive")
        self.net = MicroBatchNet(net_door(self), agreement)
        self.window_door = window_door(self)   # what the adapters' windows use (doors.py)
        self.history: list[dict] = []
        self._recorder: Optional[StepRecorder] = None
        self._unguarded = 0   # depth of `with guard.unguarded():`
        self.grads = GradsToCome([p for p in model.parameters() if p.requires_grad],
                                 self.adapter, self.moe_blocks)
        self.wiring = ModelWiring(self)   # runtime/wiring.py
        mark_attached(self.model, self)
        self.wiring.install(self._guarded_forward)
        # Shared experts and dense layers: a static policy, set once ("keep" or "recompute").
        self.recomputed_modules = self.adapter.apply_shared_policy(shared_policy, self)
        self.ledger.set_static(self._static_bytes())

    def _make_forecast(self) -> Forecast:
        shared = self.adapter.shared_modules(self.moe_blocks[0])
        # Under EP: rows back from the reverse all-to-all and their weighted copy, plus weights.
        b = self.shape.elem_bytes
        combine = (self.adapter.top_k() * (2 * self.shape.d_model * b + b)
                   if self.group is not None else 0.0)
        return Forecast.for_model(self.model, len(self.moe_blocks), shared[0] if shared else None,
                                  2 * head_logit_bytes(self.model), combine)

    def _exchange_rows(self) -> tuple[int, ...]:
        """Under EP, the dispatch exchange's rows the window measures in no growth and the
        entry knows of: sent per token (top-k rows); see the adapter (the received rows
        are made room for at the dispatch, window.make_room_for_dispatch)."""
        if self.group is None or not self.adapter.exchange_freed_before_window:
            return ()
        return (self.adapter.top_k() * self.shape.d_model * self.shape.elem_bytes,)

    # ---- life cycle -------------------------------------------------------------------
    def _static_bytes(self) -> int:
        num_bytes, self.tracker.static_keys = self.static_walk.read(storage_key)
        return num_bytes

    def detach(self) -> None:
        """Remove every hook and wrapper: the model computes exactly as before attach."""
        if not self.attached:
            raise UsageError("this guard is not attached (detach() was already called)")
        self.wiring.remove(self.recomputed_modules)
        mark_attached(self.model, None)
        # Nothing of the guard outlives it: a block's aux loss holds a graph whose tensor
        # hooks are the guard's; the host pool is pinned memory on CUDA.
        self.free_attempt()
        self.engine.pool.clear()
        self.snapshots.stop()
        self.meter.close()

    def state_dict(self) -> dict:   # for a checkpoint: what it learned (runtime/learned.py)
        return learned.state_of(self)

    def load_state_dict(self, state: dict) -> None:   # a resumed run starts warm
        learned.load_into(self, state)

    @property
    def attached(self) -> bool:   # the model still carries this guard (no detach())
        return attached_guard(self.model) is self

    def step(self):
        """One optimizer step: all micro-batches' forward and backward run inside.

        The safety net of this form reaches forward only (a context manager cannot re-run
        its own body): an out-of-memory error in backward ends the step. `run_step(fn)`
        owns the step's body and re-runs it whole when anything in it runs out."""
        return step_context(self)

    @property
    def full_recompute(self) -> bool:
        """Every layer recomputed whole (policy "full", or a safety-net re-run)."""
        return self.layers.full_recompute

    def recompute_whole(self, on: bool) -> None:
        """Every layer recomputed whole from now (a safety net's re-run), or no longer."""
        self.layers.full_recompute = on

    @property
    def recorder(self) -> Optional[StepRecorder]:
        """The open step's recorder (None outside a step): what history's next record says."""
        return self._recorder

    @property
    def in_forward(self) -> bool:
        """Inside a guarded micro-batch's forward (not backward's recompute, not evaluation)."""
        return self.position.in_forward

    @property
    def in_full_region(self) -> bool:   # inside a whole-layer checkpoint: recomputed already
        return self.layers.in_full_region

    def micro_batch_index(self) -> Optional[int]:
        """The number the next forward of the open step gets (None outside a step)."""
        return self._recorder.micro_batches if self._recorder is not None else None

    def run_step(self, fn: Callable[[], object], replay: Optional[Callable[[], object]] = None):
        """Run `fn()` (every micro-batch's forward and backward) as one guarded step, with
        the safety net that reaches backward (spikeguard.runtime.step). Returns fn's value.
        `replay`, where the step opens with gradients: makes them again from none (the
        earlier micro-steps of an accumulation window), so that they are not copied."""
        return run_steps([self], fn, replay=replay)

    @contextlib.contextmanager
    def step_scope(self, recorder=None):
        """The device is active and enforcing; the step's recorder is open."""
        self.ledger.set_static(self._static_bytes())
        # An optimizer step that raised left its scope open (no post hook ran): closed.
        self.wiring.optimizer_scope.close_down_to()
        # The scope notes its peak on the recorder it opened: an interrupt can leave this
        # generator to be closed by the collector later, after the guard let go of it.
        step = self._recorder = recorder or StepRecorder(self.engine.offloaded_bytes_total)
        with self.meter.active(), self.meter.enforcing():
            self.meter.reset_peak()
            self.position.set_where(PHASE_FORWARD, -1)
            try:
                yield
            finally:
                self.position.set_where(PHASE_IDLE, -1)
                step.note_peak(self.meter.peak(), self.meter.peak_where())

    def finish_step(self) -> None:
        """Close the open step: learn the layer peaks from it, append its record."""
        step = self._recorder
        if self.policy == "adaptive" and not step.reruns:
            self.layer_room.calibrate(self.meter)
        self.calm.step_done(step.peak_bytes, self.budget_bytes)
        phase, layer = decode_where(step.peak_where)
        self.history.append(step.finish(
            step=len(self.history), policy=self.policy,
            layers=[self.adapter.layer_index(b) for b in self.moe_blocks],
            peak_bytes=step.peak_bytes, budget_bytes=self.budget_bytes,
            static_bytes=self.ledger.static_bytes,
            offloaded_bytes_now=self.engine.offloaded_bytes_total,
            peak_phase=PHASE_NAMES[phase], peak_layer="head" if layer == HEAD_LAYER else layer,
            reserved_bytes=self.meter.reserved()))
        self._recorder = None

    def abandon_step(self, snapshot: GradSnapshot, failed: tuple[int, int] = (0, 0)) -> None:
        """Free everything the failed step holds on the device and put the gradients back;
        first learn from it (`failed`: where and how far a refused allocation would have
        taken the device), so that the next step does not fail the same way."""
        if self.policy == "adaptive":
            self.layer_room.calibrate(self.meter, failed)
        self.free_attempt()
        snapshot.restore()
        if self._recorder is not None:   # the step's true peak includes this attempt's
            self._recorder.note_attempt_peak(self.meter.peak(), self.meter.peak_where())
        self.meter.reset_peak()

    def free_attempt(self) -> None:
        """Free what a failed attempt at the step holds on the device: its graph, saved
        tensors and offloaded copies (the gradients are abandon_step's)."""
        self.ctx.tags.clear()
        self.calm.forget()
        for block in self.moe_blocks:
            forget_aux_loss(block)
        gc.collect()   # the failed step's graph (and its saved tensors) go with it
        # torch 2.13 keeps the nodes still queued when a backward raised, and what they saved,
        # until the next backward on this thread: one frees them (enable_grad: evaluation too).
        with self.meter.unlimited(), torch.enable_grad():   # 4 bytes, below any budget's notice
            (torch.ones((), requires_grad=True) * 1).backward()
        reset_after_failed_attempt(self.model)   # FSDP2: gathered units, iteration state
        self.ledger.clear()
        self.tracker.holders.clear()
        self.engine.end_forward()

    @contextlib.contextmanager
    def on_device(self):
        """Work outside a step that the device holds too (the gradients' reduction and
        clipping after `run_step`): active and enforcing; an out-of-memory is one line."""
        with self.meter.active(), self.meter.enforcing():
            previous = self.position.set_where(PHASE_OPTIMIZER, -1)
            try:
                yield self
            except torch.OutOfMemoryError as err:
                raise self.device_oom(err) from None
            finally:
                self.meter.set_where(previous)

    def device_oom(self, err: BaseException) -> DeviceOutOfMemory:
        """`err` as the one-line DeviceOutOfMemory that names where the device ran out
        (and its memory snapshot written, if asked for: once per refusal)."""
        oom = self.position.device_oom(err)
        self.snapshots.taken(err, oom, len(self.history), self.ledger.attribution)
        return oom

    # ---- forward: one call is one micro-batch -----------------------------------------
    def _guarded_forward(self, orig_forward, *args, **kwargs):
        if self._unguarded and self._recorder is None:
            self.position.plain = True   # no recompute follows: the aux losses are read
            try:
                return orig_forward(*args, **kwargs)
            finally:
                self.position.plain = False
        with self.meter.active(), self.meter.enforcing():
            if not torch.is_grad_enabled():
                return orig_forward(*args, **kwargs)
            if self._recorder is None:
                raise UsageError(
                    "a forward with gradients outside guard.step() / guard.run_step() would "
                    "run unguarded: train inside a step; evaluate under torch.no_grad(), or "
                    "under `with guard.unguarded():` where gradients are wanted")
            return self.net.forward(orig_forward, args, kwargs)

    @contextlib.contextmanager
    def unguarded(self):
        """Forwards outside a step run as the model's own, gradients or not, with nothing
        planned or counted (evaluation that needs gradients; a probe). Inside a step the
        guard still guards."""
        self._unguarded += 1
        try:
            yield self
        finally:
            self._unguarded -= 1

    def forward_micro_batch(self, orig_forward, mb: int, args, kwargs):
        """One attempt at micro-batch `mb`'s forward (the net decides what to do with it)."""
        self.ctx.micro_batch, self.ctx.layer, self.ctx.op = mb, -1, "embed"
        self.tracker.forget_micro_batch(mb)  # stale holders of the last step's micro-batch
        self.hookless.forget_micro_batch(mb)  # ... and what it modelled
        self.window.begin_micro_batch(num_tokens(args, kwargs), self.grads.by_layer())
        if self._recorder is not None:
            self._recorder.begin_attempt()
        if self.policy == "adaptive":  # static policies never rank plans
            self.planner.refresh()
        self.position.in_forward = True
        try:
            with self.calm.forward(args, kwargs, self.full_recompute):
                out = orig_forward(*args, **kwargs)
        finally:
            self.position.in_forward = False
        self.engine.end_forward()
        self.ctx.tags.clear()
        self.position.at_head_backward()
        if not self.calm.ran_calm:   # a calm forward teaches nothing new (calm_forward.py)
            self.window.observe_forward(mb, out, num_tokens(args, kwargs),
                                        [self.adapter.layer_index(b) for b in self.moe_blocks])
        if self._recorder is not None:
            self._recorder.end_attempt()
        return out

    def abandon_micro_batch(self, mb: int) -> None:
        """Forget a failed forward of `mb`: its graph, and what the ledger attributed to it."""
        self.ctx.tags.clear()
        for block in self.moe_blocks:   # its graph reaches back through the whole forward
            forget_aux_loss(block)
        gc.collect()  # the failed forward's graph holds ledger entries until collected
        self.calm.forget()
        for key in self.ledger.entries_of(mb):
            self.ledger.drop(key)
        self.tracker.forget_micro_batch(mb)

    # ---- the decision window ----------------------------------------------------------
    def decide(self, layer: int, num_routed: int):
        """The window's plan for this layer's `num_routed` copies (the adapters call this
        seam, so a test may replace it on one guard)."""
        return self.window.decide(layer, num_routed)

    def record_plan(self, layer: int, counts: list[int], plan) -> None:
        """Count a layer's plan in the open step's record (`plan.actions`)."""
        if self._recorder is not None:
            self._recorder.record_plan(layer, counts, plan.actions)
