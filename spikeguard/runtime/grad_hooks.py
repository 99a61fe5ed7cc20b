"""Gradient hooks, one per tensor: every part of the guard that waits for a tensor's
gradient shares a single torch hook on it.

A guarded layer waits on three tensors' gradients for up to eight things (the position's
backward marks, the hookless layers' modelled bytes let go, the prefetch of the layer
below, the layer peaks' backward start, the micro-batch's backward done), and the layer's
output is the next layer's input, so two layers' waits meet on it. Each torch hook is a
Python registration (`Tensor.register_hook`: a handle, an ordered dict) and a call from
autograd's engine into Python; inside a calm step of `small` on CPU the guard's Python runs
between the model's kernels, cold in cache, and costs far more than in a loop (a device
label set measured 9-13 us there, 0.17 us in a loop). One hook per tensor calls the waits
in the order they were added, which is the order torch would have called them in.
Every wait returns nothing: the gradient is never replaced.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

_WAITS = "_spikeguard_grad_waits"


def on_grad(t: torch.Tensor, fn: Callable[[torch.Tensor], None]) -> None:
    """Call `fn(grad)` when `t`'s gradient is ready, after the waits added before on `t`.
    `t` must require a gradient (the callers check)."""
    waits = t.__dict__.get(_WAITS)
    if waits is not None:
        waits.append(fn)
        return
    waits = [fn]
    t.register_hook(functools.partial(_call_each, waits))
    setattr(t, _WAITS, waits)


def _call_each(waits: list, grad: torch.Tensor) -> None:
    for fn in waits:
        fn(grad)
