"""The expert-parallel group's overflow agreement: one all-reduce of a flag per attempt.

Implements spikeguard.runtime.agreement.OverflowAgreement over a process group; the
built-in adapter (spikeguard.integrations.builtin) builds it when the experts are sharded
(`parallelize_experts`), and the guard calls it after every micro-batch attempt.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist


class GroupAgreement:
    """MAX all-reduce of one int32 flag over the expert-parallel group."""

    def __init__(self, group):
        self.group = group

    def any_rank(self, mine: bool) -> bool:
        flag = torch.tensor([1 if mine else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return bool(flag.item())

    def any_overflowed(self, mine: bool) -> bool:
        return self.any_rank(mine)


def agreement_for(group) -> Optional[GroupAgreement]:
    """The agreement of `group`'s ranks, or None without a group (a rank decides alone)."""
    return GroupAgreement(group) if group is not None else None
