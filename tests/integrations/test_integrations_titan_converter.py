"""The torchtitan way in: SpikeGuardConverter (a torchtitan ModelConfigConverter) carries
the guard's settings through the model config; `attach_titan`, torchtitan's
post_optimizer_build_fn signature, attaches them once the model and optimizer are built;
the guarded model's gradients are bitwise the unguarded one's; bad settings fail at
convert, in one line.

    .venv/bin/python -m pytest tests/integrations/test_integrations_titan_converter.py -q
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchtitan")

import spikeguard  # noqa: E402
from spikeguard.integrations.titan_converter import (SpikeGuardConverter,  # noqa: E402
                                                     attach_titan)
from spikeguard.integrations.titan_models import titan_config  # noqa: E402

from titan_helpers import SIZES, batches, bitwise, step  # noqa: E402

pytestmark = [pytest.mark.timeout(120), pytest.mark.filterwarnings("ignore:In CPU autocast")]


def _built(cfg):
    torch.manual_seed(0)
    model = cfg.build()
    model.init_states()
    return model


class _Container:
    """What attach_titan reads of torchtitan's OptimizersContainer: one per model part."""

    def __init__(self, optimizers):
        self.optimizers = optimizers


def test_converter_then_attach_is_the_guard_bitwise():
    data = batches(3)
    plain = _built(titan_config("deepseek_v3", SIZES))
    reference = step(plain, data)
    converter = SpikeGuardConverter.Config(budget="1GiB", policy="offload").build()
    model = _built(converter.convert(titan_config("deepseek_v3", SIZES)))
    optimizer = torch.optim.AdamW(model.parameters())
    hooked = []
    guards = attach_titan(_Container([optimizer]), [model], None,
                          chain=lambda *a: hooked.append(len(a)))
    assert hooked == [3] and guards == [model.spikeguard]
    assert model.spikeguard.policy == "offload" and model.spikeguard.optimizers == (optimizer,)
    assert bitwise(reference, step(model, data, model.spikeguard))
    assert model.spikeguard.history[-1]["decisions"]["offload"] == 4
    model.spikeguard.detach()


def test_each_part_gets_the_optimizers_of_its_own_parameters():
    # torchtitan's container makes one optimizer per part and optimizer name: here part 0
    # has two (its param groups name AdamW and SGD), part 1 one. By index, part 1 got
    # part 0's second optimizer.
    converter = SpikeGuardConverter.Config(budget="1GiB", policy="none").build()
    parts = [_built(converter.convert(titan_config("deepseek_v3", SIZES))) for _ in range(2)]
    first = list(parts[0].parameters())
    optimizers = [torch.optim.AdamW(first[::2]), torch.optim.SGD(first[1::2]),
                  torch.optim.AdamW(parts[1].parameters())]
    guards = attach_titan(_Container(optimizers), parts, None)
    assert guards[0].optimizers == tuple(optimizers[:2])
    assert guards[1].optimizers == (optimizers[2],)
    for guard in guards:
        guard.detach()


def test_torchtitans_own_optimizers_and_lr_schedulers_built_after_attach():
    # torchtitan's Trainer builds its LR schedulers after post_optimizer_build_fn; a
    # replaced optimizer.step broke them ('functools.partial' has no attribute '__func__').
    from torchtitan.components.optimizer import (LRSchedulersContainer, OptimizersContainer,
                                                 ParamGroupConfig)

    converter = SpikeGuardConverter.Config(budget="1GiB", policy="adaptive").build()
    model = _built(converter.convert(titan_config("deepseek_v3", SIZES)))
    optimizers = OptimizersContainer(OptimizersContainer.Config(implementation="for-loop",
        param_groups=[ParamGroupConfig(pattern=r"experts", optimizer_name="Adam",
                                       optimizer_kwargs={"lr": 1e-2}),
                      ParamGroupConfig(pattern=r".*", optimizer_name="AdamW",
                                       optimizer_kwargs={"lr": 1e-3})]), model_parts=[model])
    (guard,) = attach_titan(optimizers, [model], None)
    schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers,
                                                                    training_steps=4)
    assert len(guard.optimizers) == 2 == len(optimizers.optimizers)   # both steps guarded
    lrs = [[g["lr"] for o in optimizers for g in o.param_groups]]
    for i in range(3):
        step(model, batches(i), guard)
        optimizers.step()
        schedulers.step()
        lrs.append([g["lr"] for o in optimizers for g in o.param_groups])
    assert lrs == [[5e-3, 5e-4], [1e-2, 1e-3], [1e-2, 1e-3], [5e-3, 5e-4]], lrs   # warm-up, decay
    assert len(guard.history) == 3
    guard.detach()


def test_bad_settings_fail_at_convert():
    with pytest.raises(spikeguard.UsageError, match="unknown policy"):
        SpikeGuardConverter.Config(policy="sometimes").build()
    with pytest.raises(spikeguard.UsageError, match="memory_snapshot must be a folder's path"):
        SpikeGuardConverter.Config(memory_snapshot=3).build()


def test_a_memory_snapshot_setting_reaches_the_guard(tmp_path):
    """The converter's memory_snapshot (torchtitan's --spikeguard.memory_snapshot) is the
    guard's: an out-of-memory there writes its snapshot in that folder."""
    folder = tmp_path / "snaps"
    converter = SpikeGuardConverter.Config(budget="64KiB", policy="none",
                                           memory_snapshot=str(folder)).build()
    model = _built(converter.convert(titan_config("deepseek_v3", SIZES)))
    (guard,) = attach_titan(None, [model], None)
    with pytest.raises(spikeguard.DeviceOutOfMemory) as caught:
        step(model, batches(1), guard)
    assert [p.name for p in folder.iterdir()] == ["step000000-rank0-oom.json"]
    assert caught.value.memory_snapshot == str(folder / "step000000-rank0-oom.json")
    guard.detach()


def test_a_model_not_converted_is_refused_in_one_line():
    model = _built(titan_config("deepseek_v3", SIZES))
    with pytest.raises(spikeguard.UsageError) as info:
        attach_titan(None, [model])
    assert "SpikeGuardConverter" in str(info.value) and "\n" not in str(info.value)
