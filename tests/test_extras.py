"""numpy and matplotlib are extras: the core imports and trains without them, and each
feature that needs one says which extra installs it, in one line (spikeguard/extras.py).

They are installed in the test venv, so a child process blocks them: a sitecustomize on
PYTHONPATH makes both unimportable, as an environment without them would (BLOCKER). torch itself imports without numpy (it is optional there).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from one_line import check_one_line

pytestmark = pytest.mark.multiprocess

BLOCKER = '''
import sys

# None in sys.modules: `import numpy` raises ModuleNotFoundError (name "numpy") and
# importlib.util.find_spec("numpy") answers None, exactly as for an absent package. A
# meta-path finder that raises would not do: torch._dynamo probes with find_spec and
# takes the raise for a broken install.
for _name in ("numpy", "matplotlib"):
    sys.modules[_name] = None
'''


def _run(tmp_path, args, timeout=120):
    site = tmp_path / "blocker"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(BLOCKER)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(site)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    return subprocess.run([sys.executable, *args], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=timeout)


def test_the_blocker_blocks(tmp_path):
    proc = _run(tmp_path, ["-c", "import numpy"])
    assert proc.returncode == 1 and "ModuleNotFoundError" in proc.stderr, proc.stderr
    proc = _run(tmp_path, ["-c", "import importlib.util; "
                                 "assert importlib.util.find_spec('matplotlib') is None"])
    assert proc.returncode == 0, proc.stderr


CORE = '''
import json, sys
import torch
import spikeguard, spikeguard.cli
from spikeguard.model.config import model_config
from spikeguard.model.transformer import MoETransformer
from spikeguard.extras import MissingExtra
model = MoETransformer(model_config("tiny"))
guard = spikeguard.attach(model, budget="64MiB", policy="adaptive")
x = torch.randint(0, 256, (2, 16))
guard.run_step(lambda: model(x, x).loss.backward())
guard.detach()
try:
    import spikeguard.sim.engine
    sim = "imported"
except MissingExtra as err:
    sim = [str(err), isinstance(err, ImportError)]
print(json.dumps({"loaded": sorted(m for m, mod in sys.modules.items() if mod is not None
                                   and m.split(".")[0] in ("numpy", "matplotlib")),
                  "sim": sim}))
'''


def test_import_and_attach_without_numpy_or_matplotlib(tmp_path):
    proc = _run(tmp_path, ["-c", CORE])
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out["loaded"] == []
    assert out["sim"] == ["spikeguard simulate needs numpy, which is not installed: "
                          "pip install 'spikeguard[sim]'", True]


def test_train_without_numpy_or_matplotlib(tmp_path):
    proc = _run(tmp_path, ["-m", "spikeguard", "train", "--preset", "tiny", "--steps", "2",
                           "--budget", "4MiB", "--record-trace", "t.jsonl"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "done: 2 steps" in proc.stdout, proc.stdout
    # recording needs no numpy; replaying the trace just recorded does: one line
    proc = _run(tmp_path, ["-m", "spikeguard", "train", "--preset", "tiny", "--steps", "2",
                           "--trace", "t.jsonl"])
    check_one_line(proc.returncode, proc.stderr, "needs numpy, which is not installed: "
                   "pip install 'spikeguard[trace]'")


@pytest.mark.parametrize("argv, extra", [
    (["simulate", "--preset", "188b", "--steps", "5"], "sim"),
    (["report", "run.jsonl", "--plots", "out"], "plots"),
    (["bench", "--steps", "4"], "bench"),
])
def test_commands_that_need_an_extra_name_it(tmp_path, argv, extra):
    (tmp_path / "run.jsonl").write_text('{"step": 1}\n')
    proc = _run(tmp_path, ["-m", "spikeguard", *argv])
    check_one_line(proc.returncode, proc.stderr, f"pip install 'spikeguard[{extra}]'")
    assert not (tmp_path / "out").exists()
