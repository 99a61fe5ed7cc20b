"""One check of a model's sizes for the four classes that hold them (issue 23 item 4): the
built-in ModelConfig, the integrations' HFSizes and TitanSizes, the simulator's SimModel
refuse the same mistakes in the same words (spikeguard.model.sizes.check_shape)."""

import pytest

from spikeguard.errors import UsageError
from spikeguard.integrations.hf_models import HFSizes
from spikeguard.integrations.titan_models import TitanSizes
from spikeguard.model.config import ModelConfig
from spikeguard.sim.config import SimModel

HOLDERS = (ModelConfig, HFSizes, TitanSizes, SimModel)


def _refusal(kind, **sizes) -> str:
    with pytest.raises(UsageError) as err:
        kind(**sizes)
    return str(err.value)


@pytest.mark.parametrize("sizes, words", [
    ({"num_experts": 4, "top_k": 5}, "model.top_k (5) cannot exceed model.num_experts (4)"),
    ({"d_model": 66, "num_heads": 4}, "model.d_model 66 must divide into 4 heads"),
    ({"num_layers": 0}, "model.num_layers must be a positive integer, got 0"),
    ({"d_expert": True}, "model.d_expert must be a positive integer, got True"),
    ({"seq_len": 2.5}, "model.seq_len must be a positive integer, got 2.5"),
])
def test_every_holder_of_sizes_refuses_alike(sizes, words):
    said = {kind.__name__: _refusal(kind, **sizes) for kind in HOLDERS}
    assert set(said.values()) == {words}, said
