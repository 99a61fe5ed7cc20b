"""torchtitan's deepseek_v3 debug model with torchtitan's own FSDP2 on it, for the tests.

Built by spikeguard.integrations.titan_models.build_titan_fsdp_model, with
`parallelize_deepseekv3`, torchtitan 0.3.0's own parallelize function (what its Trainer
calls): it applies its EP (when ep > 1), then `apply_fsdp_to_decoder`, which
fully_shards the embedding, each block (under EP the experts over `efsdp`), the norm and
head together (not resharded after forward) and the root. Run inside a gloo group of
`world` ranks (one rank included: torchtitan applies FSDP2 there too).
"""

from __future__ import annotations

from spikeguard.integrations.titan_models import build_titan_fsdp_model

from titan_helpers import SIZES


def build_fsdp(world: int, ep: int = 1, param_dtype: str = "float32"):
    """The tiny deepseek_v3 (titan_helpers.SIZES), seed 0, FSDP2 over `world` ranks as
    torchtitan applies it, its EP over `ep` of them."""
    return build_titan_fsdp_model("deepseek_v3", SIZES, world, seed=0, ep=ep,
                                  param_dtype=param_dtype)
