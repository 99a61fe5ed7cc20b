"""Named simulator presets: the `small` model on this machine, and the published scale.

Assumptions of the published-scale presets (docs/simulator.md discusses them):
  * an accelerator with 64 GB of memory (64e9 bytes) and 4.98e14 peak FLOP/s: the figure
    that makes the published 2.012 EFLOPS at 12,288 devices a 32.9% MFU
    (2.012e18 / 12,288 / 0.329); HBM 1.6 TB/s, host link 25 GB/s per direction,
    expert-parallel interconnect 50 GB/s per device;
  * bf16 weights and activations, fp32 gradients, Adam with an fp32 master copy (12 bytes
    per parameter) sharded over data parallelism (distributed optimizer);
  * model shapes of ~188B, ~500B and ~1.04T parameters in the built-in model's structure
    (attention, top-k routed SwiGLU experts, one shared expert, 4096-token sequences);
  * a grouped GEMM for the experts (weight gradients written in place; the built-in
    model's per-expert indexing would hold three copies of a layer's local expert weights
    while it sums their gradients);
  * kernel efficiency 0.5 until calibrated (`--calibrate-mfu 0.246` fits it so that full
    recompute runs at the published 24.6% MFU; nothing else is fitted).
`small` is the runtime's `small` preset (fp32) as runtime_ratios runs it: 2 micro-batches
of 8 x 128 tokens, parameters and gradients on the device (no optimizer given to the
guard), the device emulated by a budget of 0.85x the ceiling's peak (CPU); its rates are
rough placeholders (2 cores' fp32 peak, and the ~2.3e10 FLOP/s the plain model achieves
here), which spikeguard.sim.validate replaces by measurements.
"""

from __future__ import annotations

import copy

from spikeguard.errors import UsageError

GB = 10**9

_SCALE_DEVICE = {"name": "accelerator", "kind": "cuda", "capacity_bytes": 64 * GB,
                 "peak_flops": 4.98e14, "efficiency": 0.5, "memory_bytes_per_s": 1.6e12,
                 "host_bytes_per_s": 25e9, "interconnect_bytes_per_s": 50e9}
_SCALE_TRAINING = {"param_bytes": 2, "grad_bytes": 4, "optimizer_bytes": 12,
                   "distributed_optimizer": True, "lazy_state": False,
                   "torch_buffers": False}
_SCALE_RUN = {"checkpoint_interval": 100, "restart_s": 284.0}

PRESETS: dict[str, dict] = {
    "small": {
        "model": {"name": "small", "num_layers": 4, "d_model": 128, "num_heads": 4,
                  "num_experts": 8, "top_k": 2, "d_expert": 256, "num_shared_experts": 1,
                  "vocab_size": 256, "seq_len": 128, "dtype_bytes": 4},
        "layout": {"devices": 1, "micro_batch_size": 8, "global_batch": 16},
        "device": {"name": "this machine", "kind": "cpu",
                   "capacity_bytes": 100_421_641, "peak_flops": 1e11, "efficiency": 0.23,
                   "memory_bytes_per_s": 1e10, "host_bytes_per_s": 4e10,
                   "interconnect_bytes_per_s": 1e10},
        "training": {"param_bytes": 4, "grad_bytes": 4, "optimizer_bytes": 0,
                     "lazy_state": True, "torch_buffers": True},
        "workload": {"steps": 20},
        "run": {"checkpoint_interval": 10, "restart_s": 284.0},
    },
    "188b": {
        "model": {"name": "188b", "num_layers": 48, "d_model": 6144, "num_heads": 48,
                  "num_experts": 64, "top_k": 4, "d_expert": 3072, "num_shared_experts": 2,
                  "vocab_size": 128000, "seq_len": 4096, "dtype_bytes": 2,
                  "grouped_gemm": True},
        "layout": {"devices": 12288, "tp": 2, "pp": 8, "ep": 16, "micro_batch_size": 1,
                   "global_batch": 12288},
        "device": _SCALE_DEVICE, "training": _SCALE_TRAINING, "run": _SCALE_RUN,
    },
    "500b": {
        "model": {"name": "500b", "num_layers": 64, "d_model": 8192, "num_heads": 64,
                  "num_experts": 96, "top_k": 4, "d_expert": 3136, "num_shared_experts": 1,
                  "vocab_size": 128000, "seq_len": 4096, "dtype_bytes": 2,
                  "grouped_gemm": True},
        "layout": {"devices": 12288, "tp": 4, "pp": 8, "ep": 16, "micro_batch_size": 1,
                   "global_batch": 6144},
        "device": _SCALE_DEVICE, "training": _SCALE_TRAINING, "run": _SCALE_RUN,
    },
    "1t": {
        "model": {"name": "1t", "num_layers": 80, "d_model": 8192, "num_heads": 64,
                  "num_experts": 128, "top_k": 4, "d_expert": 4000, "num_shared_experts": 1,
                  "vocab_size": 128000, "seq_len": 4096, "dtype_bytes": 2,
                  "grouped_gemm": True},
        "layout": {"devices": 12288, "tp": 4, "pp": 16, "ep": 32, "micro_batch_size": 1,
                   "global_batch": 12288},
        "device": _SCALE_DEVICE, "training": _SCALE_TRAINING, "run": _SCALE_RUN,
    },
}

# Device counts of the scaling table: data parallelism grows, the model's layout stays.
SCALING_DEVICES = (128, 512, 1024, 2048, 4096, 8192, 12288)


def preset_dict(name: str) -> dict:
    if name not in PRESETS:
        raise UsageError(f"unknown simulator preset {name!r}; choose one of {', '.join(PRESETS)}")
    return copy.deepcopy(PRESETS[name])
