"""Shared by the true-device tests (test_runtime_true_device*.py): data, guarded models,
the independent meter with per-phase peaks, and the fixture that marks the library's host
memory on the meter's side.

The meter (tests/meter.py) sees storages of op outputs by dispatch mode and weak
references, nothing of spikeguard's. Its baseline is taken after attach (attach
re-allocates the parameters onto the device) and it is entered around the whole step:
forward, backward and the optimizer step. Host memory is marked where the library makes
it: the offload pool (`HostPool.acquire`) and the host copy of the gradients before an
adaptive step (`GradSnapshot.__init__`) run inside `meter.host_scope()`; that instruments
the meter, the code under test runs unchanged.

B = sequences of a micro-batch; a step is a list of micro-batch sizes, e.g. [8, 16].
"""

from __future__ import annotations

import pytest
import torch

import spikeguard
from meter import LiveMeter, model_state_tensors
from spikeguard.model import build_model, model_config
from spikeguard.plan.catalogue import ALL_SAVE
from spikeguard.runtime import device_state
from spikeguard.runtime.offload import HostPool

TINY = model_config("tiny")
HUGE = 1 << 40
POLICIES = ("none", "full", "experts", "offload", "adaptive")


# ---- data and models --------------------------------------------------------------------
def batch(cfg, num_sequences: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randint(0, cfg.vocab_size, (num_sequences, cfg.seq_len), generator=gen),
            torch.randint(0, cfg.vocab_size, (num_sequences, cfg.seq_len), generator=gen))


def step_data(cfg, sizes, seed: int) -> list:
    return [batch(cfg, b, 1000 * seed + i) for i, b in enumerate(sizes)]


def guarded(cfg, policy: str, budget, optimizer: bool = True, warm=None):
    """A model of seed 0 (with `warm`'s gradients accumulated before attach, if given),
    its AdamW and an attached guard."""
    model = build_model(cfg, seed=0)
    if warm is not None:
        model(*warm).loss.backward()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3) if optimizer else None
    return model, opt, spikeguard.attach(model, budget=budget, policy=policy, optimizer=opt)


def blind_prevention(guard) -> None:
    """Disable everything that keeps a step under the budget before the device refuses:
    every layer saves everything, none is recomputed whole at its entry, no layer's own
    forward and backward peaks are checked (no eviction to host). What is left is the
    safety net, which is what the tests using it are about."""
    guard.decide = lambda layer, num_routed: guard.planner.fixed(ALL_SAVE, num_routed)
    # `decide` replaced whole, not the layer room's slopes set to 0: each step without a
    # step-level re-run calibrates them again from the device (that would undo the
    # blinding), and `decide` is where the layer's own peaks are checked and evicted for.
    guard.window.layer_cannot_fit = lambda layer: False


# ---- the meter ----------------------------------------------------------------------------
class PhaseMeter(LiveMeter):
    """LiveMeter that also keeps the peak per phase label and, optionally, the live bytes
    and label after every op (`trace`, to find where a budget is first crossed)."""

    def __init__(self, *args, trace: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.phase_peaks: dict[str, int] = {}
        self.trace = [] if trace else None

    def _add(self, num_bytes: int) -> None:
        super()._add(num_bytes)
        if self.live_bytes > self.phase_peaks.get(self.phase, 0):
            self.phase_peaks[self.phase] = self.live_bytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.trace is None:
            return super().__torch_dispatch__(func, types, args, kwargs)
        self.trace.append(None)   # an op that raises stays None: its index is where it died
        out = super().__torch_dispatch__(func, types, args, kwargs)
        self.trace[-1] = (self.live_bytes, self.phase)
        return out

    def peak_of(self, prefix: str) -> int:
        return max((v for k, v in self.phase_peaks.items() if k.startswith(prefix)), default=0)


@pytest.fixture
def host_marks(monkeypatch):
    """Route the library's host allocations through the current meter's host scope."""
    current: dict = {"meter": None}
    acquire, snapshot_init = HostPool.acquire, device_state.GradSnapshot.__init__

    def host_acquire(self, num_bytes):
        if current["meter"] is None:
            return acquire(self, num_bytes)
        with current["meter"].host_scope():
            return acquire(self, num_bytes)

    def host_snapshot(self, *args, **kwargs):
        if current["meter"] is None:
            return snapshot_init(self, *args, **kwargs)
        with current["meter"].host_scope():
            return snapshot_init(self, *args, **kwargs)

    monkeypatch.setattr(HostPool, "acquire", host_acquire)
    monkeypatch.setattr(device_state.GradSnapshot, "__init__", host_snapshot)
    return current


def step_fn(model, data, meter):
    def fn():
        for x, y in data:
            meter.phase = "forward"
            loss = model(x, y).loss
            meter.phase = "backward"
            loss.backward()
    return fn


def metered_step(host_marks, model, opt, guard, data, *, optimizer_step: bool = True,
                 meter: PhaseMeter = None) -> PhaseMeter:
    """One guarded step under a fresh meter; `meter.step_peak` is its peak before the
    optimizer step (what `history[-1]['peak_bytes']` covers), `peak_bytes` the whole."""
    meter = meter or PhaseMeter(baseline_tensors=model_state_tensors(model, opt))
    host_marks["meter"] = meter
    try:
        with meter:
            guard.run_step(step_fn(model, data, meter))
            meter.step_peak = meter.peak_bytes
            if optimizer_step:
                meter.phase = "optimizer"
                opt.step()
                opt.zero_grad(set_to_none=True)
    finally:
        host_marks["meter"] = None
    return meter


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages of `tensors` (a view counts once)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def aux_values(model) -> list:
    """Each MoE block's last aux loss: a scalar the model keeps as an attribute."""
    return [b.last_aux_loss for b in model.moe_blocks() if b.last_aux_loss is not None]


def expected_live(model, opt, *, device: bool) -> int:
    """Parameters, gradients that exist, buffers, optimizer state, the aux-loss scalars:
    the same for the device and the meter (`device` names which, for the message)."""
    tensors = [*model.parameters(), *(p.grad for p in model.parameters() if p.grad is not None)]
    if opt is not None:
        tensors += [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    tensors += list(model.buffers())
    return storage_bytes(tensors + aux_values(model))


def ceiling_steps(host_marks, cfg, steps) -> list[PhaseMeter]:
    """Policy "none" under a huge budget, one meter per step."""
    model, opt, guard = guarded(cfg, "none", HUGE)
    return [metered_step(host_marks, model, opt, guard, step_data(cfg, sizes, seed))
            for seed, sizes in enumerate(steps)]
