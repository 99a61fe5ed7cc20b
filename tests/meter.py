"""An independent meter of live device bytes, for checking the library's byte figures.

The project's rule: a byte figure spikeguard reports is checked against this meter, never
against spikeguard's own accounting. It therefore uses nothing from `spikeguard` (not the
ledger, not the C++ allocator counter): only PyTorch's dispatch mode and Python weak
references on storages.

    from meter import LiveMeter, model_state_tensors   # tests/ is on sys.path (conftest)

    with LiveMeter(baseline_tensors=model_state_tensors(model, opt)) as meter:
        meter.phase = "forward";  loss = model(x).sum()
        meter.phase = "backward"; loss.backward()
        meter.phase = "step";     opt.step()
    meter.peak_bytes, meter.peak_phase, meter.live_bytes

What it counts, `live_bytes`: after every aten op, each output storage it has not seen, by
`UntypedStorage.nbytes()`, once however many views share it; bytes leave the count when
the storage is freed (a weakref callback on the storage object, which torch keeps alive,
with its weakrefs, as long as the C++ storage lives: checked on torch 2.13 with storages
held only by autograd's saved tensors). Plus the baseline storages given at entry.
Outputs of view ops are skipped without a look; outputs of in-place/out= ops have their
nbytes re-read, so `resize_`, `set_` and out= resizing are followed. A tensor subclass
that wraps others (a wrapper subclass: its storage holds no data) is not counted: its
inner tensors are, where the ops that made them ran.

What it misses, by construction:
- allocations internal to one op and freed inside it (a kernel's scratch, the
  intermediates of a CompositeExplicitAutograd op): a dispatch mode sees only outputs;
- `UntypedStorage.resize_()` called from Python (it is not an aten op): seen at the next
  in-place op on that storage, or at `refresh()`;
- storages that existed before entry and are not in the baseline (inputs made outside,
  say), and their growth: they are not allocations of the metered code; pass them in the
  baseline to count them;
- ops run on other threads: the mode is thread-local. CPU autograd runs backward on the
  calling thread (tests/test_meter.py checks it), so one `with` around forward, backward
  and optimizer step sees all three; enter it once around the whole step.
Storages kept alive by a reference cycle count until the garbage collector frees them, as
they would in an allocator.
The peak is taken right after each op returns, when its inputs and outputs are both
alive, which is what an allocator's peak is for op-granular kernels.

Where a storage is freed, it says too: `freed_elsewhere` lists (bytes, phase) of each
counted storage freed on a thread other than the one that entered (the weakref callback
runs on the freeing thread). A CPU backend's worker thread that dropped the last reference
to a collective's tensor after the program did is one: the bytes were live longer than the
program held them, by however long that thread waited to run.

Host memory (an offload pool's buffers) is excluded at creation, either by the `exclude`
predicate, called once per new storage with the output tensor, or by running the code
that creates it inside `meter.host_scope()`. Exclusion is sticky: later in-place copies
into a host buffer never count it. There is no "mark as host afterwards" call on purpose:
the peak taken while it was counted could not be corrected.

Overhead: `python tests/meter.py` times a small MLP step with and without the meter.
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from typing import Callable, Iterable, Iterator, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_NEW, _VIEW, _WRITE = 0, 1, 2
# lift_fresh returns its argument under an alias annotation, but it is how torch.tensor()
# and torch.from_numpy() hand a freshly made tensor to dispatch: the only op they show.
_FRESH_ALIASES = {torch.ops.aten.lift_fresh.default}


def _return_kinds(func) -> tuple[int, ...]:
    if func in _FRESH_ALIASES:
        return (_NEW,)
    kinds = []
    for ret in func._schema.returns:
        alias = ret.alias_info
        kinds.append(_NEW if alias is None else _WRITE if alias.is_write else _VIEW)
    return tuple(kinds)


def model_state_tensors(model: torch.nn.Module,
                        optimizer: Optional[torch.optim.Optimizer] = None) -> list[torch.Tensor]:
    """Parameters, buffers, existing grads and optimizer state tensors: the baseline."""
    tensors = [*model.parameters(), *model.buffers()]
    tensors += [p.grad for p in model.parameters() if p.grad is not None]
    if optimizer is not None:
        for state in optimizer.state.values():
            tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return tensors


class _Entry:
    __slots__ = ("num_bytes", "host", "ref")

    def __init__(self, num_bytes: int, host: bool):
        self.num_bytes = num_bytes  # 0 for host storages
        self.host = host
        self.ref = None


class LiveMeter(TorchDispatchMode):
    """Live and peak bytes of the storages on `device`, seen op by op while entered.

    `cap_bytes`: raise `torch.OutOfMemoryError` when an op's outputs take the live bytes
    past it. The check runs after the op, so it is one op late: the op that crossed the
    cap has run and allocated; its outputs are freed as the exception unwinds."""

    def __init__(self, baseline_tensors: Iterable[torch.Tensor] = (),
                 exclude: Optional[Callable[[torch.Tensor], bool]] = None,
                 cap_bytes: Optional[int] = None, device: str = "cpu"):
        super().__init__()
        self._baseline = list(baseline_tensors)
        self._exclude = exclude
        self.cap_bytes = cap_bytes
        self.device = torch.device(device)
        # By StorageImpl address (storage._cdata). An address is reused only after the
        # storage died, and its weakref callback has removed the entry by then. A weakref
        # with a callback rather than StorageWeakRef, which has none and must be polled.
        self._entries: dict[int, _Entry] = {}
        self._kinds: dict[object, tuple[int, ...]] = {}
        self._host_depth = 0
        self.live_bytes = 0
        self.peak_bytes = 0
        self.phase = ""
        self.peak_phase = ""
        self.freed_elsewhere: list[tuple[int, str]] = []
        self._thread = threading.get_ident()

    # figures

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes
        self.peak_phase = self.phase

    def refresh(self) -> None:
        """Re-read every counted storage's size (after Python-level storage resizes)."""
        for entry in list(self._entries.values()):
            storage = entry.ref()
            if storage is not None and not entry.host:
                self._resize(entry, storage.nbytes())

    @contextlib.contextmanager
    def host_scope(self) -> Iterator[None]:
        """Storages created inside are host memory: never counted, even when written later."""
        self._host_depth += 1
        try:
            yield
        finally:
            self._host_depth -= 1

    # registration

    def __enter__(self):
        for t in self._baseline:
            self._register(t, t.untyped_storage())
        self._baseline = []  # keep no tensor alive through the meter
        self._thread = threading.get_ident()
        return super().__enter__()

    def _register(self, t: torch.Tensor, storage) -> None:
        key = storage._cdata
        if key in self._entries:
            return
        host = self._host_depth > 0 or (self._exclude is not None and self._exclude(t))
        entry = _Entry(0 if host else storage.nbytes(), host)
        entry.ref = weakref.ref(storage, lambda _, key=key: self._free(key))
        self._entries[key] = entry
        self._add(entry.num_bytes)

    def _free(self, key: int) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.live_bytes -= entry.num_bytes
            if entry.num_bytes and threading.get_ident() != self._thread:
                self.freed_elsewhere.append((entry.num_bytes, self.phase))

    def _resize(self, entry: _Entry, num_bytes: int) -> None:
        delta = num_bytes - entry.num_bytes
        if delta:
            entry.num_bytes = num_bytes
            self._add(delta)

    def _add(self, num_bytes: int) -> None:
        self.live_bytes += num_bytes
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes = self.live_bytes
            self.peak_phase = self.phase

    def _see(self, out, kind: int) -> None:
        if isinstance(out, torch.Tensor):
            if out.device != self.device:
                return
            try:
                storage = out.untyped_storage()
                # A wrapper subclass's (functional collectives' AsyncCollectiveTensor, made
                # by _c10d_functional._wrap_tensor_autograd) has a placeholder storage of
                # its full size and no data: its bytes are its inner tensor's, counted
                # where an op made it. Counted, each all-to-all's received rows were
                # counted twice for as long as autograd kept the wrapper.
                storage.data_ptr()
            except (RuntimeError, NotImplementedError):  # sparse and other storage-less layouts
                return
            if kind == _NEW:
                self._register(out, storage)
            else:
                entry = self._entries.get(storage._cdata)
                if entry is not None and not entry.host:
                    self._resize(entry, storage.nbytes())
        elif isinstance(out, (tuple, list)):
            for o in out:
                self._see(o, kind)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        kinds = self._kinds.get(func)
        if kinds is None:
            kinds = self._kinds[func] = _return_kinds(func)
        if len(kinds) == 1:
            if kinds[0] != _VIEW:
                self._see(out, kinds[0])
        elif kinds:
            for o, kind in zip(out, kinds):
                if kind != _VIEW:
                    self._see(o, kind)
        if self.cap_bytes is not None and self.live_bytes > self.cap_bytes:
            raise torch.OutOfMemoryError(
                f"LiveMeter: {func} took live bytes to {self.live_bytes} > cap {self.cap_bytes}"
                f" (phase {self.phase!r})")
        return out


def _overhead() -> None:
    """Seconds per small-MLP step (forward, backward, SGD step), with and without meter."""
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(),
                                torch.nn.Linear(1024, 256), torch.nn.LayerNorm(256))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x_TD = torch.randn(64, 256)

    def step():
        opt.zero_grad(set_to_none=True)
        model(x_TD).square().mean().backward()
        opt.step()

    def timed(metered: bool, num_steps: int = 50) -> float:
        start = time.perf_counter()
        for _ in range(num_steps):
            if metered:
                with LiveMeter(baseline_tensors=model_state_tensors(model, opt)):
                    step()
            else:
                step()
        return (time.perf_counter() - start) / num_steps

    step()
    plain_s, metered_s = min(timed(False) for _ in range(3)), min(timed(True) for _ in range(3))
    print(f"step plain {plain_s * 1e3:.2f} ms | metered {metered_s * 1e3:.2f} ms"
          f" | ratio {metered_s / plain_s:.2f}x")


if __name__ == "__main__":
    _overhead()
