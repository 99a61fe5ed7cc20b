"""What a user would pick instead of the guard on the built-in model: PyTorch's own
activation checkpointing and host offload, as rows of spikeguard/bench/runtime_ratios.py.

    .venv/bin/python -m spikeguard.bench.runtime_ratios --preset small --reps 7

  checkpoint   `torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)` around
               every transformer block (each block recomputed whole in backward);
  save_on_cpu  `torch.autograd.graph.save_on_cpu(pin_memory=False)` around the forward
               (every saved tensor, the weights a matmul saves too, copied to host).

Neither has a guard or a limit: the device counts each step as it counts the guarded
ones (parameters, gradients, activations, whatever the step allocates while the device is
active) and a step whose peak passes the budget is an overrun: on a real device it would
have run out (`ran out` in the table). Both compute what the plain model computes, so
their gradients equal its bitwise (tests/bench/test_bench_native.py).

On CPU the device is emulated by the CPU allocator, and `save_on_cpu` moves nothing there
(torch 2.13: "If the graph was already on CPU, no tensor copy is performed": its pack is
`tensor.cpu()`, the tensor itself). `host_saved_tensors` then does what it does on a GPU
with the copies made explicit: pack copies to host memory (`spikeguard.memory.device.host`),
unpack copies back onto the device; on CUDA it is `save_on_cpu(pin_memory=False)` itself.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from spikeguard.memory.device import host, make_device
from spikeguard.runtime.device_state import move_state_to_device

NATIVE = ("checkpoint", "save_on_cpu")


class CheckpointedBlock(nn.Module):
    """A transformer block run under `torch.utils.checkpoint.checkpoint` (non-reentrant)."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    @property
    def moe(self) -> nn.Module:   # the model's forward reads each block's aux loss here
        return self.block.moe

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.block, x_BTD, use_reentrant=False)


class HostSaved(nn.Module):
    """The model with its forward under `host_saved_tensors`; `plain_step` calls it and
    its `zero_grad` as it calls the model."""

    def __init__(self, model: nn.Module, is_cuda: bool, moved: dict):
        super().__init__()
        self.model, self.is_cuda, self.moved = model, is_cuda, moved

    def forward(self, *args, **kwargs):
        with host_saved_tensors(self.is_cuda, self.moved):
            return self.model(*args, **kwargs)


def checkpoint_blocks(model: nn.Module) -> nn.Module:
    """`model` with every block of `model.blocks` checkpointed, in place."""
    for i, block in enumerate(model.blocks):
        model.blocks[i] = CheckpointedBlock(block)
    return model


def host_saved_tensors(is_cuda: bool, moved: dict):
    """`save_on_cpu(pin_memory=False)`; on the emulated device, the same with its copies
    made (the module docstring). `moved` sums the bytes packed and unpacked."""
    if is_cuda:
        return torch.autograd.graph.save_on_cpu(pin_memory=False)

    def pack(t: torch.Tensor):
        with host():
            copy = t.detach().clone()
        moved["evicted_bytes"] += copy.numel() * copy.element_size()
        return copy

    def unpack(copy: torch.Tensor) -> torch.Tensor:
        moved["prefetched_bytes"] += copy.numel() * copy.element_size()
        return copy.clone()   # allocated on the device (active in the step)
    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


class NativeRun:
    """One unguarded row: its model on a device of its own, and a guard's `run_step` and
    `history` (the fields runtime_ratios.memory_row reads) without a guard's anything else.
    The device counts and never refuses: a peak over `budget_bytes` is an overrun."""

    def __init__(self, name: str, model: nn.Module, budget_bytes: int,
                 device: torch.device = torch.device("cpu")):
        if name not in NATIVE:
            raise ValueError(f"unknown native row {name!r}; one of {NATIVE}")
        self.budget_bytes = int(budget_bytes)
        self.meter = make_device(device, self.budget_bytes)
        move_state_to_device(model, (), self.meter)
        self.moved = {"evicted_bytes": 0, "prefetched_bytes": 0}
        self.model = checkpoint_blocks(model) if name == "checkpoint" else \
            HostSaved(model, self.meter.is_cuda, self.moved)
        self.history: list[dict] = []

    def run_step(self, fn: Callable[[], object]):
        for key in self.moved:
            self.moved[key] = 0
        with self.meter.active():
            self.meter.reset_peak()
            out = fn()
            peak = self.meter.peak()
        self.history.append({"peak_bytes": peak, "budget_bytes": self.budget_bytes,
                             "safety_net_reruns": 0, "decisions": {}, **self.moved})
        return out

    def close(self) -> None:
        self.meter.close()


def ran_out(row: dict) -> bool:
    """An unguarded row (no safety net) whose step passed the budget: it ran out."""
    return row.get("native", False) and row["overruns"] > 0


@contextlib.contextmanager
def native_runs(models: dict, budget_bytes: int):
    """NativeRun of each of `models` ({name: plain model}), closed after."""
    runs = {name: NativeRun(name, model, budget_bytes) for name, model in models.items()}
    try:
        yield runs
    finally:
        for run in runs.values():
            run.close()
