"""Adaptive against the oracle, the static policies and the ceiling, at budgets that cut.

    .venv/bin/python -m spikeguard.bench.oracle_bench --preset small --reps 11

One process, the same data every step for every policy (spikeguard/bench/runtime_ratios.py's
setup: no optimizer step, so every policy's model stays the same and every step routes
alike), at each fraction of the true peak (the all-saved step's whole device count,
measured by a probe with no limit). The rows, timed interleaved round by round:

  ceiling        the plain model, no guard, no limit
  full           every layer recomputed whole
  none, experts, offload
                 the catalogue's static plans in every layer (one that runs out of the
                 budget is shown so, and not timed)
  oracle         the best plans and evictions with hindsight (plan/oracle_evict.py) from
                 the probe's exact counts and in-use, on the adaptive guard's calibrated
                 byte and cost model, RUN FOR REAL through the guard's `decide` seam
  adaptive       the guard as shipped
  static in advance / in hindsight: the static plan the byte model predicts fits at
                 least cost (full when none does) / the fastest that ran within the budget

Ratios are per round against the ceiling's or the oracle's seconds in the same round
(median, quartiles, range); the first round warms up and is dropped. CPU figures,
emulated device (the CPU allocator counting every live storage).
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from typing import Optional

import torch

import spikeguard
from spikeguard.data.corpus import load_corpus
from spikeguard.errors import DeviceOutOfMemory, UsageError
from spikeguard.memory.budget import format_bytes
from spikeguard.model import build_model, model_config
from spikeguard.plan.catalogue import POLICY_PLANS
from spikeguard.plan.oracle import Choice, LayerFigures, peak_of, problem_from_model
from spikeguard.plan.oracle_evict import solve_evict
from spikeguard.bench.runtime_ratios import (check_workload, decision_cells, memory_row,
                                             plain_step, time_interleaved, workload_parser)
from spikeguard.bench.oracle_costs import Tally, predicted, predicted_line
from spikeguard.bench.spread import cell, needed, ratio_spread

STATICS = ("none", "experts", "offload")


class Recorder:
    """A `decide` seam noting what the window knows at each decision, deciding as it does."""

    def __init__(self, guard):
        self.guard, self.seen = guard, []

    def decide(self, layer: int, num_routed: int):
        w, meter = self.guard.window, self.guard.meter
        mb = w.ctx.micro_batch
        part = w.ledger.bytes_by(mb, layer) - w.ledger.bytes_by(mb, layer, "dispatch")
        self.seen.append((mb, layer, w.ledger.in_use(), num_routed, w.grads_to_come.get(layer, 0),
                          part, w.num_tokens, w.ledger.bytes_by(mb, layer),
                          meter.where_peak(meter.where()) or None))   # its entry (CUDA: None)
        return w.decide(layer, num_routed)


class PlanTable:
    """A guard's `decide` seam that returns a fixed plan per (micro-batch, layer): the
    oracle's (plan/oracle_evict.py), computed before the step from its routed counts. Its
    evictions are made at the decisions it planned them for: `evict_at[(mb, layer)]` bytes
    of the layers below, earliest first as adaptive's evictor moves them, counted as the
    guard counts evictions. (plan/oracle.py's whole-layer evictions are not run here.)"""

    def __init__(self, guard, choices: dict, evict_at: Optional[dict] = None):
        self.guard, self.choices, self.evict_at = guard, choices, evict_at or {}
        # It evicts through a guard of policy none, whose hookless proof says none do.
        guard.hookless.enabled = False

    def decide(self, layer: int, num_routed: int):
        mb = self.guard.window.ctx.micro_batch
        assert not self.choices[(mb, layer)].evict, "whole-layer evictions are not run here"
        if self.evict_at.get((mb, layer)):
            freed = self.guard.tracker.evict(mb, layer, self.evict_at[(mb, layer)])
            step = self.guard.recorder
            if step is not None:
                step.evicted_bytes += freed
        return self.guard.planner.fixed(self.choices[(mb, layer)].plan, num_routed)


class OneProcess:
    """The layout of the bench: one process. spikeguard/bench/oracle_ep.py's `ExpertParallel`
    is the same bench on an expert-parallel group, each rank one of these processes."""

    def __init__(self, cfg, seed: int):
        self.cfg, self.seed = cfg, seed

    def build(self):
        return build_model(self.cfg, seed=self.seed)

    def all_ranks(self, flag: bool) -> bool:
        """Whether `flag` holds on every rank (every rank calls it at the same point)."""
        return flag

    def static_in_advance(self, problems: dict) -> str:
        return static_in_advance(problems)[0]


def probe(cfg, seed: int, batches, layout=None) -> tuple[int, list]:
    """The true all-saved peak and the window's figures at every decision."""
    layout = layout or OneProcess(cfg, seed)
    guard = spikeguard.attach(layout.build(), budget=1 << 50, policy="none")
    guard.hookless.enabled = False   # the window's figures measured, not modelled
    rec = Recorder(guard)
    guard.decide = rec.decide
    guard.run_step(lambda: plain_step(guard.model, batches))
    peak = guard.history[-1]["peak_bytes"]
    guard.detach()
    return peak, rec.seen


def oracle_problems(seen: list, guard, budget: int, room=None) -> dict:
    """Micro-batch -> the oracle's problem, on `guard`'s (adaptive, warmed up) byte model:
    its calibrated layer peaks (or `room`), cost model, prefetch margin and the head's
    bytes per token its forecast measured (plan/room.py's to-come at the last layer)."""
    planner, fc = guard.planner, guard.forecast
    room = room or guard.layer_room.room
    num_layers = max(s[1] for s in seen) + 1
    by_mb: dict[int, list] = {}
    for mb, layer, in_use, routed, grads, part, tokens, holds, entry in seen:
        margin = part if guard.engine.prefetch_enabled and layer < num_layers - 1 else 0
        by_mb.setdefault(mb, []).append(
            (layer, LayerFigures(in_use, routed, grads, part, margin, holds, entry), tokens))
    out = {}
    for mb, rows in by_mb.items():
        rows.sort(key=lambda r: r[0])
        figures = [f for _, f, _ in rows]
        last, tokens = figures[-1], rows[-1][2]
        per_token = fc.head_bytes_per_token + fc.post_bytes_per_token + fc.combine_bytes_per_token
        end = (last.in_use_bytes + planner.fixed(POLICY_PLANS["none"], last.num_routed).device_bytes
               + int(per_token * tokens))
        out[mb] = problem_from_model(planner, room, figures, end, budget,
                                     whole_layer_evictions=False)
    return out


def static_in_advance(problems: dict) -> tuple[str, float]:
    """The static plan the byte model predicts fits at least predicted cost ('full' when
    none does), and that cost in seconds."""
    best = ("full", float("inf"))
    for name, (fits, seconds) in static_predictions(problems).items():
        if fits and seconds < best[1]:
            best = (name, seconds)
    return best


def static_predictions(problems: dict) -> dict:
    """Per static plan: whether the byte model predicts it fits, and its predicted seconds."""
    out = {}
    for name in STATICS:
        plan, fits, seconds = POLICY_PLANS[name], True, 0.0
        for p in problems.values():
            idx = [next(i for i, o in enumerate(l.options) if o.label == Choice(plan))
                   for l in p.layers]
            fits &= peak_of(p, idx) <= p.budget_bytes
            seconds += sum(l.options[i].seconds for l, i in zip(p.layers, idx))
        out[name] = (fits, seconds)
    return out


def one_budget(cfg, seed: int, batches, peak: int, seen: list, fraction: float, reps: int,
               layout=None) -> dict:
    """Every row at one budget, timed interleaved (under EP every rank calls it alike)."""
    layout = layout or OneProcess(cfg, seed)
    budget = int(fraction * peak)
    models = {"ceiling": layout.build()}
    guards = {}
    for name in ("full",) + STATICS + ("oracle", "adaptive"):
        models[name] = layout.build()
        guards[name] = spikeguard.attach(models[name], budget=budget,
                                         policy="none" if name == "oracle" else name)
    tally = Tally(guards["adaptive"])
    guards["adaptive"].decide = tally.decide
    # The adaptive guard's first step calibrates the byte model the oracle is solved on.
    guards["adaptive"].run_step(lambda: plain_step(models["adaptive"], batches))
    problems = oracle_problems(seen, guards["adaptive"], budget)
    evict_s = guards["adaptive"].cost.offload_s_for_bytes
    solutions = {mb: solve_evict(p, evict_s) for mb, p in problems.items()}
    notes = {"oracle": _oracle_note(problems, solutions)}
    plans = None
    if layout.all_ranks(all(s.feasible for s in solutions.values())):
        choices = {(mb, i): problems[mb].layers[i].options[c].label
                   for mb, s in solutions.items() for i, c in enumerate(s.choices)}
        evict_at = {(mb, i): n for mb, s in solutions.items() for i, n in enumerate(s.evict_at)}
        plans = (choices, evict_at)
        guards["oracle"].decide = PlanTable(guards["oracle"], choices, evict_at).decide
    else:
        _drop(models, guards, "oracle")
    for name in STATICS + ("oracle",):
        if name in guards:   # a static plan that does not fit dies of it, as a job would
            try:
                guards[name].run_step(lambda: plain_step(models[name], batches))
            except DeviceOutOfMemory as err:
                notes[name] = f"out of memory: {str(err).splitlines()[0][:90]}"
                _drop(models, guards, name)
    times = time_interleaved(models, guards, batches, reps, list(models), step=plain_step)
    advance = layout.static_in_advance(problems)
    out = summarize(times, guards, notes, budget, peak, fraction, advance)
    out["predicted"] = predicted(oracle_problems(seen, guards["adaptive"], budget, tally.room),
                                 seen, guards["adaptive"], tally, plans)
    return out


def _drop(models: dict, guards: dict, name: str) -> None:
    guards.pop(name).detach(), models.pop(name)


def _oracle_note(problems: dict, solutions: dict) -> str:
    if not all(s.feasible for s in solutions.values()):
        return "no combination fits, even evicting everything below each layer" + _worst(problems)
    plans = {}
    for mb, s in solutions.items():
        for layer, c in zip(problems[mb].layers, s.choices):
            d = layer.options[c].label.describe()
            plans[d] = plans.get(d, 0) + 1
    predicted = sum(s.seconds for s in solutions.values())
    evict = sum(s.evict_bytes for s in solutions.values())
    return (f"predicted +{predicted * 1e3:.1f} ms a step, evicting {format_bytes(evict)}; plans: "
            + "; ".join(f"{n}x {d}" for d, n in sorted(plans.items(), key=lambda kv: -kv[1])))


def _worst(problems: dict) -> str:
    """Where the byte model puts a layer's own least peak furthest over the budget."""
    over = max((l.base_bytes + min(o.own_peak_bytes for o in l.options) - p.budget_bytes,
                mb, i) for mb, p in problems.items() for i, l in enumerate(p.layers))
    if over[0] <= 0:
        return ""
    return (f" (micro-batch {over[1]}, layer {over[2]}: its own least peak on the byte model "
            f"is {format_bytes(over[0])} over, nothing below it kept)")


def summarize(times: dict, guards: dict, notes: dict, budget: int, peak: int, fraction: float,
              advance: str) -> dict:
    """Per policy: tokens/s, ratio to the ceiling per round, memory and decisions."""
    rows = {}
    for p, seconds in times.items():
        rows[p] = {"median_s": statistics.median(seconds),
                   "vs_ceiling": ratio_spread(seconds, times["ceiling"]),
                   **memory_row(guards.get(p), peak), "note": notes.get(p, "")}
    ran = [p for p in ("full",) + STATICS if p in times]
    hindsight = max(ran, key=lambda p: rows[p]["vs_ceiling"]["median"])   # as the column
    out = {"fraction": fraction, "budget_bytes": budget, "true_peak_bytes": peak,
           "static_in_advance": advance if advance in times else None,
           "static_in_hindsight": hindsight, "policies": rows, "not_run": {
               p: n for p, n in notes.items() if p not in times}}
    if "oracle" in times:
        out["adaptive_over_oracle"] = ratio_spread(times["adaptive"], times["oracle"])
    out["adaptive_over_ceiling"] = rows["adaptive"]["vs_ceiling"]
    full, ad = rows["full"]["vs_ceiling"]["median"], rows["adaptive"]["vs_ceiling"]["median"]
    out["gap_closed"] = (ad - full) / (1 - full) if full < 1 else float("nan")
    return out


def measure(preset: str, batch_size: int, micro_batches: int, reps: int, fractions,
            seed: int = 0) -> dict:
    cfg = model_config(preset)
    gen = torch.Generator().manual_seed(seed)
    corpus = load_corpus(None)
    batches = [corpus.get_batch("train", batch_size, cfg.seq_len, gen)
               for _ in range(micro_batches)]
    peak, seen = probe(cfg, seed, batches)
    return {"preset": preset, "reps": reps, "batch_size": batch_size,
            "micro_batches": micro_batches, "tokens_per_step": batch_size * micro_batches
            * cfg.seq_len, "true_peak_bytes": peak,
            "budgets": [one_budget(cfg, seed, batches, peak, seen, f, reps) for f in fractions]}


def table_lines(result: dict) -> list[str]:
    """The markdown table per budget (what docs/oracle.md shows)."""
    lines = []
    tokens = result["tokens_per_step"]
    for b in result["budgets"]:
        lines += ["", f"`{result['preset']}` at {b['fraction']:.2f}x: budget "
                  f"{format_bytes(b['budget_bytes'])}, true peak {format_bytes(b['true_peak_bytes'])} "
                  f"(CPU, emulated device; per-round ratios: medians of {result['reps']} "
                  f"interleaved rounds, quartiles in brackets)", "",
                  "| policy | tok/s | vs ceiling | rounds for +-0.01 | peak / budget | overruns "
                  "| re-runs | save / recompute / offload (last step) | evicted (last step) |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for name, row in b["policies"].items():
            tag = {b["static_in_advance"]: " (static in advance)"}.get(name, "")
            if name == b["static_in_hindsight"]:
                tag += " (static in hindsight)"
            lines.append(f"| {name}{tag} | {tokens / row['median_s']:.0f} "
                         f"| {cell(row['vs_ceiling'])} "
                         f"| {'-' if name == 'ceiling' else needed(row['vs_ceiling'])} "
                         f"| {format_bytes(row['peak_bytes'])} / "
                         f"{'none' if name == 'ceiling' else format_bytes(b['budget_bytes'])} "
                         f"| {row['overruns']} | {row['safety_net_reruns']} | "
                         + " | ".join(decision_cells(row)) + " |")
        for name, note in b["not_run"].items():
            lines.append(f"| {name} | - | - | - | - | - | - | {note} | - |")
        lines += ["", f"static in advance (the byte model's pick): {b['static_in_advance'] or 'none fits'}; "
                  f"static in hindsight (the best median vs ceiling that ran): {b['static_in_hindsight']}", ""]
        if "adaptive_over_oracle" in b:
            ao = b["adaptive_over_oracle"]
            lines += [f"adaptive/oracle {cell(ao)} (range {ao['min']:.2f}-{ao['max']:.2f}; "
                      f"{needed(ao)} rounds would resolve +-0.01); "
                      f"adaptive/ceiling {cell(b['adaptive_over_ceiling'])}, gap from full "
                      f"to the ceiling closed {'-' if math.isnan(b['gap_closed']) else format(b['gap_closed'], '.0%')}", ""]
        oracle = b["policies"].get("oracle", {}).get("note") or b["not_run"].get("oracle", "")
        lines += [predicted_line(b["predicted"]) + ".", "", f"oracle: {oracle}"]
    return lines


def main(argv=None) -> int:
    parser = workload_parser(__doc__.splitlines()[0])
    parser.add_argument("--fractions", default="0.85,0.7",
                        help="budgets as fractions of the true peak, comma-separated")
    try:
        args = parser.parse_args(argv)
        fractions = parse_fractions(args.fractions)
        check_workload(args)
        torch.set_num_threads(args.threads)
        torch.manual_seed(0)
        result = measure(args.preset, args.batch_size, args.micro_batches, args.reps, fractions)
        print("\n".join(table_lines(result)))
        if args.json:
            from spikeguard.files import atomic_write
            atomic_write(args.json, json.dumps(result, indent=1) + "\n",
                         overwrite=args.overwrite, what="--json")
    except UsageError as err:
        print(f"spikeguard: error: {err}", file=sys.stderr)
        return 2
    return 0


def parse_fractions(text: str) -> list[float]:
    """--fractions parsed and checked."""
    try:
        fractions = [float(f) for f in text.split(",")]
    except ValueError:
        raise UsageError(f"--fractions must be numbers separated by commas, got "
                         f"{text!r}") from None
    if not all(0 < f <= 1 for f in fractions):
        raise UsageError(f"--fractions must each be in (0, 1], got {text!r}")
    return fractions

if __name__ == "__main__":
    raise SystemExit(main())
