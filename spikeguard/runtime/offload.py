"""Offload engine: copies saved activations to a host pool and brings them back.

On CUDA the host pool is pinned, the device-to-host copy runs on a side stream after an
event that orders it behind the producer, and the reload waits on the event of its own
offload copy before copying back (reading a half-written host buffer is the known way to
corrupt gradients silently). Prefetch issues the reload of a layer's tensors early on the
same side stream, during the backward of the layer after it.

On CPU there is no device memory: an "offload" is a real copy into a separate, reused
host pool, and the device bytes it frees are the emulated budget's.

A storage is offloaded once however many views of it are saved; views are rebuilt on
reload with their size, stride and offset, so the values are bit for bit the originals.
"""

from __future__ import annotations

import functools
import time
from collections import defaultdict
from typing import Callable, Optional

import torch

from spikeguard.memory import device as device_memory
from spikeguard.memory.ledger import Ledger, StorageKey, storage_key
from spikeguard.runtime.grad_hooks import on_grad


def _size_class(num_bytes: int) -> int:
    """Pool buckets: the next power of two, so varying token counts still reuse buffers."""
    return 1 << max(num_bytes - 1, 1).bit_length()


class HostPool:
    """Reusable host buffers by size class (pinned when the device is CUDA)."""

    def __init__(self, pin: bool):
        self.pin = pin
        self._free: dict[int, list[torch.Tensor]] = defaultdict(list)
        self.allocated_bytes = 0

    def acquire(self, num_bytes: int) -> torch.Tensor:
        size = _size_class(num_bytes)
        if self._free[size]:
            return self._free[size].pop()
        self.allocated_bytes += size
        with device_memory.host():
            return torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)

    def clear(self) -> None:
        """Drop every free buffer (detach: pinned host memory is given back on CUDA)."""
        self._free.clear()
        self.allocated_bytes = 0

    def give_back(self, buf: torch.Tensor) -> None:
        self._free[buf.numel()].append(buf)


class OffloadedStorage:
    """One device storage living in the host pool; reloaded on first use in backward."""

    def __init__(self, engine: "OffloadEngine", src: torch.Tensor, where):
        self.engine = engine
        self.where = where
        self.dtype = src.dtype
        self.device = src.device
        self.num_bytes = src.untyped_storage().nbytes()
        self.numel = self.num_bytes // src.element_size()
        self.refs = 0
        self.live_key = None  # set when the engine may hand this copy out again
        self.reloaded: Optional[torch.Tensor] = None
        self.reload_event = None
        flat = torch.empty(0, dtype=src.dtype, device=src.device).set_(
            src.untyped_storage(), 0, (self.numel,), (1,))
        self.host = engine.pool.acquire(self.num_bytes)
        self.copy_event = engine.copy_to_host(flat, self.host[: self.num_bytes].view(self.dtype))

    def prefetch(self) -> None:
        if self.reloaded is None:
            host = self.host[: self.num_bytes].view(self.dtype)
            self.reloaded, self.reload_event = self.engine.copy_to_device(
                host, self.device, self.copy_event)
            self.engine.ledger.acquire(self.reload_key(), self.num_bytes, self.where)
            if self.engine.on_reload is not None:
                self.engine.on_reload(self.num_bytes, self.where)

    def view(self, size, stride, offset) -> torch.Tensor:
        self.prefetch()
        self.engine.wait(self.reload_event)
        if self.engine.is_cuda:  # made on the side stream, used on the current one
            self.reloaded.record_stream(torch.cuda.current_stream(self.device))
        return self.reloaded.as_strided(size, stride, offset)

    def reload_key(self) -> StorageKey:
        """The ledger's key of the reloaded copy (it has no storage of its own yet)."""
        return ("reload", id(self))

    def release(self) -> None:
        self.refs -= 1
        if self.refs == 0:
            self.engine.forget(self)


class OffloadEngine:
    """Creates and tracks offloaded storages; one per guard."""

    def __init__(self, ledger: Ledger, device: torch.device,
                 on_copy: Optional[Callable[[str, int, float], None]] = None):
        self.ledger = ledger
        self.on_copy = on_copy  # (direction, bytes, seconds) for the cost model, CPU only
        self.device = device
        self.is_cuda = device.type == "cuda"
        # On CUDA a prefetch overlaps the reload with the backward of the layer above. On
        # CPU the copy blocks, so prefetching gains nothing and only raises the backward
        # peak: off by default there (tests turn it on to check the path).
        self.prefetch_enabled = self.is_cuda
        self.pool = HostPool(pin=self.is_cuda)
        self.stream = torch.cuda.Stream(device) if self.is_cuda else None
        self._live: dict[StorageKey, OffloadedStorage] = {}
        self._by_layer: dict[tuple[int, int], list[OffloadedStorage]] = defaultdict(list)
        self.offloaded_bytes_total = 0
        # (bytes, where) of each host copy brought back, told where the copy is issued, so
        # that the step's record counts what really came back (runtime/history.py).
        self.on_reload: Optional[Callable[[int, tuple], None]] = None

    def offload(self, t: torch.Tensor, where, tag_serial: int = -1) -> OffloadedStorage:
        """The host copy of `t`'s storage, made now if this storage has none yet.

        Storages are matched by address *and* the serial of the executor's tag: a freed
        storage's address can be reused by a new tensor within the same forward."""
        key = (*storage_key(t), tag_serial)
        stored = self._live.get(key) if tag_serial >= 0 else None
        if stored is None:
            stored = OffloadedStorage(self, t, where)
            if tag_serial >= 0:
                self._live[key] = stored
                stored.live_key = key
            self._by_layer[where[:2]].append(stored)
            self.ledger.add_host(stored.num_bytes)
            self.offloaded_bytes_total += stored.num_bytes
        stored.refs += 1
        return stored

    def host_bytes_by_layer(self) -> dict[tuple[int, int], int]:
        """(micro-batch, layer) -> bytes of it on the host now (offloaded or evicted)."""
        return {key: sum(stored.num_bytes for stored in stored_list)
                for key, stored_list in self._by_layer.items() if stored_list}

    def prefetch_layer(self, micro_batch: int, layer: int) -> None:
        if not self.prefetch_enabled:
            return
        for stored in self._by_layer.get((micro_batch, layer), ()):
            stored.prefetch()

    def forget(self, stored: OffloadedStorage) -> None:
        if self._live.get(stored.live_key) is stored:
            del self._live[stored.live_key]
        layer_list = self._by_layer.get(stored.where[:2], [])
        if stored in layer_list:
            layer_list.remove(stored)
        if stored.reloaded is not None:
            self.ledger.release(stored.reload_key())
            stored.reloaded = None
        self.wait(stored.copy_event)
        self.pool.give_back(stored.host)
        self.ledger.add_host(-stored.num_bytes)

    def end_forward(self) -> None:
        """Offloads of a finished forward need no device key any more (storages may be reused)."""
        self._live.clear()

    # Copies: synchronous on CPU, on the side stream with events on CUDA.
    def copy_to_host(self, flat: torch.Tensor, host: torch.Tensor):
        if not self.is_cuda:
            start = time.perf_counter()
            host.copy_(flat)
            self._observe("d2h", host, time.perf_counter() - start)
            return None
        producer = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(producer)
        with torch.cuda.stream(self.stream):
            host.copy_(flat, non_blocking=True)
            flat.record_stream(self.stream)  # the allocator keeps the source until the copy ends
            event = torch.cuda.Event()
            event.record(self.stream)
        return event

    def copy_to_device(self, host: torch.Tensor, device: torch.device, after_event):
        if not self.is_cuda:
            start = time.perf_counter()
            out = host.clone()
            self._observe("h2d", host, time.perf_counter() - start)
            return out, None
        with torch.cuda.stream(self.stream):
            if after_event is not None:
                self.stream.wait_event(after_event)
            out = torch.empty(host.shape, dtype=host.dtype, device=device)
            out.copy_(host, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        return out, event

    def _observe(self, direction: str, t: torch.Tensor, seconds: float) -> None:
        if self.on_copy is not None:
            self.on_copy(direction, t.numel() * t.element_size(), seconds)

    def wait(self, event) -> None:
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)


def prefetch_below(engine: OffloadEngine, micro_batch: int, layer: int, grad):
    """A gradient hook: backward has passed a layer's experts, so the offloaded tensors of
    the layer below (`layer`) start coming back (a no-op unless prefetch is enabled)."""
    engine.prefetch_layer(micro_batch, layer)
    return None


def expert_path_done(position, engine: OffloadEngine, layer: int, out_ND, x_ND) -> None:
    """What every expert path's window does once its output exists (the built-in block's,
    transformers' and torchtitan's experts call): combine runs next (hooked: it saves the
    path's output and its own); backward's position is marked (the experts' backward
    starts at the output's gradient and is done at the input's: layer 0's "dispatch" tells
    the guard this micro-batch's backward working set is behind it); and when backward
    has passed this layer's experts, the layer below starts coming back from host."""
    position.ctx.op = "combine"
    position.mark_backward(out_ND, layer, "experts")
    position.mark_backward(x_ND, layer, "dispatch")
    if x_ND.requires_grad and layer > 0:
        on_grad(x_ND, functools.partial(prefetch_below, engine, position.ctx.micro_batch,
                                        layer - 1))
