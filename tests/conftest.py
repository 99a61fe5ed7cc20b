"""Test-wide settings.

One torch thread: the tiny models gain nothing from two, and on a 2-core machine shared
with other jobs two OpenMP threads stall each other (steps measured 10-100x slower).

Markers (pyproject.toml) make the fast subset, `make test-fast` = `-m "not slow and not
multiprocess"`; CI runs everything. `multiprocess` is checked, not trusted: a test that
starts a process (subprocess, multiprocessing, torchrun: all go through
`_posixsubprocess.fork_exec`, `os.posix_spawn` or `os.fork`) without the marker fails, so the fast subset
cannot quietly grow a launch.
"""

import _posixsubprocess
import os
import subprocess

import pytest
import torch


@pytest.fixture(autouse=True)
def _processes_are_marked(request, monkeypatch):
    if request.node.get_closest_marker("multiprocess") is not None:
        yield
        return
    started: list[str] = []

    def spy(real, name):
        def call(*args, **kwargs):
            started.append(name)
            return real(*args, **kwargs)
        return call

    monkeypatch.setattr(_posixsubprocess, "fork_exec", spy(_posixsubprocess.fork_exec,
                                                           "fork_exec"))
    # subprocess bound its own name for it at import
    monkeypatch.setattr(subprocess, "_fork_exec", spy(subprocess._fork_exec, "fork_exec"))
    monkeypatch.setattr(os, "fork", spy(os.fork, "fork"))
    for name in ("posix_spawn", "posix_spawnp"):   # subprocess's other way, where it can
        if hasattr(os, name):
            monkeypatch.setattr(os, name, spy(getattr(os, name), name))
    yield
    if started:
        pytest.fail(f"this test started {len(started)} process(es) ({started[0]}): mark it "
                    f"`multiprocess` (tests/conftest.py)", pytrace=False)


@pytest.fixture(autouse=True, scope="session")
def _matplotlib_font_cache():
    """matplotlib builds its font cache at its first import on a machine (it runs fc-list):
    built here, before any test's process check, so that whichever test first draws a plot
    (tests/test_pages.py renders docs/bench.md's) does not count it as a process of its own
    (seen on a fresh ~/.cache: "started 2 process(es)")."""
    try:
        import matplotlib.font_manager  # noqa: F401
    except ImportError:   # an extra (pyproject.toml): its tests skip without it
        pass
    yield


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def one_rank(tmp_path):
    """A one-rank gloo process group for the test (FSDP2 and torchtitan's EP checks)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0,
                            world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
