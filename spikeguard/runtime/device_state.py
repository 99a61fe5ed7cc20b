"""What the guard does with the device around a step: where the step is, what it holds.

* Where: a position code (phase, layer) the device keeps a peak for, and the words an
  out-of-memory message uses ("backward of micro-batch 0, layer 2 (experts)").
* What: the model's parameters, gradients and optimizer state are moved onto the device
  at attach, as `model.to("cuda")` would (on CPU: re-allocated while the emulated device
  is active, bit for bit the same values), so that the device's figure counts them.
* Before a step: the gradients as they were, kept on the host, so that a step abandoned
  mid-backward can be re-run from exactly where it started.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from spikeguard.errors import UsageError
from spikeguard.memory import device as device_memory
from spikeguard.memory.budget import format_bytes, parse_bytes
from spikeguard.plan.layer_room import MICRO_BATCH_CODES

PHASE_IDLE, PHASE_FORWARD, PHASE_BACKWARD, PHASE_OPTIMIZER = 0, 1, 2, 3
PHASE_NAMES = ("outside a step", "forward", "backward", "optimizer step")
_LAYER_CODES = 256
_MB_CODES = MICRO_BATCH_CODES   # micro-batches told apart (modulo): a pipeline's resident ones


# The output head's position: apart from every layer number. A pipeline stage numbers its
# layers globally, so its head at len(moe_blocks) (stage 1 of 2 of a 4-layer model: 2)
# shared the code of a global layer (layer 2), in the OOM messages and in the layer-peak
# calibration alike.
HEAD_LAYER = _LAYER_CODES - 2


def where_code(phase: int, layer: int, micro_batch: int = 0) -> int:
    """One small integer per (phase, micro-batch modulo 4, layer); layer -1 is the
    embedding, HEAD_LAYER the output head. The device keeps a peak per code
    (spikeguard/memory/device_allocator.cpp: 4096 of them)."""
    assert layer == HEAD_LAYER or layer < HEAD_LAYER, layer
    return ((phase * _MB_CODES + micro_batch % _MB_CODES) * _LAYER_CODES
            + min(max(layer + 1, 0), _LAYER_CODES - 1))


def decode_where(code: int) -> tuple[int, int]:
    """(phase, layer) of a position code."""
    return code // (_LAYER_CODES * _MB_CODES), code % _LAYER_CODES - 1


def place_text(phase: int, micro_batch: int, layer: int, op: str) -> str:
    """'backward of micro-batch 0, layer 2, op experts': layers by their global number (a
    pipeline stage's too), the embedding and the head by name."""
    if phase == PHASE_OPTIMIZER:
        return "the optimizer step"
    if op == "embed" or (layer < 0 and op in ("", "attn")):
        part = "the embedding"
    elif op == "head" or layer == HEAD_LAYER:
        part = "the output head"
    else:
        part = f"layer {layer}, op {op}" if op else f"layer {layer}"
    if phase == PHASE_IDLE:   # a forward outside any step: an evaluation under no_grad
        return f"a forward outside a step (an evaluation), {part}"
    return f"{PHASE_NAMES[phase]} of micro-batch {micro_batch}, {part}"


def oom_text(place: str, meter, err: BaseException) -> str:
    """The one line an out-of-memory error becomes, with the device's own figures."""
    asked, after = meter.last_refusal()
    if not meter.is_cuda and asked:
        return (f"{place}: allocating {format_bytes(asked)} would put {format_bytes(after)} "
                f"on a device of {format_bytes(meter.capacity_bytes)}")
    first = (str(err).splitlines() or ["out of memory"])[0]
    return f"{place}: {first}"


CUDA_MARGIN_FRACTION = 0.05  # of capacity left to the allocator's fragmentation and NCCL


def resolve_budget(budget, device: torch.device) -> int:
    """The budget in bytes: as given ("24GiB", an int), or on CUDA the device's capacity
    less a margin; on CPU there is nothing to measure, so one must be given."""
    if budget is not None:
        return parse_bytes(budget)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return int(total * (1 - CUDA_MARGIN_FRACTION))
    raise UsageError("on CPU there is no device memory to measure: give a budget "
                     "(e.g. budget='512MiB'); the CPU allocator emulates a device of that size")


def state_tensors(model: nn.Module, optimizers: Sequence[torch.optim.Optimizer] = ()):
    """(owner, key, tensor) of every parameter, gradient, buffer, and state tensor of
    each of `optimizers`."""
    for p in model.parameters():
        yield p, "data", p.data
        if p.grad is not None:
            yield p, "grad", p.grad
    for module in model.modules():
        for name, buf in module._buffers.items():
            if buf is not None:
                yield module._buffers, name, buf
    for optimizer in optimizers:
        for state in optimizer.state.values():
            for key, value in state.items():
                if torch.is_tensor(value):
                    yield state, key, value


def move_state_to_device(model: nn.Module, optimizers: Sequence, meter) -> None:
    """Re-allocate the model's state while the emulated device is active (CPU only): the
    device then counts it, as it counts what a CUDA device holds after `.to("cuda")`.
    Storages shared by two tensors (tied weights) are moved once and stay shared."""
    if meter.is_cuda:
        return
    moved: dict[int, torch.Tensor] = {}
    _reshard_fsdp(model)
    with meter.active():
        for owner, key, t in list(state_tensors(model, optimizers)):
            if hasattr(t, "_local_tensor"):   # a DTensor: this rank holds its local shard
                # (`p.data` of a DTensor parameter is a new alias: move the parameter's own)
                holder = owner if key == "data" else t
                owner, key, t = holder, "_local_tensor", t._local_tensor
            if t.device.type != "cpu" or type(t) is not torch.Tensor:
                continue   # other subclasses keep their own storage
            ptr = t.untyped_storage().data_ptr()
            if ptr not in moved:
                # A tensor clone, not `UntypedStorage.clone()`: a storage keeps the allocator
                # it was made with, a new tensor takes the CPU allocator installed now.
                moved[ptr] = torch.empty(0, dtype=torch.uint8).set_(
                    t.untyped_storage()).clone()
            storage = moved[ptr].untyped_storage()
            new = torch.empty(0, dtype=t.dtype).set_(storage, t.storage_offset(),
                                                     t.size(), t.stride())
            if key == "local":
                with torch.no_grad():
                    t.set_(storage, t.storage_offset(), t.size(), t.stride())
            elif key == "data":
                owner.data = new
            elif key in ("grad", "_local_tensor"):
                setattr(owner, key, new)
            else:
                owner[key] = new
        _reset_fsdp_shards(model)


def _fsdp_modules(model: nn.Module) -> list:
    return [m for m in model.modules() if callable(getattr(m, "_get_fsdp_state", None))]


def _reshard_fsdp(model: nn.Module) -> None:
    """FSDP2 modules not resharded after their forward (transformers' head and norm, the
    root) hold their all-gathered parameters between steps: shard them first, so that the
    module's parameters are its sharded DTensors, whose local shards are what it keeps."""
    for module in _fsdp_modules(model):
        module.reshard()


def _reset_fsdp_shards(model: nn.Module) -> None:
    """FSDP2 all-gathers from its own reference to each sharded parameter's local data
    (`FSDPParam._sharded_param_data`): after the local shards moved to the device, make it
    read the moved ones (its `reset_sharded_param`, which lazy initialisation also runs)."""
    for module in _fsdp_modules(model):
        for group in fsdp_param_groups(module._get_fsdp_state()):
            for fsdp_param in group.fsdp_params:
                fsdp_param.reset_sharded_param()


def fsdp_param_groups(state) -> list:
    """A module's FSDP2 parameter groups. torch 2.13 gives a module one per mesh when its
    parameters are sharded over several (torchtitan's EP: the experts over its `efsdp`
    mesh, the rest over `fsdp`); its singular `_fsdp_param_group` then raises
    "Expected at most 1 param group"."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)   # torch before per-mesh groups
    return [group] if group is not None else []


class GradSnapshot:
    """The gradients before a step: None where there were none, else a host copy (on
    CUDA in CPU memory: a copy kept on the GPU would take the very room a re-run needs;
    on the emulated device, storages made inside `host()`)."""

    def __init__(self, model: nn.Module):
        self.params = [p for p in model.parameters() if p.requires_grad]
        with device_memory.host():
            self.grads = [None if p.grad is None else _host_copy(p.grad) for p in self.params]

    def restore(self) -> None:
        for p, g in zip(self.params, self.grads):
            if g is None:
                p.grad = None
            elif p.grad is None:
                p.grad = g.to(p.device, copy=True)
            else:
                p.grad.copy_(g)


class GradsReplayed:
    """The gradients before a step, made again rather than copied: the step's caller
    replays, from no gradients at all, what made them (`run_step(fn, replay=...)`). Where
    a step opens with gradients (an accumulation window's later micro-steps: transformers'
    Trainer calls the guard once per micro-batch), GradSnapshot copies all of them to host
    at every step, on CUDA a device-to-host copy of every gradient beside each micro-batch;
    this copies nothing, and a failed step's re-run first replays the window's earlier
    micro-steps from no gradients, in their order, so the sums are bitwise the same."""

    def __init__(self, model: nn.Module):
        self.params = [p for p in model.parameters() if p.requires_grad]

    def restore(self) -> None:
        for p in self.params:
            p.grad = None


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if t.device.type == "cpu":
        return t.clone()
    return t.to("cpu", copy=True)
