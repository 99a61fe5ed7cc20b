"""FSDP2 with parameters on several meshes (torchtitan's EP: the experts sharded over its
`efsdp` mesh, the rest over `fsdp`) gives a module several parameter groups; moving the
model's state onto the device at attach resets every group's sharded parameters (torch
2.13's singular `_fsdp_param_group` raised "Expected at most 1 param group" there).

One process, a gloo group of one, two process groups for the two meshes.

    .venv/bin/python -m pytest tests/runtime/test_runtime_fsdp_groups.py -q
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from spikeguard.memory.device import EmulatedDevice
from spikeguard.runtime.device_state import move_state_to_device

pytestmark = pytest.mark.timeout(120)


def _two_mesh_model() -> nn.Module:
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult
    from torch.distributed.fsdp._fully_shard._fsdp_init import _get_mesh_info
    from torch.distributed.tensor import Shard

    dense = _get_mesh_info(init_device_mesh("cpu", (1,), mesh_dim_names=("fsdp",)), None)
    experts = _get_mesh_info(DeviceMesh.from_group(dist.new_group([0]), "cpu",
                                                   mesh_dim_names=("efsdp",)), None)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
    expert_params = set(model[2].parameters())
    # What torchtitan's fsdp.py does under EP > 1 (ShardPlacementResult per parameter).
    fully_shard(model, shard_placement_fn=lambda p: ShardPlacementResult(
        Shard(0), experts if p in expert_params else dense))
    return model


def _grads(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model(x).square().sum().backward()
    return [p.grad.to_local().clone() for p in model.parameters()]


def test_state_moves_onto_the_device_with_several_fsdp_param_groups(one_rank):
    model = _two_mesh_model()
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    reference = _grads(model, x)
    model.zero_grad(set_to_none=True)
    meter = EmulatedDevice(1 << 30)
    try:
        param_bytes = sum(p.to_local().numel() * 4 for p in model.parameters())
        move_state_to_device(model, (), meter)
        assert meter.allocated() >= param_bytes   # the local shards now count on the device
        with meter.active():   # FSDP all-gathers from the moved shards: the same gradients
            grads = _grads(model, x)
        assert all(torch.equal(a, b) for a, b in zip(reference, grads))
    finally:
        meter.close()
