"""The typed configuration of a training run, built once (command line or TOML file).

    cfg = RunConfig.from_dict({"model": {"preset": "tiny"}, "parallel": {"nproc": 2},
                               "guard": {"budget": "2MiB"}, "train": {"steps": 4}})
    cfg = RunConfig.from_toml("run.toml")          # the same sections, as TOML tables

Sections: `model` (a built-in preset, or `hf` / `titan`, with overrides), `parallel`
(spikeguard.parallel.mesh.ParallelLayout plus the pipeline schedule),
`train` (spikeguard.train.loop.TrainConfig), `guard` (budget and policy), `skew`
(spikeguard.routing.skew.SkewConfig, or none) and `files` (data, log, traces,
checkpoints, TensorBoard, W&B, skipped steps, threads). Each part validates itself on creation and the run
checks what the parts cannot see alone (what does not combine), so every mistake is one
UsageError before any process starts. Library entry points take these objects; the
command line only fills them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Optional, Union

from spikeguard.errors import UsageError
from spikeguard.memory.budget import parse_bytes
from spikeguard.model.config import PRESETS, ModelConfig, model_config
from spikeguard.parallel.mesh import SCHEDULES, ParallelLayout
from spikeguard.routing.skew import PATTERNS, SkewConfig
from spikeguard.runtime.policies import check_policies
from spikeguard.train.train_config import MAX_SEED, TrainConfig
from spikeguard.train.typed_settings import check_sections, check_types, is_real, read_toml

SECTIONS = ("model", "parallel", "train", "guard", "skew", "files")
_PATHS = {p: "a path (a string)" for p in ("data", "log", "record_trace", "trace",
                                           "checkpoint_dir", "tensorboard",
                                           "memory_snapshot")}
# What a setting must be, where its annotation does not say it well (check_types).
DESCRIBED = {"FilesConfig": {**_PATHS, "resume": "true, false or 'auto'"},
             "GuardConfig": {"budget": "a byte count or a string like '24GiB' or 'auto'",
                             "cost_rates": "a path (a string)"}}
MAX_THREADS = MAX_NPROC = 4096   # threads, processes on this machine


@dataclass(frozen=True, kw_only=True)
class ModelChoice:
    """Which model: a built-in preset, a Hugging Face one (`hf`: a model type or a config
    JSON) or a torchtitan one (`titan`), with size overrides."""

    preset: str = "small"
    hf: Optional[str] = None
    titan: Optional[str] = None                      # a torchtitan model (titan_family.py)
    overrides: dict = field(default_factory=dict)   # seq_len, d_model, num_layers, ...

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            raise UsageError(f"unknown preset {self.preset!r}; choose one of {', '.join(PRESETS)}")
        if self.hf is not None and (not isinstance(self.hf, str) or not self.hf.strip()):
            raise UsageError(f"--hf needs a model type or a config JSON, got {self.hf!r}")
        if self.titan is not None:
            if self.hf is not None:
                raise UsageError("--titan and --hf name two models: choose one")
            from spikeguard.integrations.titan_models import check_family
            check_family(self.titan)

    @property
    def builtin(self) -> ModelConfig:
        """The built-in model's shape (under `hf`: the sizes it is built at)."""
        return model_config(self.preset, **self.overrides)

    @property
    def family_class(self):
        """The class of spikeguard.train.families that runs this kind of model."""
        from spikeguard.train.families import family_class
        return family_class(self.family)

    @property
    def shape(self):
        """The model's sizes, as its family reads them (ModelConfig, HFSizes, TitanSizes)."""
        return self.family_class.sizes_of(self)

    @property
    def name(self) -> str:
        return self.titan or (self.hf if self.hf is not None else self.preset)

    @property
    def family(self) -> str:   # the `name` of spikeguard.train.families' classes
        return "titan" if self.titan is not None else "hf" if self.hf is not None else "builtin"


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """nproc processes = pp stages x dp replicas x ep expert shards (torchrun, gloo on CPU).
    `ep` None: all of nproc without a pipeline, 1 with one."""

    nproc: int = 1
    pp: int = 1
    ep: Optional[int] = None
    schedule: str = "1f1b"

    def __post_init__(self) -> None:
        for name in ("nproc", "pp", "ep"):
            value = getattr(self, name)
            if value is None and name == "ep":
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise UsageError(f"--{name} must be a positive integer, got {value!r}")
            if value > MAX_NPROC:
                raise UsageError(f"--{name} must be at most {MAX_NPROC}, got {value:.3g}")
        if self.schedule not in SCHEDULES:
            raise UsageError(f"unknown schedule {self.schedule!r}; choose one of "
                             f"{', '.join(SCHEDULES)}")
        if self.schedule == "interleaved" and self.pp < 2:
            raise UsageError("--schedule interleaved needs a pipeline: use --pp 2 or more")

    @property
    def layout(self) -> ParallelLayout:
        ep = self.ep if self.ep is not None else (self.nproc if self.pp == 1 else 1)
        return ParallelLayout(self.nproc, pp=self.pp, ep=ep)

    @property
    def stages_per_rank(self) -> int:
        return 2 if self.schedule == "interleaved" else 1

    @property
    def distributed(self) -> bool:
        return self.nproc > 1


@dataclass(frozen=True, kw_only=True)
class GuardConfig:
    """The memory guard: a budget (bytes, or "auto": what a calm step needs with
    everything saved, plus 10% of its activations) and a policy. No budget and no policy:
    no guard (plain training)."""

    budget: Union[int, float, str, None] = None   # 80e9 in a TOML file is a float
    policy: Optional[str] = None
    shared_policy: str = "keep"
    cost_rates: Optional[str] = None   # plan with these rates, frozen (plan/cost_rates.py)

    def __post_init__(self) -> None:
        if self.budget is not None and self.budget != "auto":
            object.__setattr__(self, "budget", parse_bytes(self.budget))
        check_policies(self.policy, self.shared_policy)
        if self.cost_rates is not None:
            if not self.enabled:
                raise UsageError("--cost-rates is for the guard's planning: give --budget "
                                 "or --policy")
            from spikeguard.plan.cost_rates import load_rates
            load_rates(self.cost_rates)   # a small file: every mistake in it, one line, now

    @property
    def enabled(self) -> bool:
        return self.budget is not None or self.policy is not None

    @property
    def auto(self) -> bool:
        return self.budget == "auto"

    @property
    def budget_bytes(self) -> Optional[int]:
        return self.budget if isinstance(self.budget, int) else None


@dataclass(frozen=True, kw_only=True)
class SkewChoice:
    """Routing skew injected into the routers (`pattern` None: none). `spike_max` None:
    2.6x (the production maximum), at most the expert-parallel size. `spike_from_layer`:
    a spike step spikes the layers from that one on only (routing/skew.py SkewInjector)."""

    pattern: Optional[str] = None
    seed: int = 0
    spike_prob: Optional[float] = None
    spike_max: Optional[float] = None
    spike_from_layer: int = 0

    def __post_init__(self) -> None:
        if self.pattern is not None and self.pattern not in PATTERNS:
            raise UsageError(f"unknown skew pattern {self.pattern!r}; choose one of "
                             f"{', '.join(PATTERNS)}")
        for name in ("spike_prob", "spike_max"):
            value = getattr(self, name)
            if value is not None and (not is_real(value) or not math.isfinite(value)):
                raise UsageError(f"--{name.replace('_', '-')} must be a finite number, got {value!r}")
        if self.spike_prob is not None and not 0 <= self.spike_prob <= 1:
            raise UsageError(f"--spike-prob is a probability, in [0, 1], got {self.spike_prob!r}")
        if self.spike_max is not None and self.spike_max < 1:
            raise UsageError(f"--spike-max is a ratio max/mean, at least 1, got {self.spike_max!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or \
                not 0 <= self.seed <= MAX_SEED:
            raise UsageError(f"--skew-seed must be an integer in [0, {MAX_SEED}], got {self.seed!r}")
        if not isinstance(self.spike_from_layer, int) or isinstance(self.spike_from_layer, bool) \
                or self.spike_from_layer < 0:
            raise UsageError(f"--spike-from-layer must be an integer >= 0, got "
                             f"{self.spike_from_layer!r}")

    def config(self, ep: int) -> Optional[SkewConfig]:
        if self.pattern is None:
            return None
        spike_max = self.spike_max if self.spike_max is not None else min(2.6, float(ep))
        extra = {"spike_probability": self.spike_prob} if self.spike_prob is not None else {}
        return SkewConfig(seed=self.seed, pattern=self.pattern, spike_max_ratio=spike_max,
                          spike_min_ratio=min(1.2, spike_max), **extra)


@dataclass(frozen=True, kw_only=True)
class FilesConfig:
    """What the run reads and writes, and how it resumes."""

    data: Optional[str] = None
    log: Optional[str] = None
    record_trace: Optional[str] = None
    trace: Optional[str] = None
    checkpoint_dir: Optional[str] = None
    tensorboard: Optional[str] = None  # event files' folder (spikeguard.train.metrics)
    wandb: Optional[str] = None        # a W&B project (spikeguard.train.metrics)
    memory_snapshot: Optional[str] = None  # a snapshot per out-of-memory (memory/snapshot.py)
    checkpoint_every: int = 50
    resume: Union[bool, str] = False   # True, or "auto": start afresh when nothing is saved
    skip_steps: frozenset = frozenset()
    threads: Optional[int] = None
    overwrite: bool = False            # replace existing outputs (logs, trace, checkpoint)

    def __post_init__(self) -> None:
        if isinstance(self.skip_steps, str):
            object.__setattr__(self, "skip_steps", _parse_steps(self.skip_steps))
        elif not isinstance(self.skip_steps, frozenset):
            object.__setattr__(self, "skip_steps", frozenset(self.skip_steps))
        if any(not isinstance(v, int) or isinstance(v, bool) or v < 1 for v in self.skip_steps):
            raise UsageError("--skip-steps are step numbers, from 1")
        if not isinstance(self.checkpoint_every, int) or self.checkpoint_every <= 0:
            raise UsageError(f"--checkpoint-every must be a positive integer, "
                             f"got {self.checkpoint_every}")
        if self.threads is not None and (not isinstance(self.threads, int) or self.threads <= 0
                                         or self.threads > MAX_THREADS):
            # torch.set_num_threads(10**8) ends the process with a segmentation fault
            raise UsageError(f"--threads must be a positive integer, at most {MAX_THREADS}, "
                             f"got {self.threads}")
        _check_resume(self)
        if self.resume and self.checkpoint_dir is None:
            raise UsageError("--resume needs --checkpoint-dir")
        if self.record_trace is not None and self.trace is not None and \
                Path(self.trace).resolve() == Path(self.record_trace).resolve():
            raise UsageError("--record-trace would overwrite the --trace being replayed")


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """One training run; see the module docstring. `argv` is the command line a rank
    relaunched under torchrun reads its configuration from."""

    model: ModelChoice = field(default_factory=ModelChoice)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)
    skew: SkewChoice = field(default_factory=SkewChoice)
    files: FilesConfig = field(default_factory=FilesConfig)
    argv: tuple = ()

    def __post_init__(self) -> None:
        layout = self.parallel.layout
        model = self.model.shape
        layout.check(num_layers=model.num_layers, num_experts=model.num_experts,
                     micro_batches=self.train.micro_batches,
                     stages_per_rank=self.parallel.stages_per_rank)
        if self.skew.pattern is not None and layout.ep < 2:
            raise UsageError("--skew needs expert parallelism: use --ep 2 or more "
                             "(--nproc 2 or more without a pipeline)")
        if self.files.trace is not None and self.skew.pattern is not None:
            raise UsageError("--trace replays recorded routing; it cannot be combined with --skew")
        if self.skew.spike_from_layer and (self.skew.pattern is None
                                           or self.skew.spike_from_layer >= model.num_layers):
            raise UsageError(f"--spike-from-layer {self.skew.spike_from_layer} needs --skew and "
                             f"a layer of the model's {model.num_layers} (0 to "
                             f"{model.num_layers - 1})")
        self.model.family_class.check_run(self, layout)   # what the family cannot run
        skew = self.skew.config(layout.ep)
        if skew is not None:
            from spikeguard.routing.skew import SkewSchedule
            SkewSchedule(skew, layout.ep)   # its checks (e.g. a spike above ep) fail here
        late = sorted(s for s in self.files.skip_steps if s > self.train.steps)
        if late:
            raise UsageError(f"--skip-steps {','.join(map(str, late))}: the run has "
                             f"{self.train.steps} steps (--steps)")
        from spikeguard.model.config import activation_bytes_floor, check_trainable_size
        check_trainable_size(model.num_params, activation_bytes_floor(
            self.train.batch_size * model.seq_len, getattr(model, "vocab_size", 256),
            model.d_model, model.num_layers), f"model {self.model.name}")

    @property
    def layout(self) -> ParallelLayout:
        return self.parallel.layout

    @property
    def skew_config(self) -> Optional[SkewConfig]:
        return self.skew.config(self.layout.ep)

    @property
    def tokens_per_micro_batch(self) -> int:
        return self.train.batch_size * self.model.builtin.seq_len

    def with_world(self, nproc: int) -> "RunConfig":
        """The same run on `nproc` processes (a rank started by torchrun by hand)."""
        return replace(self, parallel=replace(self.parallel, nproc=nproc))

    # ---- building ---------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict, argv: tuple = ()) -> "RunConfig":
        """From {section: {key: value}}; unknown sections or keys are refused by name."""
        check_sections(data, SECTIONS)
        model = dict(data.get("model", {}))
        choice = {k: model.pop(k) for k in ("preset", "hf", "titan") if k in model}
        parallel = dict(data.get("parallel", {}))
        train = dict(data.get("train", {}))
        _typed(ModelChoice, choice, "model")
        _typed(ModelConfig, model, "model")
        _typed(ParallelConfig, parallel, "parallel")
        _typed(TrainConfig, train, "train")
        for section, kind in (("guard", GuardConfig), ("skew", SkewChoice),
                              ("files", FilesConfig)):
            _typed(kind, data.get(section, {}), section)
        if "micro_batches" not in train and parallel.get("pp", 1) > 1:
            # The 1F1B schedules fill every stage: one micro-batch per stage at least.
            train["micro_batches"] = parallel["pp"]
        return cls(model=_build(ModelChoice, {**choice, "overrides": model}, "model"),
                   parallel=_build(ParallelConfig, parallel, "parallel"),
                   train=_build(TrainConfig, train, "train"),
                   guard=_build(GuardConfig, data.get("guard", {}), "guard"),
                   skew=_build(SkewChoice, data.get("skew", {}), "skew"),
                   files=_build(FilesConfig, data.get("files", {}), "files"),
                   argv=tuple(argv))

    @classmethod
    def from_toml(cls, path: str | Path, overrides: Optional[dict] = None,
                  argv: tuple = ()) -> "RunConfig":
        """A TOML file's sections, then `overrides` ({section: {key: value}}) on top."""
        data = read_toml(path)
        check_sections(data, SECTIONS)
        for section, values in (overrides or {}).items():
            data.setdefault(section, {}).update(values)
        return cls.from_dict(data, argv=argv)


def check_inputs(cfg: RunConfig) -> None:
    """What the ranks would find wrong with the data, found once before torchrun starts
    them (each rank would otherwise print the same error): the corpus and its length."""
    from spikeguard.data.corpus import load_corpus

    seq_len = cfg.model.shape.seq_len
    load_corpus(cfg.files.data).check_seq_len(seq_len)


def _check_resume(files: "FilesConfig") -> None:
    if files.resume not in (True, False, "auto"):
        raise UsageError(f"--resume takes nothing or 'auto', got {files.resume!r}")
    if not isinstance(files.overwrite, bool):
        raise UsageError(f"files.overwrite must be true or false, got {files.overwrite!r}")


def _typed(kind: type, values: dict, section: str) -> None:
    check_types(kind, values, section, DESCRIBED.get(kind.__name__))


def _build(kind: type, values: Any, section: str):
    if not isinstance(values, dict):
        raise UsageError(f"[{section}] must be a table of settings")
    known = {f.name for f in fields(kind)}
    if kind is ModelChoice:
        known |= set(ModelConfig.__dataclass_fields__) - {"overrides"}
        bad = set(values.get("overrides", {})) - set(ModelConfig.__dataclass_fields__)
        if bad:
            raise UsageError(f"unknown setting(s) in [model]: {', '.join(sorted(bad))}")
    unknown = set(values) - known
    if unknown:
        raise UsageError(f"unknown setting(s) in [{section}]: {', '.join(sorted(unknown))}")
    try:
        return kind(**values)
    except TypeError as err:   # a value of the wrong type that the checks did not reach
        raise UsageError(f"[{section}]: {err}") from None


def _parse_steps(text: str) -> frozenset:
    try:
        return frozenset(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise UsageError(f"--skip-steps must be comma-separated step numbers, got {text!r}") from None
