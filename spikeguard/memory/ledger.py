"""The memory ledger: bytes in use on the device, attributed, and (on CPU) enforced.

What the budget counts, precisely:
  * static bytes: parameters, their gradients (counted from the start, as the first
    backward allocates them), and optimizer state (AdamW: two moments per parameter)
    when the guard is given the optimizer;
  * activation bytes: every tensor the autograd graph keeps for backward on the device,
    deduplicated by storage (two views of one storage count once), attributed to
    (micro-batch, layer, operator), from the moment it is saved until autograd frees it;
    plus tensors that selective checkpointing caches, and tensors brought back from host
    memory during backward;
  * not counted: forward temporaries that nothing keeps for backward, gradients of
    activations during backward, and the allocator's fragmentation. Offloaded bytes are
    counted separately, as host bytes.

On CPU the device is emulated: the ledger raises `DeviceOutOfMemory` when saving a tensor
would take the activation bytes over the budget. On CUDA the allocator is the truth:
`in_use()` reads `torch.cuda.memory_allocated`, and the real `torch.cuda.OutOfMemoryError`
is what a static policy dies of.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Optional

import torch

from spikeguard.errors import DeviceOutOfMemory
from spikeguard.memory.budget import format_bytes

StorageKey = tuple[object, int]


def storage_key(t: torch.Tensor) -> StorageKey:
    """Identity of the memory a tensor lives in (views of one storage share it)."""
    return (t.device, t.untyped_storage().data_ptr())


def storage_bytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


@dataclass
class _Entry:
    num_bytes: int
    refs: int
    where: tuple[int, int, str]   # (micro-batch, layer, op)


@dataclass
class Ledger:
    """Live device bytes, by storage, with a peak; enforces the budget on CPU."""

    budget_bytes: int
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    enforce: bool = True
    static_bytes: int = 0
    activation_bytes: int = 0
    host_bytes: int = 0
    peak_bytes: int = 0
    _entries: dict[StorageKey, _Entry] = field(default_factory=dict)
    _by_where: dict[tuple[int, int, str], int] = field(default_factory=lambda: defaultdict(int))

    def __post_init__(self) -> None:
        # Read on every saved tensor: a plain attribute, not a property.
        self.is_cuda = self.device.type == "cuda"
        # Under expert parallelism a rank must not stop mid-forward (the others would wait
        # in the next all-to-all): it records the first overflow and carries on, and the
        # group decides together once the forward is done.
        self.defer_overflow = False
        self.overflow: Optional[DeviceOutOfMemory] = None

    def in_use(self) -> int:
        """Bytes in use on the device now: the allocator's figure on CUDA, ours on CPU."""
        if self.is_cuda:
            return torch.cuda.memory_allocated(self.device)
        return self.static_bytes + self.activation_bytes

    def set_static(self, num_bytes: int) -> None:
        self.static_bytes = num_bytes
        self._note_peak()

    def acquire(self, key: StorageKey, num_bytes: int, where: tuple[int, int, str],
                check: bool = True) -> None:
        """One more holder of a storage; the first one adds its bytes (and may raise)."""
        entry = self._entries.get(key)
        if entry is not None:
            entry.refs += 1
            return
        if check and self.enforce and not self.is_cuda:
            after = self.static_bytes + self.activation_bytes + num_bytes
            if after > self.budget_bytes:
                err = DeviceOutOfMemory(
                    f"saving {format_bytes(num_bytes)} for {_where_str(where)} would put "
                    f"{format_bytes(after)} on a device of {format_bytes(self.budget_bytes)}",
                    needed_bytes=after, budget_bytes=self.budget_bytes)
                if not self.defer_overflow:
                    raise err
                self.overflow = self.overflow or err
        self._entries[key] = _Entry(num_bytes, 1, where)
        self.activation_bytes += num_bytes
        self._by_where[where] += num_bytes
        if self.is_cuda:
            self._note_peak()
        elif self.static_bytes + self.activation_bytes > self.peak_bytes:
            self.peak_bytes = self.static_bytes + self.activation_bytes

    def release(self, key: StorageKey) -> None:
        entry = self._entries.get(key)
        if entry is None:
            return
        entry.refs -= 1
        if entry.refs <= 0:
            self.drop(key)

    def drop(self, key: StorageKey) -> int:
        """Forget a storage whatever its holders (evicted to host, or freed); its bytes."""
        entry = self._entries.pop(key, None)
        if entry is None:
            return 0
        self.activation_bytes -= entry.num_bytes
        self._by_where[entry.where] -= entry.num_bytes
        return entry.num_bytes

    def holds(self, key: StorageKey) -> bool:
        return key in self._entries

    def bytes_by(self, micro_batch: int | None = None, layer: int | None = None,
                 op: str | None = None) -> int:
        """Live bytes whose attribution matches every given field."""
        return sum(n for (mb, ly, o), n in self._by_where.items()
                   if (micro_batch is None or mb == micro_batch)
                   and (layer is None or ly == layer) and (op is None or o == op))

    def add_host(self, num_bytes: int) -> None:
        self.host_bytes += num_bytes

    def reset_peak(self) -> None:
        self.peak_bytes = self.in_use()

    def _note_peak(self) -> None:
        if self.is_cuda:
            self.peak_bytes = max(self.peak_bytes, torch.cuda.max_memory_allocated(self.device))
        else:
            self.peak_bytes = max(self.peak_bytes, self.in_use())


def _where_str(where: tuple[int, int, str]) -> str:
    mb, layer, op = where
    return f"micro-batch {mb}, layer {layer}, op {op}"
