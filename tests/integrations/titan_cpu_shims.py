"""torchtitan 0.3.0's CPU shims: what its Trainer needs to run on a CPU-only machine.

None of this is spikeguard's: torchtitan assumes an accelerator. Imported by the test's
config registry (titan_train_registry.py) before torchtitan builds anything:
  * device type "cpu" (torchtitan takes "cuda" when no accelerator is found,
    tools/utils.py:55, and several modules copied the name at import);
  * a device module for its memory monitor (components/metrics.py:38-52 reads CUDA's
    memory statistics; here they read zero);
  * `torch.distributed.set_timeout`, missing from torch 2.13's CPU build, which the
    Trainer calls after the first step (distributed/utils.py:595);
  * FSDP2's gradient reduction as a plain SUM: torchtitan sets the divide factor to 1.0
    (distributed/fsdp.py:27-41), which torch 2.13 turns into `ReduceOp.PREMUL_SUM(1.0)`
    (fsdp/_fully_shard/_fsdp_collectives.py:850), an op gloo does not have; FSDP2's own
    `set_force_sum_reduction_for_comms` makes it SUM with a division by 1.0 (the same
    numbers). Only with 2 ranks or more.
SDPA attention instead of FlexAttention (no CPU backward in torch 2.13) is the model
config's (spikeguard.integrations.titan_models.titan_config).
"""

from __future__ import annotations

import types
import warnings

import torch
import torch.distributed

warnings.filterwarnings("ignore", message="In CPU autocast")


def _cpu_device_module() -> types.SimpleNamespace:
    """torch.cpu plus the memory-monitor calls torchtitan makes on a CUDA module."""
    props = types.SimpleNamespace(total_memory=1 << 40)
    return types.SimpleNamespace(
        set_device=lambda *a: None, current_device=lambda: 0,
        get_device_name=lambda *a: "cpu", get_device_properties=lambda *a: props,
        reset_peak_memory_stats=lambda *a: None, empty_cache=lambda: None,
        memory_stats=lambda *a: {}, synchronize=lambda *a: None,
        device_count=lambda: 1, is_available=lambda: True)


def install() -> None:
    from torchtitan.components import metrics
    from torchtitan.distributed import parallel_dims, utils as dist_utils
    from torchtitan.models.common import token_dispatcher
    from torchtitan.tools import utils
    module = _cpu_device_module()
    for mod in (utils, dist_utils, metrics, token_dispatcher):
        mod.device_type = "cpu"
        if hasattr(mod, "device_module"):
            mod.device_module = module
    parallel_dims.device_type = "cpu"
    _sum_reduction_for_gloo()
    if not hasattr(torch.distributed, "set_timeout"):
        torch.distributed.set_timeout = lambda timeout, group=None: None


def _sum_reduction_for_gloo() -> None:
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.distributed import fsdp
    divide_by_one = fsdp.disable_fsdp_gradient_division

    def sum_for_gloo(model) -> None:
        divide_by_one(model)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
    fsdp.disable_fsdp_gradient_division = sum_for_gloo


install()
