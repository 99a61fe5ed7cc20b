"""spikeguard as a torchtitan model converter: the torchtitan way to add it to a run.

torchtitan 0.3.0 extends a model through `ModelConfigConverter`s, listed where the model
spec is made (`model_registry(flavor, converters=[...])` in a config registry), applied to
the model config before the model is built. This one carries the guard's settings:

    from spikeguard.integrations.titan_converter import SpikeGuardConverter, attach_titan
    config.model_spec = model_registry("16B", converters=[
        SpikeGuardConverter.Config(budget="70GiB", policy="adaptive")])
    config.model_spec.post_optimizer_build_fn = attach_titan   # attach once built

`convert` checks the settings (a wrong policy fails before anything is built) and returns
the root config with them recorded; the built model carries them (`spikeguard_settings`).
`attach_titan(optimizers, model_parts, parallel_dims)` has the signature of torchtitan's
`ModelSpec.post_optimizer_build_fn` (called by its Trainer once the model is parallelized,
on its device and its optimizers built: where the guard must attach, after torchtitan's
expert parallelism has sharded the experts). It chains the model's own hook (MoE models
register their load-balancing hook there) and attaches one guard per model part; the
guards are in `model.spikeguard`. Each optimizer step's micro-batches must then run inside
`guard.run_step(fn)` (or `with guard.step():`), as in any training loop; inside
torchtitan's own Trainer, `spikeguard.integrations.titan_trainer.with_spikeguard` does all
of this from the config (SpikeGuardTrainer runs each step in `run_step`). torchtitan's
activation checkpointing and a compiled MoE block are refused at attach, saying what to
turn off. Importing this module needs torchtitan (`pip install 'spikeguard[titan]'`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from spikeguard.errors import UsageError
from spikeguard.integrations.titan_models import torchtitan_modules
from spikeguard.runtime.guard_arguments import check_snapshot_folder
from spikeguard.runtime.policies import POLICIES, check_policies

torchtitan_modules()   # the one clear line when torchtitan is missing
from torchtitan.protocols.model import ModelConfigConverter  # noqa: E402

SETTINGS_ATTR = "spikeguard_settings"


@dataclass(frozen=True)
class GuardSettings:
    """What `spikeguard.attach` is called with once the model is built."""

    budget: Optional[str] = None
    policy: str = "adaptive"
    shared_policy: str = "keep"
    memory_snapshot: Optional[str] = None

    def __post_init__(self) -> None:
        if self.policy is None:
            raise UsageError(f"spikeguard.policy must be set; choose one of {', '.join(POLICIES)}")
        check_policies(self.policy, self.shared_policy)
        check_snapshot_folder(self.memory_snapshot)

    @classmethod
    def of(cls, config) -> "GuardSettings":
        """The settings a converter's Config (or anything with the same fields) holds."""
        return cls(config.budget, config.policy, config.shared_policy, config.memory_snapshot)

    def converter_config(self) -> "SpikeGuardConverter.Config":
        return SpikeGuardConverter.Config(budget=self.budget, policy=self.policy,
                                          shared_policy=self.shared_policy,
                                          memory_snapshot=self.memory_snapshot)


class SpikeGuardConverter(ModelConfigConverter):
    """Records the guard's settings on the model config; see the module docstring."""

    @dataclass(kw_only=True, slots=True)
    class Config(ModelConfigConverter.Config):
        budget: Optional[str] = None
        """Device budget ("70GiB"); None: the device's capacity less 5%."""
        policy: str = "adaptive"
        """adaptive, or a static baseline: none, experts, offload, full."""
        shared_policy: str = "keep"
        """Shared experts and dense layers: keep, or recompute."""
        memory_snapshot: Optional[str] = None
        """A folder for a memory snapshot of each out-of-memory (CUDA: the allocator's
        history, for pytorch.org/memory_viz), named by step and rank; None: none."""

    def __init__(self, config: Config):
        self.settings = GuardSettings.of(config)

    def convert(self, model_config):
        guarded = _guarded_config_class(type(model_config))
        fields = {f.name: getattr(model_config, f.name)
                  for f in dataclasses.fields(model_config) if f.init}
        new = guarded(**fields)
        # The subclass has no __slots__ of its own, so its instances take an attribute.
        setattr(new, SETTINGS_ATTR, self.settings)
        return new


_CLASSES: dict[type, type] = {}   # one generated subclass per model config class


def _guarded_config_class(base: type) -> type:
    """A subclass of the model's config class whose `build()` marks the built model."""
    if base in _CLASSES:
        return _CLASSES[base]

    def build(self, *args, **kwargs):
        model = base.build(self, *args, **kwargs)
        setattr(model, SETTINGS_ATTR, getattr(self, SETTINGS_ATTR, GuardSettings()))
        return model

    guarded = type(f"SpikeGuarded{base.__qualname__.replace('.', '')}", (base,),
                   {"build": build, "__module__": __name__})
    guarded = dataclass(kw_only=True)(guarded)
    _CLASSES[base] = guarded
    return guarded


def settings_of(model) -> Optional[GuardSettings]:
    return getattr(model, SETTINGS_ATTR, None)


def optimizers_of(part, optimizers: list) -> list:
    """The optimizers holding parameters of `part`, in the container's order."""
    mine = {id(p) for p in part.parameters()}
    return [o for o in optimizers
            if any(id(p) in mine for g in o.param_groups for p in g["params"])]


def attach_titan(optimizers, model_parts, parallel_dims=None, *, chain=None):
    """torchtitan's `post_optimizer_build_fn`: attach a guard to each model part that
    carries the converter's settings, with the optimizers of torchtitan's container that
    hold that part's parameters (the container makes one per part and optimizer name:
    several per part when its param groups name several). `chain`: a hook to run first
    (the model spec's own)."""
    from spikeguard.integrations import ADAPTERS
    from spikeguard.runtime.guard import attach
    if chain is not None:
        chain(optimizers, model_parts, parallel_dims)
    inner = list(getattr(optimizers, "optimizers", None) or
                 ([optimizers] if optimizers is not None else []))
    guards = []
    for part in model_parts:
        settings = settings_of(part)
        if settings is None:
            raise UsageError("this model was not built through SpikeGuardConverter: add "
                             "SpikeGuardConverter.Config(...) to model_registry(converters=...)")
        part.spikeguard = attach(part, budget=settings.budget, policy=settings.policy,
                                 optimizer=optimizers_of(part, inner),
                                 shared_policy=settings.shared_policy,
                                 memory_snapshot=settings.memory_snapshot,
                                 adapters=ADAPTERS)
        guards.append(part.spikeguard)
    return guards
