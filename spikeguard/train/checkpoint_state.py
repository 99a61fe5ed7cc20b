"""One rank's training state as the flat dict of tensors torch.distributed.checkpoint (DCP)
saves and loads, keyed so that a checkpoint reshards into another expert x data layout.

    keys = TrainingState(parts, rank=r, shard=k, reshardable=True)
    dcp.save(keys.to_save(step, generator, guards), ...)        # spikeguard.train.checkpoint
    dest = keys.destination(metadata); dcp.load(dest, ...); keys.apply(dest, ...)

E = experts of a MoE block, L = this rank's local experts (E / ep), g = a global expert
index. The keys (every value a tensor; what is not one is JSON in a uint8 tensor, so a
load unpickles nothing):

    model.<fqn>                         a parameter or buffer, the same on every rank
    model.<fqn>.expert<g>               expert g's slice of a stacked expert weight (L x ...)
    optim.state.<fqn>.<name>[.expert<g>]  AdamW's state per parameter (`step`, and its
                                        `exp_avg`, `exp_avg_sq` split as the weight is)
    optim.param_groups                  each parameter's hyperparameters (JSON)
    data.shard<k>                       data shard k's generator: where its data stands
    rng.rank<r>                         rank r's torch RNG state
    guard.rank<r>                       rank r's guards' learned state (JSON: runtime/learned.py)
    step                                the step saved

Model and optimizer go through DCP's own `get_model_state_dict` / `get_optimizer_state_dict`
(flattened: keyed by parameter name, not by position in the optimizer), then the built-in
MoE blocks' stacked expert weights and their AdamW moments are split along E and keyed by
GLOBAL expert index (rank r of an EP group of R holds experts [r*L, (r+1)*L):
spikeguard.parallel.expert_parallel). A key two ranks both hold (a replicated weight; the
same expert on two data-parallel replicas) holds the same bytes on both, so DCP's
deduplication keeps one. A rank of another layout asks for its own experts' keys and finds
them whoever wrote them. A pipeline rank's stages (not reshardable) are saved under
`rank<r>.part<i>.` and resumed only in the same layout.
"""

from __future__ import annotations

import json
from typing import Any, Optional, Sequence

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict,
                                                     set_optimizer_state_dict)

from spikeguard.errors import UsageError

_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def expert_slices(module: nn.Module) -> dict[str, tuple[int, int]]:
    """Name -> (its first global expert, local experts) of every stacked expert weight of
    the built-in MoE blocks in `module` (the whole E outside expert parallelism)."""
    from spikeguard.model.moe import MoEBlock
    from spikeguard.parallel.expert_parallel import ExpertParallelDispatcher

    out = {}
    for name, block in module.named_modules():
        if not isinstance(block, MoEBlock):
            continue
        lo = (block.dispatcher.expert_lo
              if isinstance(block.dispatcher, ExpertParallelDispatcher) else 0)
        for pname, _ in block.experts.named_parameters():
            out[".".join(filter(None, (name, "experts", pname)))] = (lo, block.experts.num_experts)
    return out


def as_bytes(value: Any) -> torch.Tensor:
    """A JSON value as a uint8 tensor (DCP's own non-tensor values are pickles)."""
    return torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8)


def from_bytes(t: torch.Tensor) -> Any:
    return json.loads(bytes(t.numpy().tobytes()).decode())


class TrainingState:
    """The keys of one rank's state (module doc). `parts`: (module, optimizer) pairs;
    `shard`: this rank's data shard; `reshardable`: keyed for another layout (one whole
    model per rank) or by rank (a pipeline's stages)."""

    def __init__(self, parts: Sequence[tuple[nn.Module, Any]], *, rank: int = 0,
                 shard: int = 0, reshardable: bool = True):
        self.parts, self.rank, self.shard = list(parts), rank, shard
        self.prefixes = ([""] if reshardable and len(self.parts) == 1 else
                         [f"rank{rank}.part{i}." for i in range(len(self.parts))])

    # ---- saving --------------------------------------------------------------------
    def to_save(self, step: int, generator: torch.Generator, guards: Sequence[Any]) -> dict:
        out: dict[str, torch.Tensor] = {"step": torch.tensor(step, dtype=torch.int64)}
        for prefix, (module, optimizer) in zip(self.prefixes, self.parts):
            out.update(self._model_and_optimizer(prefix, module, optimizer)[0])
        out[f"data.shard{self.shard}"] = generator.get_state()
        out[f"rng.rank{self.rank}"] = torch.get_rng_state()
        if guards:
            out[f"guard.rank{self.rank}"] = as_bytes([g.state_dict() for g in guards])
        # torch.save (DCP's writer) writes a view's whole storage: an expert's slice alone.
        return {k: v.clone() if v.numel() * v.element_size() != v.untyped_storage().nbytes()
                else v for k, v in out.items()}

    def _model_and_optimizer(self, prefix: str, module: nn.Module, optimizer):
        """(flat tensors to save or load into, the optimizer's flat state dict, its
        hyperparameters)."""
        slices = expert_slices(module)
        out = _split(get_model_state_dict(module), slices, f"{prefix}model.")
        osd = get_optimizer_state_dict(module, optimizer, options=_FLAT)
        state = {k[len("state."):]: v for k, v in osd.items() if k.startswith("state.")}
        out.update(_split(state, {f"{fqn}.{name}": s for fqn, s in slices.items()
                                  for name in _moment_names(state, fqn)},
                          f"{prefix}optim.state."))
        groups = {k: v for k, v in osd.items() if not k.startswith("state.")}
        out[f"{prefix}optim.param_groups"] = as_bytes(groups)
        return out, osd, groups

    # ---- loading -------------------------------------------------------------------
    def load(self, load_fn, metadata, *, same_layout: bool) -> tuple[int, Optional[list]]:
        """Load into this rank's modules and optimizers with `load_fn(dest)` (dcp.load),
        the keys checked first against the checkpoint's `metadata` (its
        state_dict_metadata: key -> storage metadata). Returns (the step, the guards'
        learned states or None). The data position and RNG are restored only in the same
        layout (`same_layout`); in another the loop replays the data (spikeguard.train.loop)."""
        sizes = {k: list(getattr(m, "size", [])) for k, m in metadata.items()}
        dest: dict[str, torch.Tensor] = {"step": torch.zeros((), dtype=torch.int64)}
        parts = []
        for prefix, (module, optimizer) in zip(self.prefixes, self.parts):
            tensors, osd, groups = self._model_and_optimizer(prefix, module, optimizer)
            key = f"{prefix}optim.param_groups"
            if key in sizes:
                tensors[key] = torch.zeros(sizes[key], dtype=torch.uint8)
            missing = [k for k in tensors if k not in sizes]
            if missing:
                raise UsageError(f"it holds no {missing[0]!r}" + (
                    f" (nor {len(missing) - 1} more)" if len(missing) > 1 else ""))
            dest.update(tensors)
            parts.append((module, optimizer, osd, groups, key))
        optional = [f"guard.rank{self.rank}"]
        if same_layout:
            optional += [f"data.shard{self.shard}", f"rng.rank{self.rank}"]
        for key in optional:
            if key in sizes:
                dest[key] = torch.zeros(sizes[key], dtype=torch.uint8)
        load_fn(dest)
        for module, optimizer, osd, groups, key in parts:
            saved = from_bytes(dest[key])
            if set(saved) != set(groups):
                raise UsageError("its optimizer hyperparameters name other parameters")
            osd.update({k: tuple(v) if isinstance(groups[k], tuple) else v
                        for k, v in saved.items()})
            set_optimizer_state_dict(module, optimizer, osd, options=_FLAT)
        self.data_state = dest.get(f"data.shard{self.shard}")
        self.rng_state = dest.get(f"rng.rank{self.rank}")
        guards = dest.get(f"guard.rank{self.rank}")
        return int(dest["step"]), from_bytes(guards) if guards is not None else None


def _moment_names(state: dict, fqn: str) -> list[str]:
    """The optimizer's per-parameter state of `fqn` shaped like it (AdamW's moments)."""
    return [k[len(fqn) + 1:] for k, v in state.items()
            if k.startswith(fqn + ".") and isinstance(v, torch.Tensor) and v.dim() > 0]


def _split(flat: dict, slices: dict[str, tuple[int, int]], prefix: str) -> dict:
    """`flat` under `prefix`, each stacked expert tensor named in `slices` split along its
    first dimension into one key per global expert (views: a load writes through)."""
    out = {}
    for key, value in flat.items():
        if not isinstance(value, torch.Tensor):
            raise UsageError(f"{key} is a {type(value).__name__}, not a tensor: not saved")
        if key in slices:
            lo, num_local = slices[key]
            assert value.shape[0] == num_local, (key, tuple(value.shape), num_local)
            out.update({f"{prefix}{key}.expert{lo + e}": value[e] for e in range(num_local)})
        else:
            out[prefix + key] = value
    return out
