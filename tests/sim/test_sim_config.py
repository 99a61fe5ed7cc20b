"""Simulator settings: presets, TOML, overrides, and clear errors for what cannot work."""

import pytest

from spikeguard.cli import main
from spikeguard.errors import UsageError
from spikeguard.sim.config import load_config
from spikeguard.sim.presets import PRESETS
from spikeguard.sim.shape import build, num_params


@pytest.mark.parametrize("name,low,high", [("188b", 180e9, 195e9), ("500b", 480e9, 520e9),
                                           ("1t", 1.0e12, 1.08e12)])
def test_scale_presets_have_the_published_sizes(name, low, high):
    cfg = load_config(name)
    assert low <= num_params(cfg) <= high
    assert cfg.device.capacity_bytes == 64 * 10**9
    assert cfg.layout.devices == 12288


def test_small_preset_static_bytes_are_the_ledgers():
    # 3,888,256 fp32 parameters and their gradients: the guard's static figure on `small`.
    assert build(load_config("small")).stages[0].static_bytes == 31_106_048


def test_toml_then_overrides(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[layout]\npp = 8\n[device]\nefficiency = 0.4\n[workload.skew]\n'
                    'spike_probability = 0.1\n')
    cfg = load_config("1t", str(path), {"layout.pp": 16, "workload.steps": 7})
    assert cfg.layout.pp == 16 and cfg.device.efficiency == 0.4
    assert cfg.workload.steps == 7 and cfg.workload.skew_config().spike_probability == 0.1


@pytest.mark.parametrize("overrides,needle", [
    ({"layout.devices": 1000}, r"not a multiple of tp\*pp"),
    ({"layout.ep": 7}, "ep 7 must divide"),
    ({"layout.pp": 3}, "not divisible by pp"),
    ({"layout.schedule": "gpipe"}, "unknown layout.schedule"),
    ({"layout.global_batch": 1000}, "not a multiple of micro_batch_size"),
    ({"device.efficiency": 1.5}, "at most 1"),
    ({"device.capacity_bytes": -1}, "positive integer"),
    ({"workload.skew": {"spike_max_ratio": 0.5}}, "spike_max_ratio"),
    ({"workload.skew": {"nope": 1}}, "unknown workload.skew"),
    ({"run.policies": ["fastest"]}, "unknown run.policies"),
    ({"layout.bogus": 1}, "unknown setting layout.bogus"),
    ({"gpu.x": 1}, "unknown section"),
])
def test_bad_settings_are_usage_errors(overrides, needle):
    with pytest.raises(UsageError, match=needle):
        load_config("1t", overrides=overrides)


def test_bad_toml_file(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[layout\n")
    with pytest.raises(UsageError, match="not valid TOML"):
        load_config("1t", str(bad))
    with pytest.raises(UsageError, match="does not exist"):
        load_config("1t", str(tmp_path / "missing.toml"))
    assert set(PRESETS) >= {"small", "188b", "500b", "1t"}


def test_cli_errors_are_one_line_exit_2(capsys):
    assert main(["simulate", "--preset", "1t", "--pp", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("spikeguard: error:") and "\n" not in err
    assert main(["simulate", "--set", "layout.tp"]) == 2
    assert main(["simulate", "--preset", "nope"]) == 2
    assert main(["simulate", "--scaling", "a,b", "--steps", "1"]) == 2


def test_model_that_does_not_fit_says_what_would(capsys):
    code = main(["simulate", "--preset", "1t", "--capacity", "12GB", "--steps", "2"])
    err = capsys.readouterr().err
    assert code == 2
    assert "does not fit even with full recompute" in err and "would fit" in err
    assert "layout.pp = 32" in err or "a device of at least" in err


def test_capacity_written_as_a_float_in_toml(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[device]\ncapacity_bytes = 80e9\n")
    assert load_config("1t", str(path)).device.capacity_bytes == 80_000_000_000
