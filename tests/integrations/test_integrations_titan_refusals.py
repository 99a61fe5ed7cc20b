"""What torchtitan's own Trainer turns on that the guard refuses, in one line naming the
setting to change: its activation checkpointing, found by type (under FSDP2, which the
Trainer applies even on one rank, the wrapper's class is FSDPCheckpointWrapper), its
default `spmd_types` EP backend, and its fullgraph compile of the blocks.

One process; FSDP2 over a gloo group of one.

    .venv/bin/python -m pytest tests/integrations/test_integrations_titan_refusals.py -q
"""

from __future__ import annotations

import pytest

pytest.importorskip("torchtitan")

import spikeguard  # noqa: E402

from titan_helpers import HUGE, build, moe_blocks  # noqa: E402

pytestmark = [pytest.mark.timeout(120), pytest.mark.filterwarnings("ignore:In CPU autocast")]


def _refusal(model) -> str:
    with pytest.raises(spikeguard.UsageError) as info:
        spikeguard.attach(model, budget=HUGE)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_torchtitans_selective_ac_under_fsdp2_is_refused(one_rank):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torchtitan.distributed.activation_checkpoint import SelectiveAC

    model = build()
    SelectiveAC(SelectiveAC.Config()).apply(model)   # the Trainer's default AC
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("fsdp",))
    for block in model.layers.children():            # as torchtitan's apply_fsdp does
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    assert type(model.layers["1"]).__name__ == "FSDPCheckpointWrapper"
    message = _refusal(model)
    assert "activation_checkpoint = None" in message and "FSDPCheckpointWrapper" in message


def test_torchtitans_default_ep_backend_is_refused(one_rank):
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.distributed import utils as dist_utils

    model = build()
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("ep",))
    for block in moe_blocks(model):   # what RoutedExperts.parallelize wires under EP
        block.routed_experts.token_dispatcher.ep_mesh = mesh
    before = dist_utils.get_spmd_backend()
    dist_utils.set_spmd_backend("spmd_types")       # torchtitan 0.3.0's default
    try:
        message = _refusal(model)
        dist_utils.set_spmd_backend("partial_dtensor")   # what spikeguard needs: attaches
        spikeguard.attach(model, budget=HUGE).detach()
    finally:
        dist_utils.set_spmd_backend(before)
    assert "parallelism.spmd_backend = \"partial_dtensor\"" in message
    assert "'spmd_types'" in message


def test_fullgraph_compile_is_refused_naming_the_setting():
    model = build()
    model.layers["1"].compile(fullgraph=True)   # what torchtitan's apply_compile does
    assert "compile.enable = false" in _refusal(model)
