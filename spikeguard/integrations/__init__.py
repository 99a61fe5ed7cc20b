"""Adapters that let the guard run on MoE blocks it did not define.

The protocol is spikeguard.runtime.adapter's; `ADAPTERS` lists the adapters in the order
`attach` tries them (`spikeguard.attach` hands it to the guard; no registry is filled at
import): spikeguard's own `MoEBlock`
(spikeguard.integrations.builtin), then Hugging Face transformers v5 MoE blocks,
recognised by structure (spikeguard.integrations.hf_blocks), and torchtitan's MoE
layers, also by structure (spikeguard.integrations.titan_blocks; tried before the HF one,
whose shape they do not have anyway). None imports transformers or torchtitan:
`pip install spikeguard[hf]` / `spikeguard[titan]` are only needed to build their models
(hf_models.py, titan_models.py; `spikeguard train --hf` / `--titan`).
"""

from __future__ import annotations

from spikeguard.integrations.builtin import BuiltinAdapter
from spikeguard.integrations.hf_blocks import HFAdapter
from spikeguard.integrations.titan_blocks import TitanAdapter
from spikeguard.runtime import adapter as _adapter

ADAPTERS = (BuiltinAdapter, TitanAdapter, HFAdapter)


def find_adapter(model):
    """The adapter of `model`'s MoE blocks among ADAPTERS (spikeguard.runtime.adapter)."""
    return _adapter.find_adapter(model, ADAPTERS)


__all__ = ["ADAPTERS", "BuiltinAdapter", "HFAdapter", "TitanAdapter", "find_adapter"]
