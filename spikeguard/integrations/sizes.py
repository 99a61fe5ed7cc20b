"""The checks every small model size set of an integration makes (Hugging Face's
`HFSizes`, torchtitan's `TitanSizes`): sizes a user passes on the command line, refused
in one line before anything is built."""

from __future__ import annotations

from dataclasses import asdict

from spikeguard.errors import UsageError


def check_model_sizes(sizes) -> None:
    """Every field a positive integer; top_k at most num_experts; d_model split evenly
    into num_heads."""
    for name, value in asdict(sizes).items():
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise UsageError(f"{name} must be a positive integer, got {value!r}")
    if sizes.top_k > sizes.num_experts:
        raise UsageError(f"top_k {sizes.top_k} is above num_experts {sizes.num_experts}")
    if sizes.d_model % sizes.num_heads:
        raise UsageError(f"d_model {sizes.d_model} must divide into {sizes.num_heads} heads")
