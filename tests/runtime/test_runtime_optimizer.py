"""The optimizer under the guard: its step runs on the device through the optimizer's own
step hooks, so what is built on the optimizer after attach keeps working (torch's LR
schedulers, the user's step hooks), with several parameter groups or several optimizers
per model; an out-of-memory in the step is one line, and leaves nothing open.

    .venv/bin/python -m pytest tests/runtime/test_runtime_optimizer.py -q
"""

from __future__ import annotations

import pytest
import torch

import spikeguard
from spikeguard.model import build_model, model_config

pytestmark = pytest.mark.timeout(120)

CFG = model_config("tiny")


def _tokens(batch: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, CFG.vocab_size, (batch, CFG.seq_len + 1), generator=gen)


def _train(model, guard, optimizers, steps: int = 2, scheduler=None) -> None:
    for i in range(steps):
        tokens = _tokens(2, seed=i)
        fn = lambda: model(tokens[:, :-1], tokens[:, 1:]).loss.backward()  # noqa: E731
        guard.run_step(fn) if guard is not None else fn()
        for opt in optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
        if scheduler is not None:
            scheduler.step()


def _param_bytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


@pytest.mark.parametrize("make", [
    lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5),
    lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step)),
], ids=["StepLR", "LambdaLR"])
def test_an_lr_scheduler_built_after_attach_steps_and_changes_the_lr(make):
    model = build_model(CFG, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = spikeguard.attach(model, budget="1GiB", policy="adaptive", optimizer=opt)
    scheduler = make(opt)   # before the fix: 'functools.partial' has no attribute '__func__'
    _train(model, guard, [opt], steps=2, scheduler=scheduler)
    expected = 1e-3 * 0.25 if isinstance(scheduler, torch.optim.lr_scheduler.StepLR) else 1e-3 / 3
    assert opt.param_groups[0]["lr"] == pytest.approx(expected)
    assert scheduler.last_epoch == 2 and len(guard.history) == 2
    guard.detach()
    assert getattr(opt.step, "_wrapped_by_lr_sched", False)   # detach leaves the scheduler's
    _train(model, None, [opt], steps=1, scheduler=scheduler)   # and it still runs
    assert scheduler.last_epoch == 3


def test_the_users_step_hooks_run_and_the_step_is_on_the_device():
    model = build_model(CFG, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    calls = []
    opt.register_step_pre_hook(lambda o, a, k: calls.append("pre, before attach"))
    guard = spikeguard.attach(model, budget="1GiB", policy="none", optimizer=opt)
    opt.register_step_pre_hook(lambda o, a, k: calls.append(
        ("pre", guard.meter.allocated())))
    opt.register_step_post_hook(lambda o, a, k: calls.append(("post", None)))
    before = guard.meter.allocated()
    _train(model, guard, [opt], steps=1)
    assert calls[0] == "pre, before attach" and calls[1][0] == "pre" and calls[2][0] == "post"
    # The moments AdamW made in its first step are on the device (and its step counters).
    moments = 2 * _param_bytes(model.parameters())
    assert guard.meter.allocated() - before >= moments
    guard.detach()
    assert len(opt._optimizer_step_pre_hooks) == 2 and len(opt._optimizer_step_post_hooks) == 1
    calls.clear()
    opt.step()   # after detach: the user's hooks alone, off the device
    assert [c if isinstance(c, str) else c[0] for c in calls] == [
        "pre, before attach", "pre", "post"]


def test_several_param_groups_are_moved_counted_and_stepped():
    model = build_model(CFG, seed=0)
    params = list(model.parameters())
    opt = torch.optim.AdamW([{"params": params[::2], "lr": 1e-3},
                             {"params": params[1::2], "lr": 1e-2, "weight_decay": 0.0}])
    _train(model, None, [opt], steps=1)   # its moments exist before attach
    guard = spikeguard.attach(model, budget="1GiB", policy="adaptive", optimizer=opt)
    state = [t for s in opt.state.values() for t in s.values() if t.dim() > 0]
    assert len(state) == 2 * len(params)
    # Every moment of both groups was moved onto the device at attach (no gradients yet).
    assert guard.meter.allocated() >= _param_bytes(params) + _param_bytes(state)
    assert guard.ledger.static_bytes == 4 * _param_bytes(params)
    _train(model, guard, [opt], steps=2)
    assert [g["lr"] for g in opt.param_groups] == [1e-3, 1e-2]
    guard.detach()


def test_several_optimizers_on_one_model():
    model = build_model(CFG, seed=0)
    params = list(model.parameters())
    adamw = torch.optim.AdamW(params[::2], lr=1e-3)
    sgd = torch.optim.SGD(params[1::2], lr=1e-2, momentum=0.9)
    guard = spikeguard.attach(model, budget="1GiB", policy="adaptive", optimizer=[adamw, sgd])
    assert guard.optimizers == (adamw, sgd)
    # Parameters + gradients, AdamW's two moments of its half, SGD's momentum of its own.
    assert guard.ledger.static_bytes == (2 * _param_bytes(params) + 2 * _param_bytes(params[::2])
                                         + _param_bytes(params[1::2]))
    before = guard.meter.allocated()
    _train(model, guard, [adamw, sgd], steps=2)
    # Both steps ran on the device: the state each made is counted there.
    grown = guard.meter.allocated() - before
    assert grown >= 2 * _param_bytes(params[::2]) + _param_bytes(params[1::2])
    guard.detach()
    assert not adamw._optimizer_step_pre_hooks and not sgd._optimizer_step_post_hooks


def test_one_optimizer_under_two_guards_is_refused():
    model, other = build_model(CFG, seed=0), build_model(CFG, seed=1)
    opt = torch.optim.AdamW(list(model.parameters()) + list(other.parameters()))
    guard = spikeguard.attach(model, budget="1GiB", policy="none", optimizer=opt)
    with pytest.raises(spikeguard.UsageError, match="another attached guard"):
        spikeguard.attach(other, budget="1GiB", policy="none", optimizer=opt)
    guard.detach()
    spikeguard.attach(other, budget="1GiB", policy="none", optimizer=opt).detach()


def test_a_wrong_optimizer_argument_is_one_line():
    model = build_model(CFG, seed=0)
    with pytest.raises(spikeguard.UsageError, match="optimizer must be"):
        spikeguard.attach(model, budget="1GiB", optimizer=[torch.optim.SGD(model.parameters()),
                                                          "adamw"])


def test_an_out_of_memory_in_the_optimizer_step_is_refused_at_the_allocation():
    """As on CUDA: the device refuses inside the step (nothing counted past the budget),
    torch's own OutOfMemoryError comes out of `step()`, the training loop's
    `optimizer_steps` makes it one line naming the optimizer step, and the scope the post
    hook could not close is closed by the guard's next step (nothing counted after)."""
    from spikeguard.train.engines import optimizer_steps

    model = build_model(CFG, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    probe = spikeguard.attach(model, budget="1GiB", policy="none", optimizer=opt)
    _train(model, probe, [], steps=1)
    step_peak = probe.history[-1]["peak_bytes"]
    probe.detach()
    model.zero_grad(set_to_none=True)
    # Room for the step, not for AdamW's moments (two copies of the parameters, 395 KiB)
    # that its first step makes.
    budget = step_peak + 64 * 1024
    guard = spikeguard.attach(model, budget=budget, policy="none", optimizer=opt)
    tokens = _tokens(2, seed=0)
    guard.run_step(lambda: model(tokens[:, :-1], tokens[:, 1:]).loss.backward())
    with pytest.raises(spikeguard.DeviceOutOfMemory) as info:
        optimizer_steps([opt], [guard])
    message = str(info.value)
    assert message.startswith("the optimizer step: ") and "\n" not in message, message
    assert "would put" in message, message
    assert guard.meter.peak() <= budget          # refused, never counted past the limit
    guard.run_step(lambda: None)                 # the guard's next step closes the scope
    on_device = guard.meter.allocated()
    big = torch.ones(step_peak // 4, dtype=torch.float32)
    assert guard.meter.allocated() == on_device   # the host allocates freely, uncounted
    del big
    guard.detach()


def test_an_optimizer_step_inside_the_guarded_step_runs_in_the_steps_scope():
    model = build_model(CFG, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = spikeguard.attach(model, budget="1GiB", policy="adaptive", optimizer=opt)
    tokens = _tokens(2, seed=0)

    def step():
        model(tokens[:, :-1], tokens[:, 1:]).loss.backward()
        opt.step()

    guard.run_step(step)
    assert len(guard.history) == 1 and opt.state   # the moments exist, made in the step
    # The step's peak covers the optimizer's: the moments were made on its device.
    assert guard.history[-1]["peak_bytes"] >= 4 * _param_bytes(model.parameters())
    guard.detach()


def _counted_on_device(guard) -> bool:
    """Whether a host allocation now lands on the guard's device (its scope is open)."""
    before = guard.meter.allocated()
    t = torch.ones(1 << 16)
    counted = guard.meter.allocated() >= before + t.nbytes
    del t
    return counted


@pytest.mark.parametrize("then", ["next step", "detach"])
def test_a_step_that_raised_otherwise_has_its_scope_closed_by_the_next_step_or_detach(then):
    model = build_model(CFG, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    guard = spikeguard.attach(model, budget="1GiB", policy="none", optimizer=opt)
    _train(model, guard, [], steps=1)

    def fail(o, a, k):
        raise KeyError("a user's hook")
    handle = opt.register_step_pre_hook(fail)   # after the guard's: inside its scope
    with pytest.raises(KeyError):
        opt.step()
    handle.remove()
    # No public hook sees that exception (the post hooks do not run): the scope it left
    # open is closed by the next step of this optimizer, or by detach.
    if then == "next step":
        opt.step()
        assert not _counted_on_device(guard)
        guard.detach()
    else:
        scope = guard.wiring.optimizer_scope
        assert scope.open   # the scope the raised step left
        guard.detach()
        assert not scope.open
