"""The ledger: the device's bytes in use and peak, and their attribution.

The figure is the device's (spikeguard.memory.device): what an allocator counts, every
live storage on the device, read from the CPU allocator that emulates the device, or from
CUDA's. The ledger adds the explanation of that figure: the saved activations of the
expert path and the layers around it, by (micro-batch, layer, operator), deduplicated by
storage, from the moment autograd saves them until it frees them (plus tensors selective
checkpointing caches, and reloads from host memory in backward). Where a layer's expert
path ran with no saved-tensor hook (spikeguard/runtime/hookless.py) its bytes are the byte
model's, per operator, until its backward (`acquire_modelled`). The planner reads the
attribution (what a layer's attention part keeps, what can be evicted); the budget is
checked against the device's figure, by the device itself, at every allocation.
Offloaded bytes are counted separately, as host bytes.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch

from spikeguard.memory.device import make_device

StorageKey = tuple[object, int]


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage this rank holds: a DTensor's local shard (a DTensor has no
    storage of its own: `untyped_storage()` raises on it, torch 2.13), else `t`. Outside
    autograd `to_local()` returns the shard itself, not an alias (torch 2.13)."""
    if type(t) is torch.Tensor:   # the common case first: no attribute looked up
        return t
    to_local = getattr(t, "to_local", None)
    if to_local is not None:
        with torch.no_grad():
            return to_local()
    return t


def plain_tensor(t: torch.Tensor) -> torch.Tensor:
    """`t`, or the tensor an asynchronous collective's result wraps once it is waited for
    (torch's AsyncCollectiveTensor, what `_functional_collectives.all_to_all_single`
    returns, e.g. in torchtitan's dispatcher: the wrapper has no valid storage of its own)."""
    if type(t) is torch.Tensor:
        return t
    wait = getattr(t, "trigger_wait", None)
    return wait() if wait is not None else t


def storage_key(t: torch.Tensor) -> StorageKey:
    """Identity of the memory a tensor lives in (views of one storage share it)."""
    t = local_tensor(plain_tensor(t))
    return (t.device, t.untyped_storage().data_ptr())


def storage_bytes(t: torch.Tensor) -> int:
    return local_tensor(plain_tensor(t)).untyped_storage().nbytes()


@dataclass
class _Entry:
    num_bytes: int
    refs: int
    where: tuple[int, int, str]   # (micro-batch, layer, op)


@dataclass
class Ledger:
    """The device's live bytes and peak, with the saved tensors attributed."""

    budget_bytes: int
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    static_bytes: int = 0      # parameters, gradients, optimizer state (for the record)
    activation_bytes: int = 0  # attributed saved bytes
    host_bytes: int = 0
    _entries: dict[StorageKey, _Entry] = field(default_factory=dict)
    _by_where: dict[tuple[int, int, str], int] = field(default_factory=lambda: defaultdict(int))
    # The same bytes summed per (micro-batch, layer) and per micro-batch: the decisions
    # read those sums at every layer, and a scan of `_by_where` was the guard's most
    # frequent Python call on a step of adaptive (422 generator steps a calm step, `small`).
    _by_layer: dict[tuple[int, int], int] = field(default_factory=lambda: defaultdict(int))
    _by_micro_batch: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    _num_modelled: int = 0

    def __post_init__(self) -> None:
        self.is_cuda = self.device.type == "cuda"
        self.meter = make_device(self.device, self.budget_bytes)

    def in_use(self) -> int:
        """Bytes in use on the device now, as its allocator counts them."""
        return self.meter.allocated()

    @property
    def peak_bytes(self) -> int:
        return self.meter.peak()

    def set_static(self, num_bytes: int) -> None:
        self.static_bytes = num_bytes

    def acquire(self, key: StorageKey, num_bytes: int, where: tuple[int, int, str]) -> None:
        """One more holder of a storage; the first one attributes its bytes."""
        entry = self._entries.get(key)
        if entry is not None:
            entry.refs += 1
            return
        self._entries[key] = _Entry(num_bytes, 1, where)
        self._count(where, num_bytes)

    def acquire_modelled(self, micro_batch: int, layer: int,
                         bytes_by_op: dict[str, int]) -> tuple[StorageKey, ...]:
        """Attribute bytes kept where no saved tensor was seen (a stretch autograd saved
        with no hook: spikeguard/runtime/hookless.py), as the byte model predicts them per
        operator, each under a key of its own that `release` lets go of as one holder
        (operators with no bytes get none). One call for a layer's operators: a hookless
        layer of a calm step models up to nine, and a call per operator was three of the
        guard's Python calls each."""
        keys = []
        for op, num_bytes in bytes_by_op.items():
            if not num_bytes:
                continue
            self._num_modelled += 1
            key = ("modelled", self._num_modelled)   # new: no holder to count up
            where = (micro_batch, layer, op)
            self._entries[key] = _Entry(num_bytes, 1, where)
            self._count(where, num_bytes)
            keys.append(key)
        return tuple(keys)

    def release(self, key: StorageKey) -> None:
        entry = self._entries.get(key)
        if entry is None:
            return
        entry.refs -= 1
        if entry.refs <= 0:
            self.drop(key)

    def release_all(self, keys, grad=None) -> None:
        """`release` of each key (a stray one is harmless), in one call; usable as a
        gradient hook (`grad` is ignored: nothing is returned, the gradient is kept)."""
        entries = self._entries
        for key in keys:
            entry = entries.get(key)
            if entry is None:
                continue
            entry.refs -= 1
            if entry.refs <= 0:
                del entries[key]
                self._count(entry.where, -entry.num_bytes)

    def drop(self, key: StorageKey) -> int:
        """Forget a storage whatever its holders (evicted to host, or freed); its bytes."""
        entry = self._entries.pop(key, None)
        if entry is None:
            return 0
        self._count(entry.where, -entry.num_bytes)
        return entry.num_bytes

    def _count(self, where: tuple[int, int, str], num_bytes: int) -> None:
        """Bytes into (negative: out of) the attribution and its sums: the one place
        acquire, acquire_modelled, release_all and drop all count through."""
        self.activation_bytes += num_bytes
        self._by_where[where] += num_bytes
        self._by_layer[where[:2]] += num_bytes
        self._by_micro_batch[where[0]] += num_bytes

    def holds(self, key: StorageKey) -> bool:
        return key in self._entries

    def bytes_by(self, micro_batch: int | None = None, layer: int | None = None,
                 op: str | None = None) -> int:
        """Live bytes whose attribution matches every given field."""
        if micro_batch is not None and layer is not None:   # the decisions' reads: no scan
            if op is not None:
                return self._by_where.get((micro_batch, layer, op), 0)
            return self._by_layer.get((micro_batch, layer), 0)
        if micro_batch is not None and op is None:
            return self._by_micro_batch.get(micro_batch, 0)
        return sum(n for (mb, ly, o), n in self._by_where.items()
                   if (micro_batch is None or mb == micro_batch)
                   and (layer is None or ly == layer) and (op is None or o == op))

    def attribution(self) -> dict[tuple[int, int, str], int]:
        """Live attributed bytes by (micro-batch, layer, op), the places holding none left out."""
        return {where: n for where, n in self._by_where.items() if n}

    def add_host(self, num_bytes: int) -> None:
        self.host_bytes += num_bytes

    def reset_peak(self) -> None:
        self.meter.reset_peak()

    def entries_of(self, micro_batch: int) -> list[StorageKey]:
        return [k for k, e in self._entries.items() if e.where[0] == micro_batch]

    def clear(self) -> None:
        """Forget every attribution (an abandoned step: its storages are being freed)."""
        self._entries.clear()
        self._by_where.clear()
        self._by_layer.clear()
        self._by_micro_batch.clear()
        self.activation_bytes = 0
