"""The integration layer's contract with the core: no transformers or torchtitan import,
clear errors.

`import spikeguard` and attaching to the built-in model must work where transformers is
not importable at all, nor torchtitan (a subprocess whose import system refuses both),
and leave both out of sys.modules; `train --hf` there is a one-line usage error. Attaching to a model without a
recognisable MoE block names what was looked for; attaching twice, detaching twice, and
stacking transformers' own gradient checkpointing under the guard are usage errors.

    .venv/bin/python -m pytest tests/integrations/test_integrations_core.py -q
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import spikeguard
from spikeguard.model import build_model, model_config

pytestmark = pytest.mark.timeout(120)

WITHOUT_TRANSFORMERS = textwrap.dedent("""
    import sys

    class Refuse:
        def find_spec(self, name, path=None, target=None):
            for blocked in ("transformers", "torchtitan"):
                if name == blocked or name.startswith(blocked + "."):
                    raise ImportError(f"{blocked} is blocked in this test")

    sys.meta_path.insert(0, Refuse())
    import torch
    import spikeguard
    import spikeguard.integrations.hf_blocks, spikeguard.train.run, spikeguard.train.auto_budget
    import spikeguard.integrations.titan_blocks, spikeguard.integrations.titan_models
    from spikeguard.model import build_model, model_config
    model = build_model(model_config("tiny"))
    guard = spikeguard.attach(model, budget="64MiB", policy="adaptive")
    tokens = torch.randint(0, 256, (2, 33))
    with guard.step():
        model(tokens[:, :-1], tokens[:, 1:]).loss.backward()
    guard.detach()
    assert guard.history[-1]["decisions"]["save"] > 0
    from spikeguard.cli import main
    code = main(["train", "--hf", "mixtral", "--steps", "1"])
    titan_code = main(["train", "--titan", "deepseek_v3", "--steps", "1"])
    assert titan_code == 2, titan_code
    assert "transformers" not in sys.modules, sorted(m for m in sys.modules if "transformers" in m)
    assert "torchtitan" not in sys.modules, sorted(m for m in sys.modules if "torchtitan" in m)
    print("exit", code)
""")


@pytest.mark.multiprocess
def test_core_never_imports_transformers():
    done = subprocess.run([sys.executable, "-c", WITHOUT_TRANSFORMERS], capture_output=True,
                          text=True, timeout=90)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().endswith("exit 2")
    assert "pip install 'spikeguard[hf]'" in done.stderr
    assert "pip install 'spikeguard[titan]'" in done.stderr
    assert "Traceback" not in done.stderr


def test_no_block_names_what_was_looked_for():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    with pytest.raises(spikeguard.UsageError) as info:
        spikeguard.attach(model, budget="1MiB")
    message = str(info.value)
    assert "MoEBlock" in message
    assert "experts(hidden_states, top_k_index, top_k_weights)" in message
    assert "\n" not in message


def test_the_adapters_are_an_explicit_list_not_an_import_time_registry():
    """Issue 23, item 7: runtime's attach tries the adapters it is given, nothing else:
    importing integrations registers nothing; spikeguard.attach gives ADAPTERS."""
    from spikeguard.integrations import ADAPTERS, BuiltinAdapter, find_adapter
    from spikeguard.runtime import adapter
    from spikeguard.runtime.guard import attach

    assert not hasattr(adapter, "register_adapter") and not hasattr(adapter, "_ADAPTERS")
    model = build_model(model_config("tiny"))
    with pytest.raises(spikeguard.UsageError, match="no block adapter was given: attach "
                                                    "with spikeguard.attach"):
        attach(model, budget="64MiB")
    assert isinstance(find_adapter(model), BuiltinAdapter) and ADAPTERS[0] is BuiltinAdapter
    with pytest.raises(spikeguard.UsageError, match="looked for: spikeguard MoEBlock$"):
        adapter.find_adapter(nn.Linear(2, 2), (BuiltinAdapter,))
    attach(model, budget="64MiB", adapters=(BuiltinAdapter,)).detach()


def test_attach_twice_and_detach_twice_are_errors():
    model = build_model(model_config("tiny"))
    guard = spikeguard.attach(model, budget="64MiB")
    with pytest.raises(spikeguard.UsageError, match="already has a spikeguard"):
        spikeguard.attach(model, budget="64MiB")
    guard.detach()
    with pytest.raises(spikeguard.UsageError, match="not attached"):
        guard.detach()


def test_hf_errors():
    pytest.importorskip("transformers")
    from hf_helpers import build

    model = build("olmoe")
    guard = spikeguard.attach(model, budget="64MiB")
    with pytest.raises(spikeguard.UsageError, match="already has a spikeguard"):
        spikeguard.attach(model, budget="64MiB")
    guard.detach()
    with pytest.raises(spikeguard.UsageError, match="not attached"):
        guard.detach()
    model.activation_checkpointing_enable()
    with pytest.raises(spikeguard.UsageError, match="activation_checkpointing_disable"):
        spikeguard.attach(model, budget="64MiB")
    model.activation_checkpointing_disable()
    experts = model.model.layers[0].mlp.experts
    experts.forward = experts.forward  # another tool's patch
    with pytest.raises(spikeguard.UsageError, match="already have a patched forward"):
        spikeguard.attach(model, budget="64MiB")
    del experts.forward
    w_BT = torch.randint(0, 256, (2, 9))
    spikeguard.attach(model, budget="64MiB").detach()  # a failed attach left nothing behind
    assert torch.equal(model(input_ids=w_BT).logits, model(input_ids=w_BT).logits)


def _draw_after(attach_first: bool, model) -> torch.Tensor:
    torch.manual_seed(0)
    if attach_first:
        spikeguard.attach(model, budget="64MiB").detach()
    return torch.rand(4)


@pytest.mark.parametrize("kind", ["builtin", "hf"])
def test_attach_leaves_the_random_generator_alone(kind):
    """Calibration and the probe draw random numbers on their own generators: a model with
    dropout or router jitter sees the same masks with and without the guard."""
    if kind == "builtin":
        model = build_model(model_config("tiny"))
    else:
        pytest.importorskip("transformers")
        from hf_helpers import build

        model = build("mixtral")
        model.config._experts_implementation = "eager"  # the probe path draws too
    assert torch.equal(_draw_after(False, model), _draw_after(True, model))
