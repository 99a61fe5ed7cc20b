"""Model configuration and named presets of the built-in MoE transformer.

`tiny` is for tests (seconds), `small` for the demo (a few million parameters, a step
well under a second on 2 CPU cores), `medium` for benchmarks (8 layers, 64 experts).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from spikeguard.errors import UsageError


@dataclass(kw_only=True)
class ModelConfig:
    """Shape of the built-in decoder-only MoE transformer; validated on creation."""

    vocab_size: int = 256
    seq_len: int = 64
    d_model: int = 64
    num_layers: int = 2
    num_heads: int = 2
    num_experts: int = 4
    top_k: int = 2
    d_expert: int = 64
    num_shared_experts: int = 0
    router_bias: bool = False
    aux_loss_coef: float = 0.01

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "d_model", "num_layers", "num_heads",
                     "num_experts", "top_k", "d_expert"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise UsageError(f"model.{name} must be a positive integer, got {value!r}")
        if self.num_shared_experts < 0:
            raise UsageError(f"model.num_shared_experts must be >= 0, got {self.num_shared_experts}")
        if self.top_k > self.num_experts:
            raise UsageError(
                f"model.top_k ({self.top_k}) cannot exceed model.num_experts ({self.num_experts})")
        if self.d_model % self.num_heads:
            raise UsageError(
                f"model.d_model ({self.d_model}) must be divisible by num_heads ({self.num_heads})")
        if self.aux_loss_coef < 0:
            raise UsageError(f"model.aux_loss_coef must be >= 0, got {self.aux_loss_coef}")

    def to_dict(self) -> dict:
        return asdict(self)


PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(seq_len=32, d_model=32, num_layers=2, num_heads=2, num_experts=4,
                        top_k=2, d_expert=32),
    "small": ModelConfig(seq_len=128, d_model=128, num_layers=4, num_heads=4, num_experts=8,
                         top_k=2, d_expert=256, num_shared_experts=1),
    "medium": ModelConfig(seq_len=256, d_model=256, num_layers=8, num_heads=8, num_experts=64,
                          top_k=4, d_expert=128, num_shared_experts=1),
}


def model_config(preset: str, **overrides) -> ModelConfig:
    """The named preset with `overrides` applied (None values are ignored)."""
    if preset not in PRESETS:
        raise UsageError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    overrides = {k: v for k, v in overrides.items() if v is not None}
    unknown = set(overrides) - set(PRESETS[preset].to_dict())
    if unknown:
        raise UsageError(f"unknown model setting(s): {', '.join(sorted(unknown))}")
    return replace(PRESETS[preset], **overrides)
