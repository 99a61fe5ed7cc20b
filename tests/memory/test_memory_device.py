"""The emulated device: the CPU allocator counts what an allocator counts, checked against
the tests' own meter (tests/meter.py: a dispatch mode over op outputs, nothing of
spikeguard), and refuses the allocation that passes its capacity.

    .venv/bin/python -m pytest tests/memory/test_memory_device.py -q
"""

from __future__ import annotations

import pytest
import torch

from meter import LiveMeter
from spikeguard.memory.device import EmulatedDevice, host

pytestmark = pytest.mark.timeout(120)


def _mlp_step(w1, w2, x):
    h = torch.relu(x @ w1)
    loss = (h @ w2).square().mean()
    loss.backward()


def _weights():
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(64, 256, generator=gen).requires_grad_(),
            torch.randn(256, 64, generator=gen).requires_grad_())


def test_device_peak_and_live_bytes_agree_with_the_meter_through_backward():
    device = EmulatedDevice(1 << 40)
    with device.active():
        w1, w2 = _weights()
        x = torch.randn(512, 64)
        device.reset_peak()
        with LiveMeter(baseline_tensors=[w1, w2, x]) as meter:
            _mlp_step(w1, w2, x)
        # Same storages, counted twice independently: live bytes agree exactly, peaks
        # within 2% (the meter cannot see scratch freed inside one op; the device can).
        assert device.allocated() == meter.live_bytes
        assert meter.peak_bytes <= device.peak() <= 1.02 * meter.peak_bytes
        # Backward holds the gradients beside what forward kept: above forward's end.
        assert device.peak() >= 4 * (x.numel() + 2 * w1.numel() + 512 * 256)
    device.close()


def test_host_scope_and_inactive_allocations_are_not_the_devices():
    device = EmulatedDevice(1 << 40)
    outside = torch.empty(1000)
    with device.active():
        before = device.allocated()
        with host():
            pool = torch.empty(10_000, dtype=torch.uint8)
        assert device.allocated() == before
        kept = torch.empty(250)          # 1000 bytes on the device
        assert device.allocated() == before + 1000
    del kept, outside, pool              # freed outside the scope: given back where taken
    assert device.allocated() == before
    device.close()


def test_two_devices_count_apart():
    a, b = EmulatedDevice(1 << 40), EmulatedDevice(1 << 40)
    with a.active():
        ta = torch.empty(100)
        with b.active():
            tb = torch.empty(200)
    assert (a.allocated(), b.allocated()) == (400, 800)
    del ta, tb
    assert (a.allocated(), b.allocated()) == (0, 0)
    a.close(), b.close()


@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_the_allocation_past_the_capacity_raises_out_of_memory(phase):
    w1, w2 = _weights()
    x = torch.randn(512, 64)
    probe = EmulatedDevice(1 << 40)
    with probe.active():
        probe.reset_peak()
        h = torch.relu(x @ w1)
        forward_peak = probe.peak()
        loss = (h @ w2).square().mean()
        loss.backward()
        backward_peak = probe.peak()
        del h, loss
    probe.close()
    assert backward_peak > forward_peak
    w1.grad = w2.grad = None
    # Forward: below its own peak. Backward: between the two peaks.
    capacity = forward_peak - 1 if phase == "forward" else (forward_peak + backward_peak) // 2
    device = EmulatedDevice(capacity)
    with device.active(), device.enforcing():
        with pytest.raises(torch.OutOfMemoryError) as info:
            h = torch.relu(x @ w1)
            loss = (h @ w2).square().mean()
            assert phase == "backward", "forward fitted under a capacity below its peak"
            loss.backward()
    asked, after = device.last_refusal()
    assert asked > 0 and after > capacity
    assert "would put" in str(info.value)
    assert device.peak() <= capacity     # the refused allocation was never counted
    device.close()


def test_nothing_ever_passes_the_limit_as_on_cuda():
    """No deferral exists (what CUDA's allocator cannot do, the emulation does not offer),
    and the check is atomic: threads allocating together never take the device past it."""
    import threading

    assert not hasattr(EmulatedDevice, "deferred") and not hasattr(EmulatedDevice, "take_overflow")
    device = EmulatedDevice(1 << 20)
    refused, kept = [], []

    def grab():
        for _ in range(400):
            try:
                kept.append(torch.empty(4096))           # 16 KiB each
            except torch.OutOfMemoryError:
                refused.append(1)

    with device.active(), device.enforcing():
        threads = [threading.Thread(target=grab) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert refused and device.peak() <= device.capacity_bytes
    assert device.allocated() == sum(t.untyped_storage().nbytes() for t in kept)
    kept.clear()
    device.close()


@pytest.mark.multiprocess
def test_no_compiler_is_one_line_not_a_traceback(tmp_path):
    import os
    import subprocess
    import sys
    env = dict(os.environ, CXX=str(tmp_path / "no-such-compiler"), SPIKEGUARD_CACHE=str(tmp_path))
    proc = subprocess.run([sys.executable, "-m", "spikeguard", "train", "--preset", "tiny",
                           "--steps", "1", "--budget", "4MiB"], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert proc.stderr.splitlines() == [
        f"spikeguard: error: cannot build the emulated device's allocator: no C++ compiler: "
        f"CXX={env['CXX']} is not a program; the CPU device is compiled at first use: "
        f"install g++ (apt-get install g++) or clang++, or set CXX to one"], proc.stderr


@pytest.mark.multiprocess
def test_no_compiler_on_path_names_the_default_one(tmp_path):
    """No CXX and a PATH with no compiler: the line names torch.utils.cpp_extension's
    default (c++). The interpreter is run by its full path, so it needs no PATH."""
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "CXX"}
    env.update(PATH=str(tmp_path / "empty-bin"), SPIKEGUARD_CACHE=str(tmp_path))
    proc = subprocess.run([sys.executable, "-m", "spikeguard", "train", "--preset", "tiny",
                           "--steps", "1", "--budget", "4MiB"], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert proc.stderr.splitlines() == [
        "spikeguard: error: cannot build the emulated device's allocator: no C++ compiler: "
        "'c++' (torch.utils.cpp_extension's default) is not on PATH; the CPU device is "
        "compiled at first use: install g++ (apt-get install g++) or clang++, or set CXX to "
        "one"], proc.stderr
    assert list(tmp_path.glob("*.so")) == []   # no half-built file left in the cache


@pytest.mark.multiprocess
def test_builds_with_cpp_extensions_paths(tmp_path, monkeypatch):
    """A fresh cache builds with torch.utils.cpp_extension's compiler and paths (the rest
    of the suite finds the build cached)."""
    from torch.utils import cpp_extension

    from spikeguard.memory import device as device_module

    cmd = device_module._compile_command(1, str(tmp_path / "x.so"))
    assert cmd[0] == cpp_extension.get_cxx_compiler()
    for path in cpp_extension.include_paths():
        assert f"-I{path}" in cmd
    for path in cpp_extension.library_paths():
        assert f"-L{path}" in cmd and f"-Wl,-rpath,{path}" in cmd
    monkeypatch.setenv("SPIKEGUARD_CACHE", str(tmp_path))
    built = device_module._build()
    assert built.parent == tmp_path and built.stat().st_size > 0


def test_the_position_label_is_the_librarys_and_a_repeated_one_makes_no_call():
    """`set_where` keeps a mirror of the library's label so that setting the one already
    current costs no ctypes call (a backward's three marks per layer share a label); the
    mirror must stay the library's own figure, also past an out-of-range label."""
    a, b = EmulatedDevice(1 << 30), EmulatedDevice(1 << 30)   # the label is process-wide
    lib = a._lib
    start = int(lib.sg_where())
    assert a.where() == start
    assert a.set_where(7) == start and int(lib.sg_where()) == 7 and b.where() == 7
    assert b.set_where(7) == 7 and int(lib.sg_where()) == 7
    assert b.set_where(9) == 7 and a.where() == 9 == int(lib.sg_where())
    assert a.set_where(1 << 20) == -1   # out of range: the library refuses, nothing moves
    assert a.where() == 9 == int(lib.sg_where())
    calls = []
    real = a._lib

    class Counting:   # the library seen through a counter
        def __getattr__(self, name):
            calls.append(name)
            return getattr(real, name)

    a._lib = Counting()
    try:
        a.set_where(9)
        assert calls == []
        a.set_where(start)
        assert calls == ["sg_set_where"]
    finally:
        a._lib = real
    assert a.where() == start == int(lib.sg_where())
    a.close()
    b.close()
