"""Adapters that let the guard run on MoE blocks it did not define.

The protocol is spikeguard.runtime.adapter's; importing this package registers the
adapters with it, in the order `attach` tries them: spikeguard's own `MoEBlock`
(spikeguard.integrations.builtin), then Hugging Face transformers v5 MoE blocks,
recognised by structure (spikeguard.integrations.hf_blocks). Neither imports
transformers: `pip install spikeguard[hf]` is only needed to build HF models
(spikeguard.integrations.hf_models, `spikeguard train --hf`).
"""

from __future__ import annotations

from spikeguard.integrations.builtin import BuiltinAdapter
from spikeguard.integrations.hf_blocks import HFAdapter
from spikeguard.runtime.adapter import find_adapter, register_adapter

register_adapter(BuiltinAdapter)
register_adapter(HFAdapter)

__all__ = ["BuiltinAdapter", "HFAdapter", "find_adapter"]
