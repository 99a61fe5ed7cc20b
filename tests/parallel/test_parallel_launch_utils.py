"""launch_utils.run_under_torchrun: a torchrun entry point leaves its gloo group with the
group's threads ended, so no rank dies at interpreter shutdown (pytorch/pytorch#179291).

    .venv/bin/python -m pytest tests/parallel/test_parallel_launch_utils.py -q

The deterministic check runs in this process on a one-rank group (env:// as torchrun sets
it): the gloo worker threads are counted by name after the helper returns. The real run is
scripts/calm_overhead.py under torchrun once, the gloo threads counted at each rank's exit. The static check keeps every other entry point on the
helpers.
"""

from __future__ import annotations

import ast
import os
import socket
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
GLOO_THREADS = ("pt_gloo_runloop", "gloo_tcp_loop")


def _gloo_threads() -> int:
    tasks = Path("/proc/self/task")
    return sum((tasks / t / "comm").read_text().strip() in GLOO_THREADS
               for t in os.listdir(tasks))


def _earlier_groups_threads() -> int:
    """The gloo threads alive before a test's own group: in the whole suite's process an
    earlier test's one-rank group may live on (tests/conftest.py's `one_rank` destroys it
    while its models still refer to it: 6 threads after test_runtime_fsdp_groups.py; in
    the suite's order an integrations test leaves some, and both tests here failed in
    CI). What gc can free goes first, so that it cannot go during the test and hide a
    thread of the test's own."""
    import gc
    gc.collect()
    return _gloo_threads()


@pytest.fixture
def torchrun_env(monkeypatch):
    """This process as rank 0 of 1, the environment torchrun gives its ranks."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for name, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(port)),
                        ("RANK", "0"), ("WORLD_SIZE", "1")):
        monkeypatch.setenv(name, value)


def _guarded_step(group, detach: bool) -> int:
    import spikeguard
    from spikeguard.model import build_model, model_config
    from spikeguard.parallel import parallelize_experts

    cfg = model_config("tiny")
    model = parallelize_experts(build_model(cfg, seed=0), group)
    guard = spikeguard.attach(model, budget=1 << 40, policy="adaptive")
    idx_BT = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len),
                           generator=torch.Generator().manual_seed(0))
    guard.run_step(lambda: model(idx_BT, idx_BT).loss.backward())
    _guarded_step.threads = _gloo_threads()   # named once they ran a collective
    if detach:
        guard.detach()
    return len(guard.history)


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads in /proc")
@pytest.mark.timeout(120)
def test_the_helper_ends_the_groups_threads(torchrun_env, capfd):
    """A parallelized model with a guard that ran a step, built inside `fn` and detached:
    after the helper no gloo thread is left and the group object is gone."""
    import torch.distributed as dist

    from spikeguard.parallel.launch_utils import run_under_torchrun

    before = _earlier_groups_threads()
    seen = {}

    def fn(group):
        seen["group"] = weakref.ref(group)
        return _guarded_step(group, detach=True)

    assert run_under_torchrun(fn) == 1
    assert _guarded_step.threads > before   # the count sees this group's threads while it lives
    assert not dist.is_initialized()
    assert seen["group"]() is None
    assert _gloo_threads() == before
    assert "outlived" not in capfd.readouterr().err


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads in /proc")
@pytest.mark.timeout(120)
def test_a_guard_left_attached_keeps_the_group_and_is_reported(torchrun_env, capfd):
    """The helper's own check: a guard left attached holds the group past the close
    (through autograd's nodes, out of gc's reach), the helper says so on stderr; detached
    afterwards, the group's threads end (so this test leaves none behind)."""
    from spikeguard.parallel.launch_utils import run_under_torchrun
    from spikeguard.runtime.guard import Guard

    before = _earlier_groups_threads()
    run_under_torchrun(lambda group: _guarded_step(group, detach=False))
    assert _gloo_threads() > before
    assert "process group outlived its close" in capfd.readouterr().err
    import gc
    for guard in [o for o in gc.get_objects() if isinstance(o, Guard) and o.attached]:
        guard.detach()
    del guard
    gc.collect()
    assert _gloo_threads() == before


AT_EXIT = """
import atexit, os
def _gloo_threads_at_exit():
    tasks = "/proc/self/task"
    n = sum(open(f"{tasks}/{t}/comm").read().strip() in ("pt_gloo_runloop", "gloo_tcp_loop")
            for t in os.listdir(tasks))
    os.write(2, f"gloo threads at exit: {n}\\n".encode())
if "RANK" in os.environ:   # torchrun's ranks, not its agent
    atexit.register(_gloo_threads_at_exit)   # first registered: runs last
"""


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_calm_overhead_under_torchrun_exits_cleanly(tmp_path):
    """The README's command (page calm-overhead-ep) with the fewest rounds, once: exit 0,
    no "terminate called" (the SIGABRT at shutdown), and, deterministic where the abort is
    a race (the old shape aborted in 1 of 30 runs here at load 4-5, 2 of 3 elsewhere), no
    gloo thread alive when each rank reaches interpreter shutdown (a sitecustomize's atexit
    hook counts them: 2 per rank in the old shape, 0 now)."""
    (tmp_path / "sitecustomize.py").write_text(AT_EXIT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", str(ROOT / "scripts" / "calm_overhead.py"), "--reps", "1", "--clock", "cpu"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=150)
    said = f"rc {done.returncode}\n{done.stdout[-2000:]}{done.stderr[-4000:]}"
    assert done.returncode == 0, said
    assert "terminate called" not in done.stderr, said
    assert done.stdout.startswith("calm step of small"), said
    counts = [line for line in done.stderr.splitlines() if "gloo threads at exit" in line]
    assert len(counts) == 2 and all(c.endswith(": 0") for c in counts), said


ALLOWED = {"spikeguard/parallel/launch_utils.py", "spikeguard/parallel/launch.py"}


def _calls_init(path: Path) -> list[ast.Call]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    return [node for node in ast.walk(tree) if isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None))
            == "init_process_group"]


def test_no_entry_point_joins_a_group_by_hand():
    """Only the helpers join a process group (launch_utils, parallel/launch.init_worker),
    and gpu_check's NCCL path: a new entry point that called init_process_group itself
    would skip the dynamo import and the close, and abort at exit again."""
    found = []
    for path in sorted([*ROOT.glob("scripts/**/*.py"), *ROOT.glob("spikeguard/**/*.py")]):
        rel = path.relative_to(ROOT).as_posix()
        for call in _calls_init(path):
            if rel in ALLOWED:
                continue
            if rel == "scripts/gpu_check.py" and ast.unparse(call.args[0]) == "'nccl'":
                continue
            found.append(f"{rel}:{call.lineno}: {ast.unparse(call)}")
    assert not found, "join through launch_utils.run_under_torchrun:\n" + "\n".join(found)
