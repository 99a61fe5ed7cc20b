"""The checks every small model size set of an integration makes (Hugging Face's
`HFSizes`, torchtitan's `TitanSizes`): sizes a user passes on the command line, refused
in one line before anything is built."""

from __future__ import annotations

from dataclasses import fields

from spikeguard.model.sizes import check_shape


def check_model_sizes(sizes) -> None:
    """Every field a positive integer, and the shape's rules (spikeguard.model.sizes)."""
    check_shape(sizes, tuple(f.name for f in fields(sizes)))
