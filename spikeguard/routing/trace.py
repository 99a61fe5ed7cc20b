"""Routing traces: record the per-expert token counts of a run, replay them exactly.

A benchmark must show every policy the same loads, or the comparison measures the router,
not the memory policy. `spikeguard train --record-trace FILE` writes what the routers did;
`--trace FILE` forces the routers to reproduce those counts, whatever the weights.

Format (version 1), JSON lines:
    {"format": "spikeguard-trace", "version": 1, "num_layers": L, "num_experts": E,
     "top_k": K, "ep": R, "micro_batches": M, "tokens_per_micro_batch": T, ...}
    {"step": 1, "counts": [[[c_e for each expert] for each layer] for each micro-batch]}
    ...
`counts` are the routed token copies each expert received in that micro-batch from all
ranks together (so they sum to R*T*K per layer); expert e lives on expert-parallel rank
e // (E / R). T is the tokens one rank routes per micro-batch. Extra header keys (preset,
seed, skew) are kept for humans and ignored by the checks.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from spikeguard.errors import UsageError
from spikeguard.extras import require
from spikeguard.model.router import Routing, TopKRouter, load_balancing_loss
from spikeguard.runtime.guard_arguments import attached_guard

TRACE_FORMAT = "spikeguard-trace"
TRACE_VERSION = 1
SHAPE_KEYS = ("num_layers", "num_experts", "top_k", "ep", "micro_batches",
              "tokens_per_micro_batch")


@dataclass
class Trace:
    """A loaded trace: the header and counts[step - 1, micro_batch, layer, expert]."""

    header: dict
    counts: np.ndarray

    @property
    def num_steps(self) -> int:
        return self.counts.shape[0]

    def rank_loads(self) -> np.ndarray:
        """Routed copies each EP rank receives: [steps, micro_batches, layers, ranks]."""
        s, m, l, e = self.counts.shape
        ep = self.header["ep"]
        return self.counts.reshape(s, m, l, ep, e // ep).sum(axis=-1)

    def rank_ratio(self, step: int) -> tuple[float, bool]:
        """(the step's max/mean routed copies per EP rank over its micro-batches and layers,
        whether that is a spike: above the recorded skew's calm maximum, default 1.2x)."""
        m, l, e = self.counts.shape[1:]
        ep = self.header["ep"]
        loads = self.counts[step - 1].reshape(m, l, ep, e // ep).sum(axis=-1)  # [mb, layer, rank]
        ratio = float((loads.max(axis=-1) / loads.mean(axis=-1)).max())
        calm = (self.header.get("skew") or {}).get("calm_max_ratio", 1.2)
        return ratio, ratio > calm

    def check_matches(self, steps: Optional[int] = None, **expected: int) -> None:
        """A clear error when this trace was recorded for another model or layout."""
        for key, want in expected.items():
            have = self.header[key]
            if have != want:
                raise UsageError(f"trace {key} is {have} but this run has {want}: "
                                 f"record the trace with the same model and layout")
        if steps is not None and steps > self.num_steps:
            raise UsageError(f"trace holds {self.num_steps} steps but {steps} were asked for")


def make_header(**shape: int) -> dict:
    """The header of a new trace; `shape` needs every key of SHAPE_KEYS (extra keys kept)."""
    missing = [k for k in SHAPE_KEYS if k not in shape]
    if missing:
        raise UsageError(f"trace header lacks {', '.join(missing)}")
    header = {"format": TRACE_FORMAT, "version": TRACE_VERSION, **shape}
    _check_header(header, "header")
    return header


def _check_header(header: dict, where: str) -> None:
    if header.get("format") != TRACE_FORMAT:
        raise UsageError(f"{where}: not a spikeguard trace (format {header.get('format')!r})")
    if header.get("version") != TRACE_VERSION:
        raise UsageError(f"{where}: trace version {header.get('version')!r} is not supported "
                         f"(this spikeguard reads version {TRACE_VERSION})")
    for key in SHAPE_KEYS:
        value = header.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise UsageError(f"{where}: {key} must be a positive integer, got {value!r}")
    if header["num_experts"] % header["ep"]:
        raise UsageError(f"{where}: ep {header['ep']} does not divide num_experts "
                         f"{header['num_experts']}")
    if header["top_k"] > header["num_experts"]:
        raise UsageError(f"{where}: top_k exceeds num_experts")


def load_trace(path: str | Path) -> Trace:
    """Read and check a trace file; every defect is one UsageError naming the line.
    Replay holds the counts in numpy (the `trace` extra); recording needs none."""
    np = require("numpy", "trace", "replaying a routing trace (--trace)")
    path = Path(path)
    if path.is_dir():
        raise UsageError(f"--trace {path} is a folder, not a trace file")
    if not path.is_file():
        raise UsageError(f"trace file {path} does not exist")
    try:
        with path.open(encoding="utf-8") as f:
            lines = [line for line in f if line.strip()]
    except UnicodeDecodeError:
        raise UsageError(f"{path} is not a trace file (not UTF-8 text; a trace is JSON "
                         f"lines)") from None
    if not lines:
        raise UsageError(f"trace file {path} is empty")
    header = _parse(lines[0], path, 1)
    _check_header(header, f"{path}:1")
    m, l, e = header["micro_batches"], header["num_layers"], header["num_experts"]
    per_layer = header["ep"] * header["tokens_per_micro_batch"] * header["top_k"]
    most = header["ep"] * header["tokens_per_micro_batch"]
    steps = []
    for number, line in enumerate(lines[1:], start=2):
        where = f"{path}:{number}"
        record = _parse(line, path, number)
        if record.get("step") != len(steps) + 1:
            raise UsageError(f"{where}: expected step {len(steps) + 1}, got {record.get('step')!r}")
        try:
            counts = np.asarray(record.get("counts"), dtype=np.int64)
        except (TypeError, ValueError, OverflowError):
            raise UsageError(f"{where}: counts must be a [micro_batches][layers][experts] "
                             f"list of integers") from None
        if counts.shape != (m, l, e):
            raise UsageError(f"{where}: counts have shape {list(counts.shape)}, the header "
                             f"says [{m}, {l}, {e}] (micro-batches, layers, experts)")
        if (counts < 0).any() or (counts > most).any():
            raise UsageError(f"{where}: an expert count is negative or above the "
                             f"{most} tokens of a micro-batch")
        if (counts.sum(axis=-1) != per_layer).any():
            raise UsageError(f"{where}: a layer's counts do not sum to ep x tokens x top_k "
                             f"= {per_layer}")
        steps.append(counts)
    if not steps:
        raise UsageError(f"trace file {path} has a header but no steps")
    return Trace(header, np.stack(steps))


def _parse(line: str, path: Path, number: int) -> dict:
    try:
        value = json.loads(line)
    except json.JSONDecodeError as err:
        if number == 1:
            raise UsageError(f"{path} is not a trace file (its first line is not JSON: "
                             f"{err.msg})") from None
        raise UsageError(f"{path}:{number}: not JSON ({err.msg})") from None
    if not isinstance(value, dict):
        raise UsageError(f"{path}:{number}: expected a JSON object")
    return value


class TraceWriter:
    """Appends one line per step; the header goes first. Each line is flushed, so a run
    that dies keeps every step it finished. `overwrite`: an existing file is replaced when
    the writer closes (spikeguard.files.LineFile), and kept whole when it is aborted (the
    run failed); without it, it is refused."""

    def __init__(self, path: str | Path, header: dict, overwrite: bool = False):
        from spikeguard.files import LineFile

        self._file = LineFile(path, mode="overwrite" if overwrite else "new",
                              what="--record-trace")
        self._write(header)

    def write_step(self, step: int, counts: list) -> None:
        self._write({"step": step, "counts": counts})

    def _write(self, record: dict) -> None:
        self._file.write_line(json.dumps(record, separators=(",", ":")))

    def close(self) -> None:
        self._file.close()

    def abort(self) -> None:
        self._file.abort()


class MicroBatchCounter:
    """Which micro-batch of the step the model's forward is in, and whether it is one.

    A training forward is a call of the top-level module with gradients enabled; the
    routers' forwards that backward's recompute runs, and evaluation under no_grad, are
    not. (The guard's micro-batch safety net re-runs a micro-batch inside the same
    top-level call, so it is still the same micro-batch here; its step-level net re-runs the
    whole step, and the guard's count restarts it.)"""

    def __init__(self, model: nn.Module):
        self.index = -1
        self.in_forward = False
        self._handles = [model.register_forward_pre_hook(self._enter),
                         model.register_forward_hook(self._leave)]

    def reset(self) -> None:
        self.index = -1

    def _enter(self, module, args) -> None:
        if torch.is_grad_enabled():
            self.index += 1
            # A guard's step-level safety net runs the step again from its first
            # micro-batch: the guard's own count says which one this is.
            guard = attached_guard(module)
            if guard is not None and guard.micro_batch_index() is not None:
                self.index = guard.micro_batch_index()
            self.in_forward = True

    def _leave(self, module, args, output) -> None:
        self.in_forward = False

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def layer_routers(modules) -> list[tuple[int, TopKRouter, nn.Module]]:
    """(layer in the whole model, router, the top module it runs under) of every router of
    `modules` (one model, or a pipeline rank's stage modules, each numbered from its
    `first_layer`)."""
    modules = [modules] if isinstance(modules, nn.Module) else list(modules)
    out = []
    for module in modules:
        first = getattr(module, "first_layer", 0)
        routers = [m for m in module.modules() if isinstance(m, TopKRouter)]
        out += [(first + i, r, module) for i, r in enumerate(routers)]
    if not out:
        raise UsageError("the model has no TopKRouter to trace")
    return out


class TraceRecorder:
    """Counts the token copies each router sends to each expert, per micro-batch and layer.

    Under expert parallelism each rank counts what it routes; `end_step` sums over the
    group (one all-reduce per step) so every rank holds the global counts. A pipeline
    rank counts the layers it holds (`num_layers`: the whole model's) and the group is
    the whole job, to which only `contributes` ranks (one data-parallel replica) add:
    a trace is one replica's routing, replayed on every replica."""

    def __init__(self, model, micro_batches: int, writer: Optional[TraceWriter] = None,
                 group=None, num_layers: Optional[int] = None, contributes: bool = True):
        routers = layer_routers(model)
        self.writer = writer
        self.group = group
        self.contributes = contributes
        self.num_experts = routers[0][1].gate.out_features
        self.micro_batches = micro_batches
        self.counters = {id(m): MicroBatchCounter(m) for _, _, m in routers}
        num_layers = num_layers if num_layers is not None else len(routers)
        self._counts = torch.zeros(micro_batches, num_layers, self.num_experts,
                                   dtype=torch.int64)
        self._handles = [r.register_forward_hook(self._hook(layer, self.counters[id(m)]))
                         for layer, r, m in routers]

    # The training loop's observer interface (spikeguard.train.loop.train(observers=)).
    def before_step(self, step: int) -> None:
        for counter in self.counters.values():
            counter.reset()
        self._counts.zero_()

    def after_step(self, step: int, record: dict) -> None:
        counts = self.end_step(self.group)
        if self.writer is not None:
            self.writer.write_step(step, counts)

    def _hook(self, layer: int, counter: MicroBatchCounter):
        def hook(router: TopKRouter, args, routing: Routing) -> None:
            mb = counter.index
            if not counter.in_forward or not 0 <= mb < self.micro_batches:
                return
            # = not +=: a safety-net re-run of the micro-batch routes it again, identically.
            self._counts[mb, layer] = torch.bincount(routing.topk_idx_TK.reshape(-1),
                                                     minlength=self.num_experts)
        return hook

    def end_step(self, group=None) -> list:
        """The step's global counts, [micro_batch][layer][expert] lists of ints."""
        counts = self._counts.clone() if self.contributes else torch.zeros_like(self._counts)
        if group is not None:
            import torch.distributed as dist
            dist.all_reduce(counts, group=group)
        return counts.tolist()

    def detach(self) -> None:
        for counter in self.counters.values():
            counter.remove()
        for handle in self._handles:
            handle.remove()
        if self.writer is not None:
            self.writer.close()


def forced_topk(counts_E: np.ndarray, rank: int, ep: int, num_tokens: int,
                top_k: int) -> torch.Tensor:
    """Expert ids [T, K] for this rank such that, over the ep ranks, expert e receives
    exactly counts_E[e] copies, and each token picks K distinct experts.

    The global copies, sorted by expert, are dealt to the ranks by stride (rank r takes
    positions r, r+R, ...), so each rank routes T*K copies and each expert's share is
    within one of counts/R. Token t of a rank takes its positions t, t+T, ..., t+(K-1)T:
    a run of one expert is at most T long (checked at load), so they are distinct."""
    np = require("numpy", "trace", "replaying a routing trace (--trace)")
    experts = np.repeat(np.arange(len(counts_E)), counts_E)[rank::ep]
    if len(experts) != num_tokens * top_k:
        raise UsageError(f"trace counts route {len(experts)} copies on rank {rank}, this run "
                         f"routes {num_tokens * top_k} (tokens x top_k)")
    return torch.from_numpy(experts.reshape(top_k, num_tokens).T.copy())


class TraceReplayer:
    """Forces every router to the trace's counts for the current step and micro-batch.

    The forced choice goes through `torch.topk` of a 0/1 matrix: topk is one of the ops
    every checkpoint policy keeps (spikeguard.runtime.executor.ALWAYS_SAVED_OPS), so a
    recompute in backward reuses the forward's choice, and the combine weights are the
    router's own scores at the forced experts, renormalised, as with a selection bias.
    Until the first `set_step` (or `before_step`) the routers route naturally."""

    def __init__(self, model, trace: Trace, rank: int = 0):
        """`model`: one model, or a pipeline rank's stage modules; `rank`: this process's
        expert-parallel rank (every data-parallel replica replays the same counts)."""
        routers = layer_routers(model)
        self.trace = trace
        self.rank = rank
        self.ep = trace.header["ep"]
        self.counters = {id(m): MicroBatchCounter(m) for _, _, m in routers}
        self._step: Optional[int] = None
        self._last: dict[int, torch.Tensor] = {}
        self._handles = [r.register_forward_hook(self._hook(layer, self.counters[id(m)]))
                         for layer, r, m in routers]

    def before_step(self, step: int) -> None:
        self.set_step(step)

    def after_step(self, step: int, record: dict) -> None:
        """Mark the step's load in its record: the replayed max/mean tokens per rank, and
        whether that is a spike (above the recorded skew's calm maximum, default 1.2x)."""
        if self.ep < 2:
            return
        record["trace_rank_ratio"], record["skew_spike"] = self.trace.rank_ratio(step)

    def set_step(self, step: int) -> None:
        if not 1 <= step <= self.trace.num_steps:
            raise UsageError(f"trace holds steps 1..{self.trace.num_steps}, not {step}")
        self._step = step
        for counter in self.counters.values():
            counter.reset()

    def _choice(self, layer: int, counter: MicroBatchCounter, num_tokens: int,
                top_k: int) -> Optional[torch.Tensor]:
        if self._step is None:
            return None  # not armed yet (e.g. a budget probe before the first step)
        if counter.in_forward:
            mb = counter.index
            if mb >= self.trace.counts.shape[1]:
                raise UsageError(f"trace replay: step {self._step} has no micro-batch {mb} "
                                 f"(the trace has {self.trace.counts.shape[1]} per step)")
            idx_TK = forced_topk(self.trace.counts[self._step - 1, mb, layer], self.rank,
                                 self.ep, num_tokens, top_k)
            self._last[layer] = idx_TK
            return idx_TK
        if torch.is_grad_enabled():
            return self._last.get(layer)  # recompute: topk's cached output is used anyway
        return None                       # evaluation: natural routing

    def _hook(self, layer: int, counter: MicroBatchCounter):
        def hook(router: TopKRouter, args, routing: Routing) -> Optional[Routing]:
            idx_TK = self._choice(layer, counter, routing.scores_TE.shape[0], router.top_k)
            if idx_TK is None:
                return None
            onehot_TE = torch.zeros_like(routing.scores_TE).scatter_(1, idx_TK, 1.0)
            _, topk_idx_TK = torch.topk(onehot_TE, router.top_k, dim=-1)
            score_TK = routing.scores_TE.gather(-1, topk_idx_TK)
            weight_TK = (score_TK / score_TK.sum(dim=-1, keepdim=True)).to(routing.topk_weight_TK.dtype)
            return Routing(topk_idx_TK, weight_TK, routing.scores_TE,
                           load_balancing_loss(routing.scores_TE, topk_idx_TK))
        return hook

    def detach(self) -> None:
        for counter in self.counters.values():
            counter.remove()
        for handle in self._handles:
            handle.remove()
