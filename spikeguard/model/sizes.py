"""The one check of an MoE transformer's sizes, whoever holds them: the built-in model's
ModelConfig, the integrations' HFSizes and TitanSizes, the simulator's SimModel. Sizes a
user gives (command line, TOML, a simulator config) are refused in one line, with the same
words wherever they are given."""

from __future__ import annotations

from typing import Iterable

from spikeguard.errors import UsageError

SHAPE_FIELDS = ("num_layers", "d_model", "num_heads", "num_experts", "top_k", "d_expert",
                "seq_len")


def check_shape(sizes, names: Iterable[str] = SHAPE_FIELDS, section: str = "model") -> None:
    """Each of `names` a positive integer; top_k at most num_experts; d_model split evenly
    into num_heads (the attention's head size)."""
    for name in names:
        value = getattr(sizes, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise UsageError(f"{section}.{name} must be a positive integer, got {value!r}")
    if sizes.top_k > sizes.num_experts:
        raise UsageError(f"{section}.top_k ({sizes.top_k}) cannot exceed {section}.num_experts "
                         f"({sizes.num_experts})")
    if sizes.d_model % sizes.num_heads:
        raise UsageError(f"{section}.d_model {sizes.d_model} must divide into "
                         f"{sizes.num_heads} heads")
