"""Tiny Hugging Face transformers MoE models, built offline with random weights.

    from spikeguard.integrations.hf_models import HFSizes, build_hf_model
    model = build_hf_model("mixtral", HFSizes())          # or "qwen3_moe", "olmoe", ...
    model = build_hf_model("path/to/config.json", HFSizes(num_layers=4))

The architecture (model type, routing, shared experts, norms) comes from the named
model type's default config or from a config JSON (a file, or the JSON text itself);
the sizes are replaced by small ones (`HFSizes`), the vocabulary by the 256 byte values
of spikeguard's corpus, the KV cache is off (training) and the router's load-balancing
loss on. Nothing is downloaded. Needs `pip install spikeguard[hf]`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from spikeguard.errors import UsageError
from spikeguard.integrations.sizes import check_model_sizes

BYTE_VOCAB = 256
EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
TOP_K_KEYS = ("num_experts_per_tok", "moe_topk", "moe_k")
EXPERT_WIDTH_KEYS = ("intermediate_size", "moe_intermediate_size",
                     "shared_expert_intermediate_size")
TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


@dataclass(kw_only=True)
class HFSizes:
    """The small sizes a config is built at; validated on creation."""

    d_model: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    num_experts: int = 8
    top_k: int = 2
    d_expert: int = 64
    seq_len: int = 128

    def __post_init__(self) -> None:
        check_model_sizes(self)
        if self.num_heads % self.num_kv_heads:
            raise UsageError(f"{self.num_heads} heads must divide into {self.num_kv_heads} "
                             f"key/value heads")

    @property
    def num_params(self) -> int:
        """About the parameters a model of these sizes has (attention, router, SwiGLU
        experts, byte embeddings and head), from the shape: to refuse an absurd size before
        transformers allocates it. Shared experts and dense layers are not counted."""
        d, f = self.d_model, self.d_expert
        per_layer = 4 * d * d + d * self.num_experts + self.num_experts * 3 * d * f + 2 * d
        return 2 * BYTE_VOCAB * d + d + self.num_layers * per_layer


def _transformers():
    try:
        import transformers
    except ImportError as exc:
        raise UsageError(f"Hugging Face models need transformers: pip install "
                         f"'spikeguard[hf]' ({exc})") from None
    return transformers


def read_config_source(source: str) -> tuple[str, dict[str, Any]]:
    """(model_type, config values) from a model type name, a JSON file or JSON text."""
    if not isinstance(source, str) or not source.strip():
        raise UsageError("--hf needs a transformers model type (e.g. mixtral) or a config JSON")
    text = source.strip()
    if text.startswith("{"):
        values = _parse_json(text, "the --hf JSON text")
    elif text.endswith(".json") or Path(text).is_file():
        path = Path(text)
        if not path.is_file():
            raise UsageError(f"config JSON not found: {path}")
        values = _parse_json(path.read_text(encoding="utf-8", errors="replace"), str(path))
    else:
        return text, {}
    model_type = values.pop("model_type", None)
    if not isinstance(model_type, str) or not model_type:
        raise UsageError("the config JSON has no \"model_type\" (e.g. \"mixtral\")")
    return model_type, values


def _parse_json(text: str, where: str) -> dict[str, Any]:
    try:
        values = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(f"{where} is not valid JSON: {exc.msg} at line {exc.lineno}") from None
    if not isinstance(values, dict):
        raise UsageError(f"{where} must hold a JSON object")
    return values


def tiny_config(source: str, sizes: HFSizes):
    """The transformers config of `source` at `sizes` (see the module docstring)."""
    transformers = _transformers()
    model_type, values = read_config_source(source)
    try:
        cfg = transformers.AutoConfig.for_model(model_type, **values)
    except ValueError:
        raise UsageError(f"unknown transformers model type {model_type!r} "
                         f"(MoE examples: mixtral, qwen3_moe, olmoe, qwen2_moe, deepseek_v3)") from None
    except TypeError as exc:
        raise UsageError(f"config values do not fit {model_type}: {exc}") from None
    have = cfg.to_dict()
    experts_key = next((k for k in EXPERT_COUNT_KEYS if k in have), None)
    top_k_key = next((k for k in TOP_K_KEYS if k in have), None)
    if experts_key is None or top_k_key is None:
        raise UsageError(f"{model_type} is not a mixture-of-experts model (its config has none "
                         f"of {', '.join(EXPERT_COUNT_KEYS)})")
    updates: dict[str, Any] = {
        "hidden_size": sizes.d_model, "num_hidden_layers": sizes.num_layers,
        "num_attention_heads": sizes.num_heads, "num_key_value_heads": sizes.num_kv_heads,
        "vocab_size": BYTE_VOCAB, experts_key: sizes.num_experts, top_k_key: sizes.top_k,
        "use_cache": False, "output_router_logits": True,
        "max_position_embeddings": max(sizes.seq_len + 1, 64),
    }
    updates.update({k: sizes.d_expert for k in EXPERT_WIDTH_KEYS if k in have})
    if "head_dim" in have:
        updates["head_dim"] = sizes.d_model // sizes.num_heads
    if "kv_lora_rank" in have:  # DeepSeek-style latent attention
        updates.update(kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
                       qk_nope_head_dim=8, qk_head_dim=16, v_head_dim=16, head_dim=8)
    if isinstance(have.get("first_k_dense_replace"), int):  # leading dense layers
        updates["first_k_dense_replace"] = min(have["first_k_dense_replace"], sizes.num_layers - 1)
    if "n_group" in have:
        updates.update(n_group=1, topk_group=1)
    if isinstance(have.get("layer_types"), list):  # per-layer kinds: the first ones
        kinds = have["layer_types"]
        updates["layer_types"] = [kinds[i % len(kinds)] for i in range(sizes.num_layers)]
    for key in TOKEN_ID_KEYS:
        if isinstance(have.get(key), int) and have[key] >= BYTE_VOCAB:
            updates[key] = None
    # Built again with the sizes, so fields the config derives from them follow.
    try:
        return transformers.AutoConfig.for_model(model_type, **{**values, **updates})
    except (TypeError, ValueError) as exc:
        raise UsageError(f"{model_type} cannot be built small: {str(exc).splitlines()[0]}") from None


def build_hf_model(source: str, sizes: HFSizes, seed: int = 0) -> nn.Module:
    """A causal LM of `source`'s architecture at `sizes`, random weights from `seed`."""
    transformers = _transformers()
    cfg = tiny_config(source, sizes)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            model = transformers.AutoModelForCausalLM.from_config(cfg)
        except ValueError as exc:
            raise UsageError(f"transformers has no causal LM for {cfg.model_type}: "
                             f"{str(exc).splitlines()[0]}") from None
    return model.float()


def distribute_hf_model(model: nn.Module, nproc: int, ep: int) -> nn.Module:
    """`model` under transformers' own parallelism on this process group (torchrun):
    FSDP2 over all `nproc` ranks, experts sharded over `ep` (`DistributedConfig(
    fsdp_size=nproc, ep_size=ep)`), as `from_pretrained(distributed_config=...)` lays it out
    after init. Every rank must hold the same weights (built from the same seed): each
    keeps its shard of its own copy. Needs accelerate (`spikeguard[hf]`)."""
    try:
        import accelerate  # noqa: F401  (transformers' FSDP2 path needs it)
        from transformers.distributed.configuration_utils import DistributedConfig
    except ImportError as exc:
        raise UsageError(f"--hf with --nproc needs transformers' distributed support and "
                         f"accelerate: pip install 'spikeguard[hf]' ({exc})") from None
    kind = type(model)
    try:
        config, _, mesh = kind.prepare_distribute_model(DistributedConfig(fsdp_size=nproc,
                                                                          ep_size=ep))
        return kind.maybe_distribute_model(model, config, mesh)
    except ValueError as exc:
        raise UsageError(f"transformers cannot lay {model.config.model_type} out on "
                         f"{nproc} processes with ep {ep}: {str(exc).splitlines()[0]}") from None
