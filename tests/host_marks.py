"""The independent meter (tests/meter.py) beside a guard: the library's host allocations
made inside the meter's host scope, so that they count as host memory, not device bytes.

The guard makes host memory in two places: the offload pool's buffers (`HostPool.acquire`)
and the host copy of the gradients an adaptive step keeps (`GradSnapshot`). The meter uses
nothing of spikeguard's on purpose, so it cannot know them; these wrappers tell it, and the
code under test runs unchanged. One copy for every worker and test that meters a guard
(it was written out in six).

    from host_marks import host_memory_marked, metered   # tests/ on sys.path

    with meter, host_memory_marked(meter):
        guard.run_step(fn)
    with metered(model) as meter:                   # the model's state as the baseline
        guard.run_step(fn)
    meter.peak_bytes
"""

from __future__ import annotations

import contextlib

from meter import LiveMeter, model_state_tensors

from spikeguard.runtime import device_state
from spikeguard.runtime.offload import HostPool


@contextlib.contextmanager
def host_memory_marked(meter: LiveMeter):
    """While inside, the guard's host allocations are made in `meter`'s host scope."""
    acquire, snapshot_init = HostPool.acquire, device_state.GradSnapshot.__init__

    def host_acquire(self, num_bytes):
        with meter.host_scope():
            return acquire(self, num_bytes)

    def host_snapshot(self, *args, **kwargs):
        with meter.host_scope():
            return snapshot_init(self, *args, **kwargs)

    HostPool.acquire, device_state.GradSnapshot.__init__ = host_acquire, host_snapshot
    try:
        yield
    finally:
        HostPool.acquire, device_state.GradSnapshot.__init__ = acquire, snapshot_init


@contextlib.contextmanager
def metered(*modules, alive=()):
    """A LiveMeter entered with the modules' state as its baseline (a DTensor's local
    shard: the meter sees local tensors only), and the tensors `alive` from before (a
    pipeline stage's receive buffers, made at its first step), and the guard's host
    memory marked."""
    meter = LiveMeter(baseline_tensors=[getattr(t, "_local_tensor", t) for m in modules
                                        for t in model_state_tensors(m)] + list(alive))
    with host_memory_marked(meter), meter:
        yield meter
