"""The block adapter: what the guard needs to know about one family of MoE blocks.

The guard (spikeguard.runtime.guard) is written against this small protocol, not against
a block class, so the same decision window, planner, ledger and executor serve the
built-in `MoEBlock` (spikeguard.integrations.builtin) and the MoE blocks of Hugging Face
transformers v5 (spikeguard.integrations.hf_blocks), found by their structure. The
protocol lives here, in runtime; the adapters live in integrations, whose `ADAPTERS` the
caller hands to `attach` (`spikeguard.attach` does): an explicit list, no registry filled
at import, and runtime never imports integrations.

An adapter answers, for the blocks it found in one model:
  * which blocks, in forward order, and each block's layer index among them;
  * the module that directly contains a block (its transformer layer: the guard wraps
    that layer's forward for whole-layer recompute) and the block's shared modules
    (shared experts: their bytes are attributed to op "shared", policy "keep");
  * how to install / remove the decision window around the experts call;
  * the byte model per routed token copy (an `ExpertShape`-like object with
    `bytes_per_token()`), the planner over the plans it can run, and the cost calibration.
"""

from __future__ import annotations

import functools
from typing import Any, Optional, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from spikeguard.errors import UsageError
# What shared experts and dense (non-MoE) layers do, whatever the routing: they are not
# planned per micro-batch (their bytes do not move with the counts), only set once.
from spikeguard.names import SHARED_POLICIES  # re-exported
from spikeguard.runtime.executor import base_policy


def find_adapter(model: nn.Module, adapters: Sequence[type]) -> "BlockAdapter":
    """The adapter for `model` among `adapters` (classes with `find(model)` and
    `looked_for`, tried in order); a UsageError naming what was looked for if none."""
    if not adapters:
        raise UsageError("no block adapter was given: attach with spikeguard.attach, which "
                         "gives the built-in, Hugging Face and torchtitan ones")
    for kind in adapters:
        adapter = kind.find(model)
        if adapter is not None:
            return adapter
    raise UsageError("no MoE block found in the model; looked for: "
                     + "; or ".join(k.looked_for for k in adapters))


class BlockAdapter:
    """Base of the adapters; subclasses fill in the family-specific parts."""

    #: what the "no block found" error says was looked for
    looked_for = ""
    #: the selective-checkpoint policy of a whole recomputed layer ("full", or adaptive's
    #: layer fallback): recompute all but the ops that must not run twice
    layer_policy = staticmethod(base_policy)
    #: whether a layer recomputed whole re-issues a collective (one its policy cannot keep):
    #: then adaptive's per-layer fallback is agreed by the expert-parallel group
    #: (`agreement().any_rank`) before the layer runs, so all its ranks recompute it or none
    layer_fallback_agreed = False
    #: whether, under expert parallelism, the dispatch exchange's sent and received rows are
    #: freed before the decision window opens (then they are in no growth the window
    #: measures, and a layer's entry check adds them: plan/room.py `EntryState`)
    exchange_freed_before_window = False

    def __init__(self, model: nn.Module, blocks: list[nn.Module]):
        self.model = model
        self.blocks = blocks
        self._parents: dict[int, nn.Module] = {}

    # ---- structure ----------------------------------------------------------------------
    def layer_index(self, block: nn.Module) -> int:
        return self.blocks.index(block)

    def parent_layer(self, block: nn.Module) -> nn.Module:
        """The module that directly contains `block` (its transformer layer)."""
        if id(block) not in self._parents:
            self._parents[id(block)] = _parent_of(self.model, block)
        return self._parents[id(block)]

    def shared_modules(self, block: nn.Module) -> list[nn.Module]:
        return []

    def dense_layers(self) -> list[nn.Module]:
        """Layers beside the MoE layers in their container that hold no MoE block
        (DeepSeek's first dense layers, Qwen3-MoE's `mlp_only_layers`)."""
        moe_layers = {id(self.parent_layer(b)) for b in self.blocks}
        containers = {}
        for block in self.blocks:
            container = _parent_of(self.model, self.parent_layer(block))
            containers[id(container)] = container
        return [m for c in containers.values() for m in c.children()
                if id(m) not in moe_layers and any(p.requires_grad for p in m.parameters())]

    def apply_shared_policy(self, policy: str, guard) -> list[nn.Module]:
        """Under "recompute", every shared module and dense layer runs under a plain
        non-reentrant checkpoint (only its inputs are kept); returns the modules wrapped,
        whose instance `forward` detach removes. "keep" changes nothing."""
        if policy == "keep":
            return []
        modules = [s for b in self.blocks for s in self.shared_modules(b)] + self.dense_layers()
        for module in modules:
            module.forward = functools.partial(_recomputed, self, guard, module, module.forward)
        return modules

    def group(self) -> Optional[Any]:
        """The expert-parallel process group, if the experts are sharded; else None."""
        return None

    def agreement(self):
        """How the ranks of the expert-parallel group agree on a micro-batch's overflow
        (spikeguard.runtime.agreement.OverflowAgreement); None where the experts are not
        sharded: a rank then decides alone."""
        return None

    def top_k(self) -> int:
        raise NotImplementedError

    def recompute_kwargs(self, layer: nn.Module, kwargs: dict) -> dict:
        """The keyword arguments a whole layer is recomputed with (some state, such as a
        KV cache, must not be written twice)."""
        return kwargs

    # ---- the window ---------------------------------------------------------------------
    def install(self, block: nn.Module, door) -> None:
        """Put the decision window around `block`'s experts call; the window uses the
        guard through `door` (spikeguard.runtime.doors.WindowDoor)."""
        raise NotImplementedError

    def uninstall(self, block: nn.Module) -> None:
        raise NotImplementedError

    # ---- what the planner needs ---------------------------------------------------------
    def byte_model(self, device):
        raise NotImplementedError

    def calibrate(self, cost, shape, device) -> None:
        raise NotImplementedError

    def planner(self, shape, cost):
        raise NotImplementedError


def preserved_rng(device: torch.device):
    """Calibration and probes draw random numbers: the user's generators (CPU, and the
    device's) come back as they were, so attaching never shifts a dropout mask or a
    router's jitter."""
    devices = [device] if device.type == "cuda" else []
    return torch.random.fork_rng(devices=devices, device_type=device.type if devices else "cuda")


def _recomputed(adapter: BlockAdapter, guard, module: nn.Module, orig_forward, *args, **kwargs):
    # Inside a whole-layer checkpoint the layer is recomputed already: no nesting.
    if guard.in_full_region or not torch.is_grad_enabled():
        return orig_forward(*args, **kwargs)
    return checkpoint(orig_forward, *args, use_reentrant=False,
                      **adapter.recompute_kwargs(module, kwargs))


def _parent_of(model: nn.Module, block: nn.Module) -> nn.Module:
    for module in model.modules():
        if any(child is block for child in module.children()):
            return module
    return block
