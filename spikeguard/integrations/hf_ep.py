"""Hugging Face models under transformers' own expert parallelism (v5.24).

M = routed rows this rank's experts received, L = experts local to this rank.

    from transformers.distributed.configuration_utils import DistributedConfig
    model = AutoModelForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(
        fsdp_size=2, ep_size=2))                       # under torchrun
    guard = spikeguard.attach(model, budget=..., optimizer=opt)

transformers replaces each experts module's `forward` with `ep_forward`
(`distributed/expert_parallel.py`), which calls an `EPImplementation`: `AllToAllEP`
exchanges the per-expert counts, brings the split sizes to the host, exchanges the
tokens, then calls the experts' own forward on the rows this rank received, as
`experts_forward(rows_MD, local_ids_M1, ones_M1)` (top-1, unit weights; the routing
weights are applied at combine, on the sender). That call is the decision window here:
its counts are this rank's real load, and it holds no collective, so recomputing or
offloading it never re-issues one, whatever each rank decides.

Three things differ from one process (transformers 5.24, torch 2.13):
  * the experts' parameters are DTensors (EP-sharded, then FSDP2 on the `efsdp` mesh);
    `ep_forward` swaps their local tensors in for the call (`_use_local_dtensor_params`);
    a recompute in backward runs outside that context, so it gets the forward's local
    weights back (`LocalWeights`);
  * under EP the experts' `grouped_mm` kernel clamps sort's output in place
    (`expert_ids_g.clamp_`), so selective checkpointing must not cache `sort`
    (it refuses a cached tensor that was mutated): `sort` is recomputed, from bitwise the
    same inputs;
  * a whole decoder layer recomputed re-runs `ep_forward`'s count exchange (a plain
    `all_to_all_single`, not one of the functional collectives whose outputs the policies
    keep): every rank of the EP group must recompute the same layers. Under "full" and
    the safety net's re-run they do; adaptive's per-layer fallback is agreed by the group
    before the layer runs (`BlockAdapter.layer_fallback_agreed`).

A rank whose device refuses inside a forward tells its peers at a flag point before every
FSDP unit's all-gather and at each layer's vote, after making with zeros what its peers
wait in (spikeguard.parallel.family_journal, which observes `AllToAllEP`'s dispatch and
combine): every rank re-runs the micro-batch together. A rank refused in backward
replays with zeros the rest of its backward's collectives (FSDP's and the reverse
all-to-alls) as an earlier step's made them (spikeguard.parallel.family_backward), and
every rank re-runs the step; where that cannot be known (the first step's backward), every
rank ends the job in one agreed line.
This module never imports transformers.
"""

from __future__ import annotations

import contextlib
from typing import Optional

from torch import nn

from spikeguard.errors import UsageError
from spikeguard.memory.ledger import local_tensor
from spikeguard.parallel.family_journal import FamilyAgreement, unit_of

# The attributes of transformers' dispatching implementations that hold a sub-implementation
# with its own `experts_forward` (AutoEP: its all-to-all and all-reduce paths).
SUB_IMPLEMENTATIONS = ("all_to_all", "all_reduce", "megamoe")


def ep_implementation(experts: nn.Module):
    """The EPImplementation that transformers' `ep_forward` on `experts` calls, or None."""
    forward = vars(experts).get("forward")
    code = getattr(forward, "__code__", None)
    if code is None or "implementation" not in code.co_freevars:
        return None
    cell = forward.__closure__[code.co_freevars.index("implementation")]
    impl = cell.cell_contents
    return impl if hasattr(impl, "experts_forward") and hasattr(impl, "ep_mesh") else None


def check_ep_experts(block_name: str, experts: nn.Module) -> None:
    """Refuse what the EP window cannot run: another tool's patch, or experts FSDP-sharded
    within the EP group (efsdp > 1: the local tensors are not whole experts)."""
    impl = ep_implementation(experts)
    if impl is None:
        raise UsageError(f"the experts of {block_name} are under transformers' expert "
                         f"parallelism but their forward is not transformers' ep_forward; "
                         f"another tool is wrapping them")
    for p in experts.parameters(recurse=False):
        local = local_tensor(p)
        if p.dim() == 3 and local.shape[0] != impl.num_local_experts:
            raise UsageError(
                f"the experts of {block_name} are FSDP-sharded within their expert-parallel "
                f"group ({local.shape[0]} of {impl.num_local_experts} local experts per "
                f"rank); use ep_size = fsdp_size * tp_size (efsdp 1)")


def implementations(impl) -> list:
    """`impl` and the sub-implementations it dispatches to (each has its experts_forward)."""
    found = [impl]
    for name in SUB_IMPLEMENTATIONS:
        sub = getattr(impl, name, None)
        if sub is not None and hasattr(sub, "experts_forward"):
            found.append(sub)
    return found


class LocalWeights:
    """The experts' local weights as the forward saw them, put back for a recompute.

    Inside `ep_forward` the module's parameters are the local tensors of its DTensors;
    a recompute in backward runs after that context restored the DTensors, and would
    compute on them (a DTensor weight against plain rows fails, or differs)."""

    def __init__(self, experts: nn.Module):
        self.experts = experts
        self.params = dict(experts._parameters)

    @contextlib.contextmanager
    def installed(self):
        params = self.experts._parameters
        before = dict(params)
        params.update(self.params)
        try:
            yield
        finally:
            params.update(before)


def ep_group(impl) -> Optional[object]:
    """The process group of the EP mesh of a transformers EP implementation."""
    return impl.ep_mesh.get_group() if impl is not None else None


def all_to_all_of(impl) -> Optional[object]:
    """The implementation among `impl`'s that exchanges tokens with transformers'
    AllToAllEP phases (`_dispatch_tokens`, `_combine_tokens`), or None."""
    return next((i for i in implementations(impl)
                 if hasattr(i, "_dispatch_tokens") and hasattr(i, "_combine_tokens")), None)


def family_agreement(model: nn.Module, impl) -> Optional[FamilyAgreement]:
    """The agreement of the ranks under transformers' EP: over the whole job where FSDP
    gathers across more ranks than the EP group (a refusal stalls those too), else over
    the EP group. None without EP."""
    group = ep_group(impl)
    if group is None:
        return None
    import torch.distributed as dist
    if dist.get_world_size() > impl.ep_mesh.size():
        group = dist.group.WORLD
    width = getattr(getattr(model, "config", None), "hidden_size", None)
    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    return FamilyAgreement(group, model, int(width), dtype)


def observe_exchanges(agreement: Optional[FamilyAgreement], model: nn.Module,
                      experts: nn.Module, impl, layer: nn.Module) -> None:
    """Let `agreement` watch the exchanges of one MoE layer: its flag point at the FSDP
    unit that holds it, else at its decoder `layer`."""
    exchanging = all_to_all_of(impl)
    if agreement is not None and exchanging is not None:
        agreement.observe(exchanging, unit_of(model, experts) or layer)
