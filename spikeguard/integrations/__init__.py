"""Adapters that let the guard run on MoE blocks it did not define.

`find_adapter(model)` returns the adapter for the blocks found in `model`: spikeguard's
own `MoEBlock` (spikeguard.integrations.builtin), else Hugging Face transformers v5 MoE
blocks, recognised by structure (spikeguard.integrations.hf_blocks). Neither imports
transformers: `pip install spikeguard[hf]` is only needed to build HF models
(spikeguard.integrations.hf_models, `spikeguard train --hf`).
"""

from __future__ import annotations

from torch import nn

from spikeguard.errors import UsageError


def find_adapter(model: nn.Module):
    """The block adapter for `model`; a UsageError naming what was looked for if none."""
    from spikeguard.integrations.builtin import BuiltinAdapter
    from spikeguard.integrations.hf_blocks import HFAdapter

    for kind in (BuiltinAdapter, HFAdapter):
        adapter = kind.find(model)
        if adapter is not None:
            return adapter
    raise UsageError("no MoE block found in the model; looked for: "
                     + "; or ".join(k.looked_for for k in (BuiltinAdapter, HFAdapter)))
