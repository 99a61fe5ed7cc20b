"""The package as a user gets it: the wheel and sdist build, the wheel installs into a fresh
environment that already holds torch without touching that torch, and runs from there.

The fresh venv has no system site-packages and nothing of the project's .venv: torch is
installed into it from the local wheel pip is configured to find (find-links, on this
machine /opt/wheels), as a user's environment would hold its own. Without such a wheel
the test skips: installing torch any other way would download gigabytes. numpy and
matplotlib are not installed there (extras), so the demo also runs without them for real.

    .venv/bin/python -m pytest tests/test_packaging.py
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[1]
QUIET = ["--disable-pip-version-check", "--no-input"]


def _run(cmd, timeout, **kwargs) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True,
                          timeout=timeout, **kwargs)
    assert proc.returncode == 0, f"{cmd}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def local_torch_wheel() -> Path | None:
    """This torch's wheel in one of pip's find-links folders, or None."""
    listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"],
                            capture_output=True, text=True, timeout=60).stdout
    folders = os.environ.get("PIP_FIND_LINKS", "").split()
    for line in listed.splitlines():
        key, _, value = line.partition("=")
        if key.endswith("find-links"):
            folders += value.strip("'\"").split()
    version = torch.__version__.replace("+", "%2B"), torch.__version__
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    for folder in folders:
        folder = Path(folder.removeprefix("file://"))
        for v in version:
            found = sorted(folder.glob(f"torch-{v}-{tag}-*.whl")) if folder.is_dir() else []
            if found:
                return found[0]
    return None


def _source_copy(dest: Path) -> Path:
    """What the sdist is built from, copied: a build writes build/ and *.egg-info beside
    its sources, which must not land in the checkout the rest of the suite reads."""
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", "*.so", "*.egg-info", "build", "dist")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, dest / name)
    shutil.copytree(REPO / "spikeguard", dest / "spikeguard", ignore=skip)
    return dest


def test_wheel_installs_beside_an_existing_torch_and_runs(tmp_path):
    wheel = local_torch_wheel()
    if wheel is None:
        pytest.skip(f"no local wheel of torch {torch.__version__} in pip's find-links: "
                    f"installing one would download it")
    (tmp_path / "src").mkdir()
    src = _source_copy(tmp_path / "src")
    dist = tmp_path / "dist"
    # sdist first, then the wheel built from the unpacked sdist: an incomplete sdist fails
    _run([sys.executable, "-m", "build", "--outdir", dist, src], timeout=300)
    sdists, wheels = sorted(dist.glob("*.tar.gz")), sorted(dist.glob("*.whl"))
    assert len(sdists) == 1 and len(wheels) == 1, list(dist.iterdir())
    with zipfile.ZipFile(wheels[0]) as zf:
        assert "spikeguard/memory/device_allocator.cpp" in zf.namelist()

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv], timeout=120)
    py = venv / "bin" / "python"
    pip = [sys.executable, "-m", "pip", "--python", py, "install", *QUIET]
    # --no-compile: byte-compiling torch's sources is most of its install time here, and
    # nothing this test checks
    _run(pip + ["--no-compile", wheel], timeout=600)
    torch_init = (venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
                  / "site-packages" / "torch" / "__init__.py")
    stamp = torch_init.stat().st_mtime_ns

    out = _run(pip + [wheels[0]], timeout=300).stdout
    installed = [line for line in out.splitlines() if line.startswith("Successfully installed")]
    assert installed and "spikeguard-" in installed[0], out
    assert "torch" not in installed[0] and "Uninstalling torch" not in out, out
    check = ("import torch, importlib.util as u; print(torch.__version__, torch.__file__, "
             "u.find_spec('numpy') is None, u.find_spec('matplotlib') is None)")
    assert _run([py, "-c", check], timeout=120).stdout.split() == [
        torch.__version__, str(torch_init), "True", "True"]
    assert torch_init.stat().st_mtime_ns == stamp

    env = dict(os.environ, SPIKEGUARD_CACHE=str(tmp_path / "cache"))
    env.pop("PYTHONPATH", None)
    tool = venv / "bin" / "spikeguard"
    demo = _run([tool, "demo", "--nproc", "1", "--steps", "1", "--threads", "1"], timeout=300,
                cwd=tmp_path, env=env)
    assert "done: 1 steps" in demo.stdout and demo.stderr == "", demo.stderr
    # the emulated device, compiled from the wheel's own source against this venv's torch
    train = _run([tool, "train", "--preset", "tiny", "--steps", "1", "--budget", "4MiB",
                  "--threads", "1"], timeout=300, cwd=tmp_path, env=env)
    assert "done: 1 steps" in train.stdout and train.stderr == "", train.stderr
    assert len(list((tmp_path / "cache").glob("device_allocator-*.so"))) == 1
