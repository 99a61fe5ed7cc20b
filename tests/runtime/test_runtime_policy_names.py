"""The guard's policy settings are checked by one function (runtime/policies.py
`check_policies`) at every door that takes them: attach, the run's configuration,
torchtitan's converter settings. Each refusal is one UsageError naming the choices."""

from __future__ import annotations

import pytest

import spikeguard
from spikeguard.model import build_model, model_config
from spikeguard.train.config import GuardConfig


@pytest.fixture(scope="module")
def model():
    return build_model(model_config("tiny"), seed=0)


@pytest.mark.parametrize("kwargs, match", [
    ({"policy": "sometimes"}, r"unknown policy 'sometimes'; choose one of adaptive, none"),
    ({"policy": None}, r"attach\(\) needs a policy; choose one of adaptive"),
    ({"shared_policy": "drop"}, r"unknown shared_policy 'drop'; choose one of keep, recompute"),
])
def test_attach_refuses_a_policy_it_does_not_know(model, kwargs, match):
    args = {"budget": "1GiB", "policy": "adaptive", **kwargs}
    with pytest.raises(spikeguard.UsageError, match=match):
        spikeguard.attach(model, **args)
    assert getattr(model, "_spikeguard", None) is None   # nothing attached


@pytest.mark.parametrize("kwargs, match", [
    ({"policy": "sometimes"}, r"unknown policy 'sometimes'; choose one of adaptive"),
    ({"shared_policy": "drop"}, r"unknown shared_policy 'drop'; choose one of keep"),
])
def test_the_run_configuration_refuses_them_alike(kwargs, match):
    with pytest.raises(spikeguard.UsageError, match=match):
        GuardConfig(**kwargs)


def test_no_policy_in_the_run_configuration_means_no_guard():
    assert not GuardConfig().enabled
