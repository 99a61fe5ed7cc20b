"""Cost model: seconds each plan adds, calibrated on the running device, corrected online.

Recompute costs the forward time of the stages re-run in backward; offload costs the two
copies (to host and back) minus what hides under compute. On CUDA the copies run on a side
stream, so they hide under the layer's forward and backward compute (about three times
its forward); on CPU the copy blocks, so its whole time is added.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch

from spikeguard.plan.catalogue import (EXPERT_STAGES, OPERATORS, OPS, Action, ExpertShape,
                                       LayerPlan)

EMA_WEIGHT = 0.1          # weight of a new measurement in the online correction
BACKWARD_TO_FORWARD = 2.0  # backward compute is about twice the forward's (two GEMMs per GEMM)


def stage_seconds(shape: ExpertShape, flop_per_s: float, memory_bytes_per_s: float,
                  operators=OPERATORS) -> dict[str, float]:
    """Seconds per routed copy of each stage from a device's rates and the catalogue's
    work per operator (its GEMM FLOPs, or the elements it reads and writes)."""
    D, F, b = shape.d_model, shape.d_expert, shape.elem_bytes
    out = {}
    for op in operators:
        if not op.is_stage:
            continue
        if op.flops is not None:
            out[op.name] = op.flops(D, F) / flop_per_s
        elif op.traffic is not None:
            out[op.name] = op.traffic(D, F) * b / memory_bytes_per_s
        else:
            raise ValueError(f"operator {op.name!r} declares neither flops nor traffic in "
                             f"spikeguard/plan/catalogue.py: the cost model cannot rate it")
    return out


@dataclass
class CostModel:
    """Seconds per routed token per stage, and seconds per byte copied each way."""

    stage_s_per_token: dict[str, float] = field(
        default_factory=lambda: {s: 1e-8 for s in EXPERT_STAGES})
    d2h_s_per_byte: float = 1e-10
    h2d_s_per_byte: float = 1e-10
    copies_overlap: bool = False
    # Frozen: timings no longer move the rates (a validation run compares the runtime's
    # plans with the simulator's, which must rank plans with the same rates throughout).
    frozen: bool = False

    def freeze(self) -> "CostModel":
        self.frozen = True
        return self

    @classmethod
    def from_rates(cls, shape: ExpertShape, flop_per_s: float, memory_bytes_per_s: float,
                   host_bytes_per_s: float, copies_overlap: bool) -> "CostModel":
        """A cost model from a device's rates instead of timings, for the simulator, which
        has no device to time: gate_up and down are GEMMs (2 FLOPs per multiply-add) at the
        achieved `flop_per_s`; silu and the product are element-wise, bound by memory
        traffic (silu reads and writes F elements, the product reads 2F and writes F)."""
        stages = stage_seconds(shape, flop_per_s, memory_bytes_per_s)
        return cls(stage_s_per_token=stages, d2h_s_per_byte=1 / host_bytes_per_s,
                   h2d_s_per_byte=1 / host_bytes_per_s, copies_overlap=copies_overlap)

    def observe(self, stage: str, num_routed: int, seconds: float) -> None:
        """Exponential average of a measured stage time (ignores tiny samples)."""
        if self.frozen or num_routed < 64 or seconds <= 0:
            return
        old = self.stage_s_per_token[stage]
        self.stage_s_per_token[stage] = (1 - EMA_WEIGHT) * old + EMA_WEIGHT * seconds / num_routed

    def observe_copy(self, direction: str, num_bytes: int, seconds: float) -> None:
        """Exponential average of a measured host copy (ignores copies under 64 KiB)."""
        if self.frozen or num_bytes < (64 << 10) or seconds <= 0:
            return
        name = "d2h_s_per_byte" if direction == "d2h" else "h2d_s_per_byte"
        old = getattr(self, name)
        setattr(self, name, (1 - EMA_WEIGHT) * old + EMA_WEIGHT * seconds / num_bytes)

    @staticmethod
    def recompute_stages(plan: LayerPlan) -> tuple[str, ...]:
        """The stages a plan runs again in backward: its region, less a saved silu (served
        from SAC's cache). Fixed per plan, so the planner computes it once."""
        region = plan.region()
        if "silu" in region and plan.action("silu") is Action.SAVE:
            return tuple(s for s in region if s != "silu")
        return region

    def recompute_s_per_token(self, plan: LayerPlan) -> float:
        return sum(self.stage_s_per_token[s] for s in self.recompute_stages(plan))

    def offload_s_per_token(self, plan: LayerPlan, shape: ExpertShape) -> float:
        per_token = shape.bytes_per_token()
        off_bytes = sum(per_token[op] for op, a in zip(OPS, plan.actions) if a is Action.OFFLOAD)
        return self.offload_s_for_bytes(off_bytes)

    def offload_s_for_bytes(self, off_bytes: float) -> float:
        """Seconds the round trip of `off_bytes` adds (what does not hide under compute)."""
        copy_s = off_bytes * (self.d2h_s_per_byte + self.h2d_s_per_byte)
        if not self.copies_overlap:
            return copy_s
        window_s = (1 + BACKWARD_TO_FORWARD) * sum(self.stage_s_per_token.values())
        return max(0.0, copy_s - window_s)

    def calibrate(self, shape: ExpertShape, num_experts: int, device: torch.device,
                  dtype: torch.dtype = torch.float32, num_routed: int = 512, reps: int = 3) -> None:
        """Time each stage and the host copies on this device (a few ms)."""
        from spikeguard.model.experts import SwiGLUExperts  # the model's own stages
        from spikeguard.model.experts import stage_functions

        experts = SwiGLUExperts(num_experts, shape.d_model, shape.d_expert).to(device, dtype)
        counts = [num_routed // num_experts] * num_experts
        counts[-1] += num_routed - sum(counts)
        fns = stage_functions(experts, counts)
        tensors = {"dispatch": torch.randn(num_routed, shape.d_model, device=device, dtype=dtype)}
        with torch.no_grad():
            for stage in EXPERT_STAGES:
                samples = []
                for _ in range(reps):
                    start = _now(device)
                    tensors[stage] = fns[stage](tensors)
                    samples.append(_now(device) - start)
                self.stage_s_per_token[stage] = statistics.median(samples) / num_routed
            self.calibrate_copies(device, dtype)
        self.copies_overlap = device.type == "cuda"

    def calibrate_copies(self, device: torch.device, dtype: torch.dtype, num_bytes: int = 4 << 20):
        """Seconds per byte of a device-to-host and a host-to-device copy (medians of 3);
        what an offload or a reload costs, read by every adapter's calibration."""
        src = torch.randn(num_bytes // 4, device=device).to(dtype)
        host = torch.empty(src.shape, dtype=dtype, pin_memory=device.type == "cuda")
        d2h, h2d = [], []
        for _ in range(3):
            start = _now(device)
            host.copy_(src)
            d2h.append(_now(device) - start)
            start = _now(device)
            src.copy_(host)
            h2d.append(_now(device) - start)
        nbytes = src.numel() * src.element_size()
        self.d2h_s_per_byte = statistics.median(d2h) / nbytes
        self.h2d_s_per_byte = statistics.median(h2d) / nbytes


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
