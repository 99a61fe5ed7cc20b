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


def test_bad_settings_fail_at_convert():
    with pytest.raises(spikeguard.UsageError, match="unknown policy"):
        SpikeGuardConverter.Config(policy="sometimes").build()


def test_a_model_not_converted_is_refused_in_one_line():
    model = _built(titan_config("deepseek_v3", SIZES))
    with pytest.raises(spikeguard.UsageError) as info:
        attach_titan(None, [model])
    assert "SpikeGuardConverter" in str(info.value) and "\n" not in str(info.value)
