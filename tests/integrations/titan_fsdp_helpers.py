"""torchtitan's deepseek_v3 debug model with torchtitan's own FSDP2 on it, for the tests.

`parallelize_deepseekv3` is torchtitan 0.3.0's own parallelize function (what its Trainer
calls): it applies its EP (when ep > 1), then `apply_fsdp_to_decoder`, which
fully_shards the embedding, each block (under EP the experts over `efsdp`), the norm and
head together (not resharded after forward) and the root. Run inside a gloo group of
`world` ranks (one rank included: torchtitan applies FSDP2 there too).
"""

from __future__ import annotations

import torch

from spikeguard.integrations.titan_models import (SPMD_BACKEND, _parallel_dims,
                                                  _with_expert_parallel, titan_config)

from titan_helpers import SIZES


def build_fsdp(world: int, ep: int = 1, param_dtype: str = "float32"):
    """The tiny deepseek_v3 (titan_helpers.SIZES), seed 0, FSDP2 over `world` ranks as
    torchtitan applies it, its EP over `ep` of them."""
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims, parallel_dims
    from torchtitan.models.deepseek_v3.parallelize import parallelize_deepseekv3

    cfg = titan_config("deepseek_v3", SIZES)
    if ep > 1:
        cfg = _with_expert_parallel(cfg, ep)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = cfg.build()
        model.init_states()
    if ep > 1:
        dims = _parallel_dims(ep)
    else:
        parallel_dims.device_type = "cpu"   # torchtitan 0.3.0 takes "cuda" otherwise
        dims = ParallelDims(dp_replicate=1, dp_shard=world, cp=1, tp=1, pp=1, ep=1,
                            world_size=world, spmd_backend=SPMD_BACKEND)
        dims.build_mesh()
    model = parallelize_deepseekv3(
        model, parallel_dims=dims,
        training=TrainingConfig(mixed_precision_param=param_dtype),
        parallelism=ParallelismConfig(spmd_backend=SPMD_BACKEND),
        compile_config=CompileConfig(), ac_config=None, dump_folder="/tmp")
    gloo_reduce_shim(model)
    return model


def gloo_reduce_shim(model) -> None:
    """A CPU shim, torchtitan's business: it sets every unit's gradient divide factor to
    1 (it scales by the global token count itself), which FSDP2 turns into a
    PREMUL_SUM reduce-scatter that gloo refuses; FSDP2's public switch to a plain SUM
    (with the same factor 1) runs it over gloo."""
    from torch.distributed.fsdp import FSDPModule
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
