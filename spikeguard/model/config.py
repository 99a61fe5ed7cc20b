"""Model configuration and named presets of the built-in MoE transformer.

`tiny` is for tests (seconds), `small` for the demo (a few million parameters, a step
well under a second on 2 CPU cores), `medium` for benchmarks (8 layers, 64 experts).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from spikeguard.errors import UsageError
from spikeguard.model.sizes import SHAPE_FIELDS, check_shape


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
        check_shape(self, (*SHAPE_FIELDS, "vocab_size"))
        if self.num_shared_experts < 0:
            raise UsageError(f"model.num_shared_experts must be >= 0, got {self.num_shared_experts}")
        if self.aux_loss_coef < 0:
            raise UsageError(f"model.aux_loss_coef must be >= 0, got {self.aux_loss_coef}")

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def num_params(self) -> int:
        """Parameters of the built model, counted from the shape (nothing is allocated)."""
        d, f = self.d_model, self.d_expert
        per_layer = (4 * d * d                               # qkv, proj
                     + d * self.num_experts                  # router
                     + self.num_experts * 3 * d * f          # w13, w2
                     + self.num_shared_experts * 3 * d * f   # the shared SwiGLU
                     + 2 * d)                                # norms
        return (self.vocab_size * d * 2 + self.seq_len * d + d   # embeddings, head, norm
                + self.num_layers * per_layer)


# fp32 parameter, its gradient, and AdamW's two moments
TRAINING_BYTES_PER_PARAM = 4 * 4


def _gib(num_bytes: int) -> str:
    # model/ sits below memory/ (and its format_bytes): the rooms import downwards only
    return f"{num_bytes / 2**30:.3g} GiB"


def host_memory_bytes() -> int:
    """This machine's physical memory (0 where the platform does not say)."""
    import os

    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def check_trainable_size(num_params: int, activation_bytes: int = 0,
                         what: str = "the model") -> None:
    """Refuse, before anything is allocated, a run whose parameters, gradients and
    optimizer state, plus a lower bound of one micro-batch's activations, exceed this
    machine's memory (the model is built on the host first): a typo such as
    --d-model 10000000 otherwise dies in the allocator a minute in."""
    state = num_params * TRAINING_BYTES_PER_PARAM
    have = host_memory_bytes()
    if have and state + activation_bytes > have:
        raise UsageError(f"{what} has {num_params:.3g} parameters: training it needs at least "
                         f"{_gib(state + activation_bytes)} "
                         f"({_gib(state)} of fp32 weights, gradients "
                         f"and AdamW state, {_gib(activation_bytes)} "
                         f"of one micro-batch's activations), more than this machine's "
                         f"{_gib(have)} of memory")


def activation_bytes_floor(num_tokens: int, vocab_size: int, d_model: int,
                           num_layers: int) -> int:
    """What a micro-batch of `num_tokens` keeps at the least, fp32: its logits and their
    gradient, and one hidden state per layer."""
    return num_tokens * 4 * (2 * vocab_size + num_layers * d_model)


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
