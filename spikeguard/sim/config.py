"""What one simulated training run is: model shape, layout, device, workload, run policy.

    cfg = load_config(preset="1t", toml_path=None, overrides={"layout.devices": 12288})

Nested `@dataclass(kw_only=True)` sections, validated in `__post_init__` with UsageError
(a user mistake is one line, exit code 2), `to_dict()` for the JSON report, `tomllib` for
files and dotted `section.key=value` overrides from the command line. The layout checks
say what would divide; whether the model *fits* is checked later, by the simulator itself
(spikeguard.sim.engine.check_fits), because only it knows the bytes.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Optional

from spikeguard.errors import UsageError
from spikeguard.model.sizes import SHAPE_FIELDS, check_shape
from spikeguard.routing.skew import PATTERNS, SkewConfig

SCHEDULES = ("1f1b", "interleaved")
DEVICE_KINDS = ("cuda", "cpu")
SIM_POLICIES = ("ceiling", "none", "experts", "offload", "full", "safe-static", "adaptive")
STATIC_CANDIDATES = ("none", "experts", "offload", "full")  # safe-static picks among these


def _check_positive(section: str, obj: Any, names: tuple[str, ...], kind=int) -> None:
    for name in names:
        value = getattr(obj, name)
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if kind is int:
            ok = ok and isinstance(value, int)
        if not ok or not math.isfinite(value) or value <= 0:
            what = "a positive integer" if kind is int else "a positive number"
            raise UsageError(f"{section}.{name} must be {what}, got {value!r}")


@dataclass(kw_only=True)
class SimModel:
    """Shape of the MoE transformer (the built-in model's structure, any size)."""

    name: str = "custom"
    num_layers: int = 4
    d_model: int = 128
    num_heads: int = 4
    num_experts: int = 8
    top_k: int = 2
    d_expert: int = 256
    num_shared_experts: int = 1
    vocab_size: int = 256
    seq_len: int = 128
    dtype_bytes: int = 4          # activations and weights (2 for bf16)
    # The experts' weight gradients: False as the built-in model makes them (one
    # select_backward per expert into a full-size tensor, summed: three copies of the local
    # experts' weights alive at each sum), True as a grouped GEMM writes them in place.
    grouped_gemm: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise UsageError(f"model.name must be a string, got {self.name!r}")
        check_shape(self, (*SHAPE_FIELDS, "vocab_size", "dtype_bytes"))
        if not isinstance(self.grouped_gemm, bool):
            raise UsageError(f"model.grouped_gemm must be true or false, got {self.grouped_gemm!r}")
        if not isinstance(self.num_shared_experts, int) or self.num_shared_experts < 0:
            raise UsageError(f"model.num_shared_experts must be an integer >= 0, "
                             f"got {self.num_shared_experts!r}")


@dataclass(kw_only=True)
class Layout:
    """devices = tp * pp * dp; experts are sharded over `ep` of a stage's tp*dp devices."""

    devices: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    schedule: str = "1f1b"
    virtual_stages: int = 1       # model chunks per stage (interleaved schedule)
    micro_batch_size: int = 8     # sequences per micro-batch
    global_batch: int = 16        # sequences per optimizer step, all replicas

    def __post_init__(self) -> None:
        _check_positive("layout", self, ("devices", "tp", "pp", "ep", "virtual_stages",
                                          "micro_batch_size", "global_batch"))
        if self.schedule not in SCHEDULES:
            raise UsageError(f"unknown layout.schedule {self.schedule!r}; choose one of "
                             f"{', '.join(SCHEDULES)}")
        if self.schedule == "1f1b" and self.virtual_stages != 1:
            raise UsageError("layout.virtual_stages > 1 needs layout.schedule = 'interleaved'")
        if self.devices % (self.tp * self.pp):
            raise UsageError(f"layout.devices {self.devices} is not a multiple of tp*pp = "
                             f"{self.tp * self.pp}; multiples that would work: "
                             f"{_multiples(self.tp * self.pp, self.devices)}")
        if (self.tp * self.dp) % self.ep:
            raise UsageError(f"layout.ep {self.ep} must divide a stage's devices tp*dp = "
                             f"{self.tp * self.dp}; divisors that would work: "
                             f"{_divisors(self.tp * self.dp)}")
        per_step = self.micro_batch_size * self.dp
        if self.global_batch % per_step:
            raise UsageError(f"layout.global_batch {self.global_batch} is not a multiple of "
                             f"micro_batch_size * dp = {per_step}; e.g. {per_step * max(1, round(self.global_batch / per_step))}")
        if self.schedule == "interleaved" and self.micro_batches % self.pp:
            raise UsageError(f"the interleaved schedule needs micro-batches per step "
                             f"({self.micro_batches}) to be a multiple of pp ({self.pp})")

    @property
    def dp(self) -> int:
        return self.devices // (self.tp * self.pp)

    @property
    def micro_batches(self) -> int:
        return self.global_batch // (self.micro_batch_size * self.dp)


@dataclass(kw_only=True)
class Device:
    """One accelerator. `efficiency` is the only number ever fitted (--calibrate-mfu)."""

    name: str = "device"
    kind: str = "cuda"                     # cuda: copies overlap compute, allocator temporaries
    capacity_bytes: int = 64 * 10**9
    peak_flops: float = 4.98e14           # per device, dense bf16
    efficiency: float = 0.5               # achieved fraction of peak in the model's kernels
    backward_ratio: float = 2.0            # backward time / forward time (two GEMMs per GEMM)
    memory_bytes_per_s: float = 1.6e12     # HBM, for the element-wise expert stages
    host_bytes_per_s: float = 25e9         # per direction, device <-> host (offload)
    interconnect_bytes_per_s: float = 50e9  # per device, expert-parallel all-to-all

    def __post_init__(self) -> None:
        if isinstance(self.capacity_bytes, float) and self.capacity_bytes.is_integer():
            self.capacity_bytes = int(self.capacity_bytes)   # 80e9 in a TOML file is a float
        if not isinstance(self.name, str):
            raise UsageError(f"device.name must be a string, got {self.name!r}")
        if self.kind not in DEVICE_KINDS:
            raise UsageError(f"device.kind must be one of {', '.join(DEVICE_KINDS)}, got {self.kind!r}")
        _check_positive("device", self, ("capacity_bytes",))
        _check_positive("device", self, ("peak_flops", "efficiency", "memory_bytes_per_s",
                                          "host_bytes_per_s", "interconnect_bytes_per_s",
                                          "backward_ratio"), float)
        if self.efficiency > 1:
            raise UsageError(f"device.efficiency is a fraction of peak, at most 1, got {self.efficiency}")


@dataclass(kw_only=True)
class Training:
    """Bytes per parameter: weights and gradients on every replica; optimizer state
    (fp32 master copy + two Adam moments = 12) sharded over data parallelism when
    `distributed_optimizer` (dense parameters over dp, expert parameters over dp/ep).
    `lazy_state`: gradients and optimizer state as PyTorch allocates them (each step's
    first backward makes the gradients and `zero_grad(set_to_none=True)` frees them after
    the step; the optimizer's state exists from its first step on), as the runtime's
    training loops run; False: persistent buffers, allocated before the first step.
    `torch_buffers`: what torch's own parallel training keeps besides (the runtime's
    `train --pp`): torch.distributed.pipelining's receive buffers, one per micro-batch for
    a stage's input and one for its output's gradient, from its first step on, and the
    last sent output until the next exchange (the replicas' gradients are reduced in
    place after the step: no DDP buckets). False: Megatron-style exchange and gradient
    buffers (none of these)."""

    param_bytes: int = 4
    grad_bytes: int = 4
    optimizer_bytes: int = 0
    distributed_optimizer: bool = True
    lazy_state: bool = False
    torch_buffers: bool = False

    def __post_init__(self) -> None:
        for name in ("param_bytes", "grad_bytes", "optimizer_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise UsageError(f"training.{name} must be an integer >= 0, got {value!r}")
        for name in ("lazy_state", "torch_buffers"):
            if not isinstance(getattr(self, name), bool):
                raise UsageError(f"training.{name} must be true or false, "
                                 f"got {getattr(self, name)!r}")


@dataclass(kw_only=True)
class Workload:
    """Routing loads: the skew schedule's production distribution, or a recorded trace."""

    steps: int = 1000
    seed: int = 0
    load_resolution: int = 256   # counts rounded up to mean/this (0: exact); sim/loads.py
    trace: Optional[str] = None
    skew: dict = field(default_factory=dict)   # SkewConfig fields (pattern, spike_*, ...)

    def __post_init__(self) -> None:
        _check_positive("workload", self, ("steps",))
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise UsageError(f"workload.seed must be an integer, got {self.seed!r}")
        if not isinstance(self.load_resolution, int) or isinstance(self.load_resolution, bool) \
                or self.load_resolution < 0:
            raise UsageError(f"workload.load_resolution must be an integer >= 0, "
                             f"got {self.load_resolution!r}")
        if self.trace is not None and not isinstance(self.trace, str):
            raise UsageError(f"workload.trace must be a file path, got {self.trace!r}")
        unknown = set(self.skew) - ({f.name for f in fields(SkewConfig)} - {"seed"})
        if unknown:
            raise UsageError(f"unknown workload.skew key(s) {', '.join(sorted(unknown))} "
                             f"(the seed is workload.seed); patterns: {', '.join(PATTERNS)}")
        self.skew_config()  # its own checks, now

    def skew_config(self) -> SkewConfig:
        return SkewConfig(seed=self.seed, **self.skew)


@dataclass(kw_only=True)
class Run:
    """Crash accounting and which policies to simulate."""

    checkpoint_interval: int = 100     # steps between checkpoints
    restart_s: float = 284.0           # one cold restart (published figure)
    policies: tuple = SIM_POLICIES

    def __post_init__(self) -> None:
        _check_positive("run", self, ("checkpoint_interval",))
        if not isinstance(self.restart_s, (int, float)) or isinstance(self.restart_s, bool) \
                or not math.isfinite(self.restart_s) or self.restart_s < 0:
            raise UsageError(f"run.restart_s must be a number >= 0, got {self.restart_s!r}")
        self.policies = tuple(self.policies)
        bad = [p for p in self.policies if p not in SIM_POLICIES]
        if bad or not self.policies:
            raise UsageError(f"unknown run.policies {bad or '(empty)'}; choose among "
                             f"{', '.join(SIM_POLICIES)}")
        twice = sorted({p for p in self.policies if self.policies.count(p) > 1})
        if twice:
            raise UsageError(f"run.policies lists {', '.join(twice)} more than once; give "
                             f"each policy once")


SECTIONS = {"model": SimModel, "layout": Layout, "device": Device, "training": Training,
            "workload": Workload, "run": Run}


@dataclass(kw_only=True)
class SimConfig:
    model: SimModel
    layout: Layout
    device: Device
    training: Training = field(default_factory=Training)
    workload: Workload = field(default_factory=Workload)
    run: Run = field(default_factory=Run)

    def __post_init__(self) -> None:
        m, lay = self.model, self.layout
        if m.num_experts % lay.ep:
            raise UsageError(f"model.num_experts {m.num_experts} cannot be split over ep "
                             f"{lay.ep}; ep values that would: {_divisors(m.num_experts)}")
        chunks = lay.pp * lay.virtual_stages
        if m.num_layers % chunks:
            raise UsageError(f"model.num_layers {m.num_layers} is not divisible by pp * "
                             f"virtual_stages = {chunks}; pp values that would: "
                             f"{[p for p in _divisors(m.num_layers) if p * lay.virtual_stages <= m.num_layers and m.num_layers % (p * lay.virtual_stages) == 0]}")
        if (lay.micro_batch_size * m.seq_len) % lay.tp or m.num_heads % lay.tp:
            raise UsageError(f"tp {lay.tp} must divide a micro-batch's tokens "
                             f"({lay.micro_batch_size * m.seq_len}, sequence parallelism) and "
                             f"model.num_heads ({m.num_heads})")
        skew = self.workload.skew_config()
        if self.workload.trace is None and lay.ep >= 2 and skew.spike_max_ratio > lay.ep:
            raise UsageError(f"workload.skew spike_max_ratio {skew.spike_max_ratio} is "
                             f"unreachable with ep {lay.ep} (max/mean is at most ep)")

    def to_dict(self) -> dict:
        d = {name: asdict(getattr(self, name)) for name in SECTIONS}
        d["layout"].update(dp=self.layout.dp, micro_batches=self.layout.micro_batches)
        d["run"]["policies"] = list(self.run.policies)
        return d

    def with_changes(self, **sections: dict) -> "SimConfig":
        """A copy with some fields of some sections replaced (validated again)."""
        parts = {name: getattr(self, name) for name in SECTIONS}
        for name, changes in sections.items():
            parts[name] = replace(parts[name], **changes)
        return SimConfig(**parts)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _multiples(step: int, near: int) -> list[int]:
    base = max(1, near // step)
    return sorted({step * k for k in (base, base + 1) if k > 0})


def load_config(preset: Optional[str] = None, toml_path: Optional[str] = None,
                overrides: Optional[dict[str, Any]] = None) -> SimConfig:
    """Preset, then the TOML file's sections, then dotted overrides; validated once."""
    from spikeguard.sim.presets import preset_dict

    data = preset_dict(preset or "small")
    if toml_path is not None:
        _merge(data, _read_toml(toml_path), source=str(toml_path))
    for key, value in (overrides or {}).items():
        section, _, name = key.partition(".")
        _merge(data, {section: {name: value}}, source="the command line")
    try:
        return SimConfig(**{name: cls(**data.get(name, {})) for name, cls in SECTIONS.items()})
    except TypeError as err:  # a wrong type the dataclass itself rejects
        raise UsageError(f"invalid configuration: {err}") from None


def _read_toml(path: str) -> dict:
    p = Path(path)
    if p.is_dir():
        raise UsageError(f"--config {p} is a folder, not a config file")
    if not p.is_file():
        raise UsageError(f"config file {p} does not exist")
    try:
        with p.open("rb") as f:
            return tomllib.load(f)
    except UnicodeDecodeError:
        raise UsageError(f"{p} is not a config file (not UTF-8 text; settings are "
                         f"TOML)") from None
    except tomllib.TOMLDecodeError as err:
        raise UsageError(f"config file {p} is not valid TOML: {err}") from None


def _merge(data: dict, new: dict, source: str) -> None:
    for section, values in new.items():
        if section not in SECTIONS:
            raise UsageError(f"unknown section [{section}] in {source}; sections: "
                             f"{', '.join(SECTIONS)}")
        if not isinstance(values, dict):
            raise UsageError(f"[{section}] in {source} must be a table of settings")
        known = {f.name for f in fields(SECTIONS[section])}
        for name, value in values.items():
            if name not in known:
                raise UsageError(f"unknown setting {section}.{name} in {source}; known: "
                                 f"{', '.join(sorted(known))}")
            data.setdefault(section, {})[name] = value
