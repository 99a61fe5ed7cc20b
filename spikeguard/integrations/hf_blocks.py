"""Hugging Face transformers v5 MoE blocks, found by structure, never by class name.

T = tokens in the micro-batch, D = model width, E = experts, K = top-k, N = T*K routed
copies.

In transformers v5 the sparse MoE blocks share one convention (Mixtral, Qwen2/3-MoE,
OLMoE, DeepSeek-V3, ...): a router child (usually `gate`) computes top-k indices and
weights, then the block calls

    experts(hidden_states_TD, top_k_index_TK, top_k_weights_TK) -> out_TD

That call is the decision window: the counts per expert are a bincount of
`top_k_index_TK`, and no expert has run. A block is recognised when it has

  * an experts child whose `forward(hidden_states, top_k_index, top_k_weights)` takes
    the routed indices and weights (parameter names containing "index"/"indices"/"idx" and
    "weight") and holds 3-D parameters (E, ., .);
  * a router child beside it: a `top_k` attribute, or a 2-D weight of E rows.

Other children of the block (a shared expert and its gate, as in Qwen2-MoE or
DeepSeek) are its shared modules: kept whole, attributed to op "shared". This module
never imports transformers.
"""

from __future__ import annotations

import functools
import inspect
import logging
from typing import Optional

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy

from spikeguard.errors import UsageError
from spikeguard.memory.ledger import local_tensor
from spikeguard.runtime.adapter import BlockAdapter, preserved_rng
from spikeguard.integrations.hf_ep import (LocalWeights, check_ep_experts, ep_group,
                                           ep_implementation, family_agreement,
                                           implementations, observe_exchanges)
from spikeguard.integrations.hf_bytes import RegionBytes, RegionPlanner, derive_bytes, probe_bytes
from spikeguard.integrations.hf_window import run_window
from spikeguard.runtime.executor import base_policy

log = logging.getLogger("spikeguard")

CACHE_KWARGS = ("cache", "past_key_values", "past_key_value", "layer_past")
LOOKED_FOR = ("a module with an `experts` child called as experts(hidden_states, "
              "top_k_index, top_k_weights) holding 3-D expert weights, beside a top-k router "
              "(the Hugging Face transformers v5 MoE layout)")


def routed_arg_names(module: nn.Module) -> Optional[tuple[str, str, str]]:
    """The names of forward's first three parameters if they read (hidden states, routed
    indices, routed weights): the second holds "index"/"indices"/"idx", the third "weight"."""
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return None
    names = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(names) >= 3 and any(s in names[1].lower() for s in ("index", "indices", "idx")) \
            and "weight" in names[2].lower():
        return tuple(names[:3])
    return None


def num_experts_of(experts: nn.Module) -> Optional[int]:
    """E: the `num_experts` attribute, else the leading size shared by the 3-D weights."""
    if isinstance(getattr(experts, "num_experts", None), int):
        return experts.num_experts
    leading = {p.shape[0] for p in experts.parameters(recurse=False) if p.dim() == 3}
    return leading.pop() if len(leading) == 1 else None


def _router_of(block: nn.Module, experts: nn.Module, num_experts: int) -> Optional[nn.Module]:
    for name, child in block.named_children():
        if child is experts:
            continue
        if isinstance(getattr(child, "top_k", None), int):
            return child
        weight = getattr(child, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.shape[0] == num_experts:
            return child
    return None


def as_hf_block(module: nn.Module) -> Optional["HFBlock"]:
    """The parts of `module` if it has the v5 MoE block's structure, else None."""
    experts = getattr(module, "experts", None)
    if not isinstance(experts, nn.Module):
        return None
    arg_names = routed_arg_names(experts)
    if arg_names is None:
        return None
    if not any(p.dim() == 3 for p in experts.parameters(recurse=False)):
        return None
    num_experts = num_experts_of(experts)
    if num_experts is None:
        return None
    router = _router_of(module, experts, num_experts)
    if router is None:
        return None
    shared = [c for c in module.children() if c is not experts and c is not router]
    ep = ep_implementation(experts) if getattr(experts, "_is_expert_parallel", False) else None
    return HFBlock(module, experts, router, shared, num_experts, arg_names, ep)


def hf_layer_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Whole-layer recompute of a v5 decoder layer. Unlike the built-in model, v5 routers
    normalise the top-k weights in place (Mixtral: `router_top_value /= ...sum()`), and
    selective checkpointing refuses a cached tensor that was mutated (torch 2.13: "Tensor
    cached during selective activation checkpoint has been mutated"). So `topk` is
    recomputed here, from bitwise the same inputs; sort, nonzero and host syncs stay saved."""
    if op is torch.ops.aten.topk.default:
        return CheckpointPolicy.PREFER_RECOMPUTE
    return base_policy(ctx, op, *args, **kwargs)


def hf_ep_layer_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Whole-layer recompute under transformers' EP: sort is recomputed too (its output is
    clamped in place there, hf_ep.py); the functional all-to-alls and host syncs stay
    saved, the count exchange re-runs on every rank (the group recomputes the same layers)."""
    if op in (torch.ops.aten.sort.default, torch.ops.aten.sort.stable):
        return CheckpointPolicy.PREFER_RECOMPUTE
    return hf_layer_policy(ctx, op, *args, **kwargs)


class HFBlock:
    """One recognised block and its parts."""

    def __init__(self, block, experts, router, shared, num_experts, arg_names, ep=None):
        self.block, self.experts, self.router = block, experts, router
        self.shared, self.num_experts, self.arg_names = shared, num_experts, arg_names
        # transformers' EPImplementation calling these experts (hf_ep.py), or None; then
        # num_experts is this rank's local count and the window sees the received rows.
        self.ep = ep
        self.top_k = router.top_k if isinstance(getattr(router, "top_k", None), int) else None
        self.d_model = _d_model(router, experts, num_experts)


def _d_model(router: nn.Module, experts: nn.Module, num_experts: int) -> Optional[int]:
    """D: the router's input width (the columns of its (E, D) weight), else the experts'."""
    for weight in router.parameters():
        if weight.dim() == 2 and weight.shape[0] == num_experts:
            return weight.shape[1]
    for name in ("hidden_dim", "hidden_size"):
        if isinstance(getattr(experts, name, None), int):
            return getattr(experts, name)
    return getattr(getattr(experts, "config", None), "hidden_size", None)


class HFAdapter(BlockAdapter):
    """Runs each experts call of a transformers v5 MoE block as one region under the plan."""

    looked_for = LOOKED_FOR
    layer_policy = staticmethod(hf_layer_policy)

    @staticmethod
    def find(model: nn.Module) -> Optional["HFAdapter"]:
        found = [b for b in map(as_hf_block, model.modules()) if b is not None]
        return HFAdapter(model, found) if found else None

    def __init__(self, model: nn.Module, found: list[HFBlock]):
        super().__init__(model, [f.block for f in found])
        self.parts = {id(f.block): f for f in found}
        for module in model.modules():
            if getattr(module, "gradient_checkpointing", False) is True:
                raise UsageError(
                    "the model has transformers' activation checkpointing enabled; call "
                    "model.activation_checkpointing_disable() (gradient_checkpointing_disable() "
                    "in older versions) before attach: the guard decides recompute itself, "
                    "and the two must not be stacked")
        for f in found:
            # Checked before anything is installed, so a refused attach leaves no trace.
            if getattr(f.experts, "_is_expert_parallel", False):
                check_ep_experts(type(f.block).__name__, f.experts)
            elif "forward" in vars(f.experts):
                raise UsageError(f"the experts of {type(f.block).__name__} already have a "
                                 f"patched forward; another tool is wrapping them")
        eps = {f.ep is not None for f in found}
        if len(eps) > 1:
            raise UsageError("some MoE blocks are under transformers' expert parallelism "
                             "and some are not; the guard needs one layout")
        self.ep = found[0].ep
        self._originals: dict[int, list] = {}
        self._family = None   # the agreement under transformers' EP (agreement())
        if self.ep is not None:
            self.layer_policy = hf_ep_layer_policy
            self.layer_fallback_agreed = True

    def part(self, block: nn.Module) -> HFBlock:
        return self.parts[id(block)]

    def shared_modules(self, block: nn.Module) -> list[nn.Module]:
        return self.part(block).shared

    def top_k(self) -> int:
        return self.part(self.blocks[0]).top_k or 1

    def recompute_kwargs(self, layer: nn.Module, kwargs: dict) -> dict:
        """A recomputed decoder layer would append to the KV cache a second time (its
        recompute fails in torch's checkpoint, or corrupts the cache): like transformers'
        own layer checkpointing (GradientCheckpointingLayer, v5.24), the layer gets no
        cache; training does not read it."""
        if getattr(layer, "_can_checkpoint_with_cache", False):
            return kwargs
        return {k: (None if k in CACHE_KWARGS else v) for k, v in kwargs.items()}

    # ---- the window ---------------------------------------------------------------------
    def group(self):
        """The EP group of transformers' expert parallelism, if the experts are under it."""
        return ep_group(self.ep)

    def agreement(self):
        """Under transformers' EP, the agreement that observes its exchanges (hf_ep)."""
        self._family = family_agreement(self.model, self.ep) if self.ep is not None else None
        return self._family

    def install(self, block: nn.Module, door) -> None:
        part = self.part(block)
        if part.ep is not None:
            # The window is the experts' own forward on the rows this rank received,
            # called by transformers' EP implementation between its two exchanges.
            originals = self._originals[id(block)] = []
            observe_exchanges(self._family, self.model, part.experts, part.ep,
                              self.parent_layer(block))
            for impl in implementations(part.ep):
                orig = impl.experts_forward
                originals.append((impl, orig))
                impl.experts_forward = functools.partial(run_window, door, part,
                                                         self.layer_index(block), orig)
            return
        experts = part.experts
        orig = experts.forward
        window = functools.partial(run_window, door, part, self.layer_index(block), orig)
        window.__signature__ = inspect.signature(orig)
        experts.forward = window

    def uninstall(self, block: nn.Module) -> None:
        if self._family is not None:
            self._family.close()
        for impl, orig in self._originals.pop(id(block), []):
            impl.experts_forward = orig
        experts = self.part(block).experts
        if self.part(block).ep is None and "forward" in vars(experts):
            del experts.forward

    def _inner_call(self, part: HFBlock):
        """The experts' own computation, without transformers' EP exchanges around it (a
        probe or calibration must not communicate): its forward on the local weights."""
        if part.ep is None:
            return part.experts
        orig = part.ep.experts_forward
        orig = next((o for impl, o in self._originals.get(id(part.block), [])
                     if impl is part.ep), orig)
        weights = LocalWeights(part.experts)
        weights.params = {n: local_tensor(p) for n, p in weights.params.items()}

        def call(*args):
            with weights.installed():
                return orig(*args)
        return call

    def _routed_top_k(self) -> int:
        """Routed copies per row the experts call gets: the router's top-k, or one under
        transformers' EP (the received rows, each for one local expert)."""
        return 1 if self.ep is not None else self.top_k()

    # ---- what the planner needs ---------------------------------------------------------
    def byte_model(self, device) -> RegionBytes:
        """Derived from the weights' layout when transformers' own grouped_mm kernel runs
        the experts; otherwise learned by measurement (two token counts, linear fit).
        One model for all blocks: v5 models use one experts class throughout."""
        first = self.part(self.blocks[0])
        shape = derive_bytes(first.experts, self._routed_top_k(), ep=self.ep is not None)
        if shape is not None:
            return shape
        if first.d_model is None:
            raise UsageError(f"cannot size a probe for {type(first.experts).__name__}: no "
                             f"model width found (router weight, hidden_dim or config.hidden_size)")
        with preserved_rng(device):
            shape = probe_bytes(first.experts, first.num_experts, self._routed_top_k(), device,
                                first.d_model, call=self._inner_call(first))
        log.info("%s: bytes per routed token not derivable from its attributes; "
                 "learned by measurement (probe on %s routed copies, linear fit): keep %d B, "
                 "recompute keeps %d B per routed copy", type(first.experts).__name__,
                 " and ".join(map(str, shape.probe_counts)), shape.save_per_token,
                 shape.recompute_per_token)
        return shape

    def calibrate(self, cost, shape: RegionBytes, device) -> None:
        first = self.part(self.blocks[0])
        with preserved_rng(device):
            shape.calibrate(cost, first.experts, first.num_experts, self._routed_top_k(),
                            device, call=self._inner_call(first))

    def planner(self, shape: RegionBytes, cost) -> RegionPlanner:
        return RegionPlanner(shape, cost)
