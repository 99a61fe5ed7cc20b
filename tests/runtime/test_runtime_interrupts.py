"""Ctrl-C inside a guarded step is never swallowed by a finalizer (issue 15, part 3), for
library users too: a KeyboardInterrupt raised inside a `__del__` (where Python's signal
handler runs when the signal arrives during one, e.g. while a saved tensor's `Packed` is
released in backward) is printed as "Exception ignored" and dropped by Python itself;
inside `guard.run_step` / `guard.step()` it is raised again as soon as the finalizer
returns (spikeguard.runtime.interrupts).

    .venv/bin/python -m pytest tests/runtime/test_runtime_interrupts.py -q
"""

from __future__ import annotations

import gc
import sys

import pytest
import torch

import spikeguard
from spikeguard.model import build_model, model_config

pytestmark = pytest.mark.timeout(120)

CFG = model_config("tiny")


class _InterruptedWhileFreed:
    """What a SIGINT arriving during a finalizer amounts to: the handler's
    KeyboardInterrupt raised inside `__del__`."""

    def __del__(self):
        raise KeyboardInterrupt


def _tokens() -> torch.Tensor:
    return torch.randint(0, CFG.vocab_size, (2, CFG.seq_len + 1),
                         generator=torch.Generator().manual_seed(0))


def _step(model, reached: list):
    x = _tokens()
    loss = model(x[:, :-1], x[:, 1:]).loss
    obj = _InterruptedWhileFreed()
    del obj                         # the interrupt is raised in the finalizer ...
    reached.append("after")         # ... and again here, at the first call after it
    loss.backward()


@pytest.mark.parametrize("form", ["run_step", "with step()"])
def test_an_interrupt_dropped_by_a_finalizer_is_raised_again_in_a_step(form):
    model = build_model(CFG, seed=0)
    guard = spikeguard.attach(model, budget="1GiB", policy="adaptive")
    hook = sys.unraisablehook
    reached: list = []
    with pytest.raises(KeyboardInterrupt):
        if form == "run_step":
            guard.run_step(lambda: _step(model, reached))
        else:
            with guard.step():
                _step(model, reached)
    assert reached == []
    assert sys.unraisablehook is hook            # put back as it was
    assert sys.getprofile() is None
    guard.detach()
    gc.collect()


def test_outside_a_step_python_drops_it_as_before():
    """The control: without a guarded step around it the same finalizer's interrupt is
    lost (this is what the step's hook exists for)."""
    dropped = []
    hook, sys.unraisablehook = sys.unraisablehook, lambda u: dropped.append(u.exc_type)
    try:
        reached = []
        obj = _InterruptedWhileFreed()
        del obj
        reached.append("after")
    finally:
        sys.unraisablehook = hook
    assert reached == ["after"] and dropped == [KeyboardInterrupt]


def test_a_step_scope_closed_late_by_the_collector_notes_its_own_recorder():
    """A SIGINT can leave the step scope's generator to be closed by the collector after
    the guard let go of the step (seen in CI: `'NoneType' object has no attribute
    'note_peak'` printed as "Exception ignored" under the run's one line): the scope notes
    its peak on the recorder it opened, whatever the guard holds by then."""
    guard = spikeguard.attach(build_model(CFG, seed=0), budget="1GiB", policy="adaptive")
    scope = guard.step_scope()
    scope.__enter__()
    opened = guard._recorder
    guard._recorder = None          # the guard moved on (an interrupted run's cleanup)
    scope.__exit__(None, None, None)
    assert guard._recorder is None and opened.peak_bytes >= 0   # no AttributeError above
    guard.detach()
