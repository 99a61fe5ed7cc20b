"""Tiny torchtitan MoE models, built offline with random weights, one process or EP.

    from spikeguard.integrations.titan_models import TitanSizes, build_titan_model
    model = build_titan_model("deepseek_v3", TitanSizes())        # one process
    model = build_titan_model("deepseek_v3", TitanSizes(), ep=2)  # under a gloo/NCCL group:
    # torchtitan's own expert parallelism (its AllToAllTokenDispatcher, experts as DTensors
    # sharded over its `ep` mesh), applied by its own `Module.parallelize`

The architectures are torchtitan 0.3.0's `deepseek_v3` (multi-head latent attention, the
first layer dense, then MoE layers with shared experts) and `qwen3`'s MoE form (grouped
query attention with q/k norms, every layer MoE, no shared expert), at small sizes, with two changes
for CPU: each layer's `inner_attention` is torchtitan's `ScaledDotProductAttention`
(FlexAttention has no CPU backward in torch 2.13), and the model is called without
positions (causal attention over one document). The vocabulary is spikeguard's 256 byte
values. Needs `pip install 'spikeguard[titan]'`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from spikeguard.errors import UsageError
from spikeguard.integrations.sizes import check_model_sizes

BYTE_VOCAB = 256
FAMILIES = ("deepseek_v3", "qwen3")
# torchtitan's default is "spmd_types", whose all-to-all is c10d's (not torch's functional
# collectives, whose outputs a recomputed layer keeps): spikeguard runs torchtitan's
# "partial_dtensor" backend, which dispatches with `_functional_collectives.all_to_all_single`.
SPMD_BACKEND = "partial_dtensor"


@dataclass(kw_only=True)
class TitanSizes:
    """The small sizes a torchtitan model is built at; validated on creation."""

    d_model: int = 32
    num_layers: int = 3          # the first dense, the others MoE
    num_heads: int = 2
    num_experts: int = 8
    top_k: int = 3
    d_expert: int = 32
    seq_len: int = 128

    def __post_init__(self) -> None:
        check_model_sizes(self)
        if self.num_layers < 2:
            raise UsageError("a torchtitan model here has 2 layers at least (deepseek_v3's "
                             "first is dense)")

    @property
    def num_params(self) -> int:
        """About the parameters (attention, router, experts, one shared expert, the dense
        first layer, byte embeddings and head): to refuse an absurd size before building."""
        d, f = self.d_model, self.d_expert
        moe = d * self.num_experts + (self.num_experts + 1) * 3 * d * f
        per_layer = 4 * d * d
        return 2 * BYTE_VOCAB * d + self.num_layers * per_layer + 6 * d * f \
            + (self.num_layers - 1) * moe


def torchtitan_modules():
    """The torchtitan modules the builder uses; a UsageError saying how to install if absent."""
    try:
        from torchtitan.models import deepseek_v3
        from torchtitan.models.common import Embedding, Linear, RMSNorm
        from torchtitan.models.common.attention import ScaledDotProductAttention
        from torchtitan.models.common.rope import ComplexRoPE
    except ImportError as exc:
        raise UsageError(f"torchtitan models need torchtitan: pip install "
                         f"'spikeguard[titan]' ({exc})") from None
    return deepseek_v3, Embedding, Linear, RMSNorm, ScaledDotProductAttention, ComplexRoPE


def check_family(name: str) -> str:
    if name not in FAMILIES:
        raise UsageError(f"unknown torchtitan model {name!r}; choose one of {', '.join(FAMILIES)}")
    return name


def titan_config(name: str, sizes: TitanSizes):
    """torchtitan's model config of `name` at `sizes` (see the module docstring)."""
    check_family(name)
    if name == "qwen3":
        return _qwen3_config(sizes)
    ds, Embedding, Linear, RMSNorm, SDPA, ComplexRoPE = torchtitan_modules()
    d, head = sizes.d_model, sizes.d_model // sizes.num_heads
    rope_dim = max(2, head // 2 - head // 2 % 2)
    layers = ds._build_dsv3_layers(  # torchtitan's own builder of its debug models' layers
        n_layers=sizes.num_layers, n_dense_layers=1, dim=d, n_heads=sizes.num_heads,
        q_lora_rank=0, kv_lora_rank=d // 2, qk_nope_head_dim=head, qk_rope_head_dim=rope_dim,
        v_head_dim=head, mscale=0.70, dense_hidden_dim=2 * sizes.d_expert,
        moe_hidden_dim=sizes.d_expert, num_experts=sizes.num_experts, num_shared_experts=1,
        router_top_k=sizes.top_k, router_score_func="softmax", attn_backend="flex",
        moe_comm_backend="standard", non_blocking_capacity_factor=None,
        rope=ComplexRoPE.Config(dim=rope_dim, max_seq_len=max(sizes.seq_len, 64),
                                theta=10000.0, scaling="yarn", rope_factor=40.0,
                                beta_fast=32.0, beta_slow=1.0, original_seq_len=4096))
    for layer in layers:
        layer.attention.inner_attention = SDPA.Config()
    return ds.DeepSeekV3Model.Config(
        vocab_size=BYTE_VOCAB, dim=d,
        tok_embeddings=Embedding.Config(num_embeddings=BYTE_VOCAB, embedding_dim=d,
                                        param_init=ds._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=d, param_init=ds._NORM_INIT),
        lm_head=Linear.Config(in_features=d, out_features=BYTE_VOCAB,
                              param_init=ds._output_linear_init(d)),
        layers=layers, mtp_layers=[])


def _qwen3_config(sizes: TitanSizes):
    """Qwen3-MoE at `sizes`, through torchtitan's own layer builder (its debug MoE model's
    recipe: every layer MoE, softmax router with normalised top-k weights)."""
    _, Embedding, Linear, _, SDPA, _ = torchtitan_modules()
    from torchtitan.models import qwen3
    from torchtitan.models.common import CosSinRoPE
    d, head = sizes.d_model, sizes.d_model // sizes.num_heads
    layers = qwen3._build_qwen3_moe_layers(
        fuse_qkv=True, n_layers=sizes.num_layers, dim=d, n_heads=sizes.num_heads,
        n_kv_heads=1, head_dim=head, moe_hidden_dim=sizes.d_expert,
        num_experts=sizes.num_experts, top_k=sizes.top_k, attn_backend="flex",
        rope=CosSinRoPE.Config(dim=head, max_seq_len=max(sizes.seq_len, 64), theta=1e6),
        moe_comm_backend="standard")
    for layer in layers:
        layer.attention.inner_attention = SDPA.Config()
    return qwen3.Qwen3Model.Config(
        vocab_size=BYTE_VOCAB, dim=d, norm=qwen3._qwen3_norm(d),
        tok_embeddings=Embedding.Config(num_embeddings=BYTE_VOCAB, embedding_dim=d,
                                        param_init=qwen3._EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=d, out_features=BYTE_VOCAB,
                              param_init=qwen3._LINEAR_INIT),
        layers=layers)


def build_titan_model(name: str, sizes: TitanSizes, seed: int = 0, ep: int = 1) -> nn.Module:
    """A torchtitan `name` at `sizes`, random weights from `seed` (the same on every rank).
    With `ep` > 1 (inside a process group of `ep` ranks) torchtitan's own expert
    parallelism is applied: its all-to-all dispatcher, the experts sharded over `ep`."""
    model = _built(name, sizes, seed, ep)
    if ep > 1:
        model.parallelize(_parallel_dims(ep))
    return model


def _built(name: str, sizes: TitanSizes, seed: int, ep: int) -> nn.Module:
    """torchtitan's `name` built from its config (EP's sharding configs where `ep` > 1),
    its weights initialised from `seed`, not yet laid out."""
    cfg = titan_config(name, sizes)
    if ep > 1:
        cfg = _with_expert_parallel(cfg, ep)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cfg.build()
        model.init_states()
    return model


def _with_expert_parallel(cfg, ep: int):
    """What torchtitan's `update_from_config` does for EP, without its trainer (whose
    import needs its data-loading dependencies): the sharding configs, EP on, SP off.
    The "standard" dispatcher is already the all-to-all one (local when EP is 1)."""
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.models.deepseek_v3.sharding import set_deepseek_v3_sharding_config
    from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() != ep:
        raise UsageError(f"torchtitan expert parallelism over {ep} ranks needs a process group "
                         f"of {ep} ranks (run under torchrun: spikeguard train --nproc {ep} --ep {ep})")
    dist_utils.set_spmd_backend(SPMD_BACKEND)
    is_qwen3 = type(cfg).__qualname__.startswith("Qwen3")
    set_sharding = set_qwen3_sharding_config if is_qwen3 else set_deepseek_v3_sharding_config
    set_sharding(cfg, enable_sp=False, enable_ep=True)
    return cfg


def _parallel_dims(ep: int):
    from torchtitan.distributed import ParallelDims, parallel_dims
    if not torch.cuda.is_available():
        # torchtitan 0.3.0 takes "cuda" when no accelerator is found
        # (tools/utils.get_device_info) and builds its mesh there; on a CPU-only machine
        # the mesh is a CPU one (gloo), as the process group is.
        parallel_dims.device_type = "cpu"
    dims = ParallelDims(dp_replicate=1, dp_shard=ep, cp=1, tp=1, pp=1, ep=ep, world_size=ep,
                        spmd_backend=SPMD_BACKEND)
    dims.build_mesh()
    return dims


def lm_loss(model: nn.Module, x_BT: torch.Tensor, y_BT: torch.Tensor) -> torch.Tensor:
    """Mean next-byte cross-entropy of a torchtitan model (its forward returns logits)."""
    logits = model(x_BT)
    return nn.functional.cross_entropy(logits.flatten(0, 1).float(), y_BT.flatten())


def build_titan_fsdp_model(name: str, sizes: TitanSizes, world: int, seed: int = 0,
                           ep: int = 1, param_dtype: str = "float32") -> nn.Module:
    """`build_titan_model` laid out as torchtitan's Trainer lays it out, inside a process
    group of `world` ranks (one included: torchtitan applies FSDP2 there too): torchtitan's
    own parallelize function (its EP over `ep` ranks where `ep` > 1, then FSDP2 over
    `world`: the embedding, each block, the norm and head together, the root), with
    FSDP2's public switch to a plain SUM reduce-scatter (torchtitan sets a gradient divide
    factor of 1, which FSDP2 makes a PREMUL_SUM that gloo refuses; the factor stays 1)."""
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims, parallel_dims
    from torchtitan.models.deepseek_v3.parallelize import parallelize_deepseekv3
    from torchtitan.models.qwen3.parallelize import parallelize_qwen3

    model = _built(name, sizes, seed, ep)
    if ep > 1:
        dims = _parallel_dims(ep)
    else:
        if not torch.cuda.is_available():
            parallel_dims.device_type = "cpu"   # as _parallel_dims
        dims = ParallelDims(dp_replicate=1, dp_shard=world, cp=1, tp=1, pp=1, ep=1,
                            world_size=world, spmd_backend=SPMD_BACKEND)
        dims.build_mesh()
    parallelize = parallelize_qwen3 if name == "qwen3" else parallelize_deepseekv3
    model = parallelize(model, parallel_dims=dims,
                        training=TrainingConfig(mixed_precision_param=param_dtype),
                        parallelism=ParallelismConfig(spmd_backend=SPMD_BACKEND),
                        compile_config=CompileConfig(), ac_config=None, dump_folder="/tmp")
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
    return model


__all__ = ["TitanSizes", "build_titan_model", "build_titan_fsdp_model", "lm_loss", "FAMILIES"]
