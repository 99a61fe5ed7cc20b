"""GPU check of the runtime, the one short script for a lent accelerator (< 4 minutes).

    .venv/bin/python scripts/gpu_check.py                # on a CUDA machine
    .venv/bin/python scripts/gpu_check.py --device cpu   # dry run of the same logic

Checks, one model on the device at a time (built, measured, deleted, the cache emptied,
`memory_allocated` checked back near its start before the next):
  1. bitwise: gradients of the `small` model (tiny on CPU) under every policy are
     `torch.equal` to the plain model's, itself checked reproducible (strict
     deterministic algorithms on CUDA: index_add and attention's backward use atomics);
  2. none: under a cap between the calm and the spike step's true peaks, "none" fits
     calm and dies of a real `torch.OutOfMemoryError` on the spike (a micro-batch of
     twice the tokens), the guard given a budget it never reaches;
  3. adaptive: calm and spike steps finish with the true peak under the cap, calm steps
     with no safety-net re-run (prevention, not the net); says whether they also stayed
     under the guard's budget, cap - max(5%, 256 MiB) on CUDA (the cap limits what the
     caching allocator reserves, the guard plans on what is allocated: the margin);
  4. snapshot: the spike with adaptive's prevention blinded, `memory_snapshot` given: a
     real out-of-memory under the cap, re-run by the net; one snapshot per refusal (on
     CUDA the allocator's history pickled, its own 'oom' event in it; JSON on CPU); then
     what the recording costs a calm step, interleaved (reported).
  4b. throughput ratios adaptive/ceiling and full/ceiling, interleaved, medians and
     min-max over rounds: reported, never PASS/FAIL.
  5. ep (two ranks: NCCL on two GPUs, gloo on the CPU dry run; skipped with one GPU):
     one rank's prevention blinded under a budget between its forward and backward
     peaks, so its device refuses in backward; the group must re-run the step together
     (the exchange journal's settlement, spikeguard.parallel.exchange_journal) with
     gradients bitwise those of the uninterrupted job.
Every step runs AdamW's step on the device too (the optimizer's state and temporaries are
in the peak). The true peak on CUDA is independent of the guard: the allocator's own event
history (`torch.cuda.memory._record_memory_history`) replayed from the step's start, so
the guard's `reset_peak_memory_stats` inside a step cannot hide anything; it is printed
next to the guard's own `history[-1]['peak_bytes']`. Every check runs in try/except; the
last line is `gpu_check: PASS` or `gpu_check: FAIL (<reasons>)`, exit code 0 or 1. After
--time-limit the remaining checks are skipped (a FAIL); a watchdog ends a hung run 60 s
later with the same line. On CPU the memory figures are the guard's ledger (there is no
allocator to read) and the cap is the emulated device the guard is given.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import threading
import time

import torch

try:  # a broken working tree must still end in the one line, not a traceback
    import spikeguard
    from spikeguard.errors import DeviceOutOfMemory
    from spikeguard.model import build_model, model_config
    from spikeguard.runtime.guard import Guard
    IMPORT_ERROR = None
except Exception as _err:  # noqa: BLE001
    IMPORT_ERROR = f"{type(_err).__name__}: {_err}"

MiB = 1 << 20
POLICIES = ("none", "full", "experts", "offload", "adaptive")
HUGE = 1 << 50                      # a budget nothing reaches: the guard never constrains
LEAK_BYTES = 32 * MiB               # allowed above the start between models (cuBLAS etc.)
MARGIN_FRACTION, MARGIN_FLOOR_BYTES = 0.05, 256 * MiB   # guard budget = cap - margin
WATCHDOG_GRACE_S = 60


class CheckFailed(Exception):
    """A check's condition did not hold: the message is the FAIL reason."""


class TimeUp(Exception):
    """The global time limit passed inside a check."""


def mib(num_bytes) -> str:
    return "n/a" if num_bytes is None else f"{num_bytes / MiB:.1f} MiB"


def say(*parts) -> None:
    print(*parts, flush=True)  # flushed: the order must survive a hard stop


def first_line(err: BaseException) -> str:
    return f"{type(err).__name__}: {(str(err).splitlines() or [''])[0][:200]}"


class Run:
    """What the checks share: the device, the deadline, the results, the memory start."""

    def __init__(self, args, device: torch.device):
        self.args, self.device = args, device
        self.cuda = device.type == "cuda"
        self.start_s = time.perf_counter()
        self.results: list[tuple[str, str, str]] = []   # (check, PASS/FAIL/REPORT, reason)
        self.current = "start"
        self.baseline_bytes = 0
        self.sizes: dict | None = None

    def time_left_s(self) -> float:
        return self.args.time_limit - (time.perf_counter() - self.start_s)

    def check_time(self, what: str) -> None:
        if self.time_left_s() <= 0:
            raise TimeUp(f"time limit {self.args.time_limit:.0f} s: skipped {what}")

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def warm_up(self) -> None:
        """Start cuBLAS and attention once, so their workspaces are in the baseline."""
        if not self.cuda:
            return
        x = torch.randn(64, 64, 64, device=self.device, requires_grad=True)
        y = torch.nn.functional.scaled_dot_product_attention(x[None], x[None], x[None])
        (y.sum() + (x @ x).sum()).backward()
        del x, y
        self.sync()
        gc.collect()
        torch.cuda.empty_cache()
        self.baseline_bytes = torch.cuda.memory_allocated(self.device)

    def release(self, tag: str) -> None:
        """After `del model, guard`: collect, empty the cache, check nothing stayed."""
        gc.collect()
        if not self.cuda:
            return
        torch.cuda.empty_cache()
        over = torch.cuda.memory_allocated(self.device) - self.baseline_bytes
        say(f"    released {tag}: allocated {mib(over)} over the start, "
            f"reserved {mib(torch.cuda.memory_reserved(self.device))}")
        if over > LEAK_BYTES:
            raise CheckFailed(f"{mib(over)} still allocated after {tag} (> {mib(LEAK_BYTES)})")

    def set_cap(self, cap_bytes: int | None) -> None:
        """The device limit: `cap_bytes` of the allocator, or the whole device (None)."""
        if not self.cuda:
            return
        gc.collect()
        torch.cuda.empty_cache()  # cached blocks above a lowered cap would still count
        total = torch.cuda.get_device_properties(self.device).total_memory
        fraction = 1.0 if cap_bytes is None else cap_bytes / total
        torch.cuda.set_per_process_memory_fraction(fraction, self.device)


def batches(cfg, device, sizes, seed):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for b in sizes:
        idx = torch.randint(0, cfg.vocab_size, (b, cfg.seq_len + 1), generator=gen)
        out.append((idx[:, :-1].to(device), idx[:, 1:].to(device)))
    return out


def run_guarded(guard, fn) -> None:
    """One step: `guard.run_step(fn)` where the guard has it (its safety net reaches
    backward), else `with guard.step(): fn()`."""
    if guard is None:
        fn()
    elif hasattr(guard, "run_step"):
        guard.run_step(fn)
    else:
        with guard.step():
            fn()


class TruePeak:
    """The device's peak over a span, from the CUDA allocator's own event history (every
    alloc and free, replayed from the bytes allocated at the start): nothing the guard
    resets inside the span can hide a byte. None on CPU (no allocator to read)."""

    def __init__(self, run: Run):
        self.run = run

    def __enter__(self):
        if self.run.cuda:
            self.start = torch.cuda.memory_allocated(self.run.device)
            torch.cuda.memory._record_memory_history(max_entries=1_000_000)
        return self

    def __exit__(self, *exc):
        self.bytes = None
        if not self.run.cuda:
            return False
        self.run.sync()
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        index = self.run.device.index or 0
        live = peak = self.start
        for event in snapshot["device_traces"][index]:
            if event["action"] == "alloc":
                live += event["size"]
                peak = max(peak, live)
            elif event["action"] == "free_completed":
                live -= event["size"]
        self.bytes = peak
        return False


def measured_step(run: Run, model, data, guard=None, where=None, opt=None) -> dict:
    """One step of all micro-batches' forward+backward (and `opt`'s step), with its true
    peak."""
    where = where if where is not None else {}

    def fn():
        for mb, (idx, tgt) in enumerate(data):
            where.update(phase="forward", micro_batch=mb)
            loss = model(idx, tgt).loss
            where.update(phase="backward")
            loss.backward()
            del loss

    model.zero_grad(set_to_none=True)
    run.sync()
    start_bytes = None
    if run.cuda:
        start_bytes = torch.cuda.memory_allocated(run.device)
        torch.cuda.reset_peak_memory_stats(run.device)
    start = time.perf_counter()
    with TruePeak(run) as true_peak:
        run_guarded(guard, fn)
        if opt is not None:
            where.update(phase="optimizer step")
            opt.step()
    run.sync()
    out = {"seconds": time.perf_counter() - start, "start": start_bytes, "true": None,
           "reserved": None, "frag": None,
           "record": guard.history[-1] if guard is not None else None}
    out["guard"] = out["record"]["peak_bytes"] if guard is not None else None
    if run.cuda:
        out["true"] = true_peak.bytes
        out["reserved"] = torch.cuda.memory_reserved(run.device)
        # Fragmentation at the peak: what the allocator held beyond what was in use.
        out["frag"] = torch.cuda.max_memory_reserved(run.device) - out["true"]
    out["peak"] = out["true"] if run.cuda else out["guard"]
    return out


def peaks_line(m: dict) -> str:
    if m["true"] is None:  # cpu: only the guard's ledger has a figure
        return "no figure (cpu, no guard)" if m["guard"] is None else \
            f"guard peak {mib(m['guard'])} (ledger)"
    ratio = f"{m['guard'] / m['true']:.3f}" if m["true"] and m["guard"] is not None else "n/a"
    return (f"true peak {mib(m['true']):>10s} | guard peak {mib(m['guard']):>10s} | "
            f"guard/true {ratio} | reserved {mib(m['reserved'])} | frag at peak {mib(m['frag'])}")


def grads_cpu(model) -> dict:
    return {n: None if p.grad is None else p.grad.detach().cpu()
            for n, p in model.named_parameters()}


def differing(ref: dict, got: dict) -> list[str]:
    return [n for n in ref if (ref[n] is None) != (got[n] is None)
            or (ref[n] is not None and not torch.equal(ref[n], got[n]))]


# ---- the checks ------------------------------------------------------------------------
def check_bitwise(run: Run) -> str:
    cfg = model_config(run.args.bitwise_preset)
    data = batches(cfg, run.device, [run.args.bitwise_batch] * 2, seed=11)
    what = f"preset {run.args.bitwise_preset}, 2 x {run.args.bitwise_batch} sequences"
    if not run.cuda:
        return bitwise(run, cfg, data) + f" ({what})"
    # index_add (combine) and its backward use atomics on CUDA, and memory-efficient
    # attention splits its backward unless deterministic mode is strict (warn_only=False).
    try:
        torch.use_deterministic_algorithms(True)
        return bitwise(run, cfg, data) + f" ({what}, deterministic algorithms)"
    except RuntimeError as err:
        if "deterministic" not in str(err):
            raise
        say(f"  strict deterministic mode refused an op ({first_line(err)}); again warn-only")
    finally:
        torch.use_deterministic_algorithms(False)
    try:
        torch.use_deterministic_algorithms(True, warn_only=True)
        return bitwise(run, cfg, data) + f" ({what}, deterministic algorithms, warn-only)"
    finally:
        torch.use_deterministic_algorithms(False)


def bitwise(run: Run, cfg, data) -> str:
    def plain():
        model = build_model(cfg, seed=1).to(run.device)
        m = measured_step(run, model, data)
        grads = grads_cpu(model)
        del model
        run.release("plain model")
        return m, grads

    m, ref = plain()
    say(f"  plain      : {peaks_line(m)}")
    num_unstable = len(differing(ref, plain()[1]))
    if num_unstable:
        raise CheckFailed(f"the plain model is not bitwise reproducible here "
                          f"({num_unstable} gradients differ run to run)")
    param_bytes = sum(p.numel() * p.element_size() for p in build_model(cfg).parameters())
    fixed, peak, failures = 0, 0, []
    for i, policy in enumerate(POLICIES):
        run.check_time(f"bitwise for {', '.join(POLICIES[i:])}")
        # adaptive: 3/4 of the activation bytes, so that all-save does not fit.
        budget = HUGE if policy != "adaptive" else fixed + int(0.75 * (peak - fixed))
        model = build_model(cfg, seed=1).to(run.device)
        guard = spikeguard.attach(model, budget=budget, policy=policy)
        m = measured_step(run, model, data, guard)
        diff = differing(ref, grads_cpu(model))
        guard.detach()
        del model, guard
        run.release(f"{policy} model")
        if policy == "none":
            # Bytes that are not activations: on CUDA what was allocated before the step
            # (parameters, cuBLAS workspace, data) and the gradients to come.
            fixed = m["start"] + param_bytes if run.cuda else m["record"]["static_bytes"]
            peak = m["record"]["peak_bytes"]
        dec = m["record"]["decisions"]
        say(f"  {policy:11s}: {'equal' if not diff else 'DIFFERENT'} | {peaks_line(m)} | "
            f"save {dec['save']} rec {dec['recompute']} off {dec['offload']}")
        if diff:
            failures.append(f"{policy}: {len(diff)} gradients differ ({diff[0]}, ...)")
        elif policy == "adaptive" and dec["recompute"] + dec["offload"] == 0:
            failures.append("adaptive saved everything under 3/4 of the bytes: "
                            "nothing was compared")
    if failures:
        raise CheckFailed("; ".join(failures))
    return f"{len(POLICIES)} policies bitwise equal to the plain model"


def check_sizes(run: Run) -> str:
    """The cap (between calm and spike peaks) and the guard's budget under it."""
    cfg, b = model_config(run.args.preset), run.args.batch
    calm, spike = batches(cfg, run.device, [b, b], 0), batches(cfg, run.device, [b, 2 * b], 1)
    peaks = {}
    for policy, name, data in (("none", "calm", calm), ("none", "spike", spike),
                               ("full", "spike", spike)):
        model = build_model(cfg, seed=1).to(run.device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        guard = spikeguard.attach(model, budget=HUGE, policy=policy, optimizer=opt)
        m = measured_step(run, model, data, guard, opt=opt)
        m = measured_step(run, model, data, guard, opt=opt)   # the optimizer's state exists
        guard.detach()
        del model, guard, opt
        run.release(f"{policy} model")
        peaks[policy, name] = m["peak"]
        say(f"  {policy:4s} {name:5s} (no limit): {peaks_line(m)}")
    calm_b, spike_b, full_b = peaks["none", "calm"], peaks["none", "spike"], peaks["full", "spike"]
    cap = calm_b + (spike_b - calm_b) // 2
    floor = MARGIN_FLOOR_BYTES if run.cuda else 0  # the floor is for the CUDA allocator
    margin = max(int(MARGIN_FRACTION * cap), floor)
    budget = cap - margin
    where = ""
    if run.cuda:
        total = torch.cuda.get_device_properties(run.device).total_memory
        where = f" (fraction {cap / total:.5f} of {total / 2**30:.1f} GiB)"
    say(f"  cap {mib(cap)}{where}; guard budget = cap - max({MARGIN_FRACTION:.0%}, "
        f"{mib(floor)}) = {mib(cap)} - {mib(margin)} = {mib(budget)}")
    if spike_b <= calm_b * 1.05:
        raise CheckFailed(f"the spike ({mib(spike_b)}) is not above calm ({mib(calm_b)})")
    if full_b >= budget:
        raise CheckFailed(f"full recompute of the spike needs {mib(full_b)}, over the "
                          f"budget {mib(budget)}: raise --batch")
    run.sizes = {"cfg": cfg, "calm": calm, "spike": spike, "cap": cap, "budget": budget}
    return f"calm {mib(calm_b)}, spike {mib(spike_b)}, full {mib(full_b)} -> cap {mib(cap)}"


def is_real_oom(err: BaseException) -> bool:
    """The allocator's own error, possibly re-raised by the guard as DeviceOutOfMemory."""
    for _ in range(16):  # the chain of causes, bounded
        if err is None:
            return False
        if isinstance(err, torch.OutOfMemoryError) or "CUDA out of memory" in str(err):
            return True
        err = err.__cause__ or err.__context__
    return False


def check_none(run: Run) -> str:
    s = run.sizes
    run.set_cap(s["cap"])
    model = build_model(s["cfg"], seed=1).to(run.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    # On CUDA the allocator under the cap is the device: a budget the guard never reaches,
    # so whatever kills "none" is the real limit. On CPU the budget is the emulated device.
    guard = spikeguard.attach(model, budget=HUGE if run.cuda else s["cap"], policy="none",
                              optimizer=opt)
    where, died = {}, None
    try:
        measured_step(run, model, s["calm"], guard, where, opt=opt)
        m = measured_step(run, model, s["calm"], guard, where, opt=opt)
    except (torch.OutOfMemoryError, DeviceOutOfMemory) as err:
        raise CheckFailed(f"calm did not fit under the cap {mib(s['cap'])}: out of memory "
                          f"in {where.get('phase')}: {first_line(err)}") from None
    say(f"  none calm : fits | {peaks_line(m)}")
    try:
        m = measured_step(run, model, s["spike"], guard, where, opt=opt)
        say(f"  none spike: finished | {peaks_line(m)}")
    except (torch.OutOfMemoryError, DeviceOutOfMemory) as err:
        real = is_real_oom(err)
        died = (f"{'real ' if real and run.cuda else ''}{type(err).__name__} in "
                f"{where.get('phase')} of "
                f"micro-batch {where.get('micro_batch')}", real)
        say(f"  none spike: out of memory: {died[0]}: {first_line(err)}")
    guard.detach()
    del model, guard, opt
    run.release("none model")   # the failed step must have left nothing behind
    if died is None:
        raise CheckFailed(f"none finished the spike under the cap {mib(s['cap'])}: no OOM seen")
    if run.cuda and not died[1]:
        raise CheckFailed(f"none died of the guard's own check, not the allocator: {died[0]}")
    return f"none: calm fits, spike dies ({died[0]}{'' if run.cuda else ', emulated on cpu'})"


def check_adaptive(run: Run) -> str:
    s = run.sizes
    run.set_cap(s["cap"])
    model = build_model(s["cfg"], seed=1).to(run.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    guard = spikeguard.attach(model, budget=s["budget"], policy="adaptive", optimizer=opt)
    over_cap, over_budget, calm_reruns, where = [], [], [], {}
    try:
        for name in ("calm", "spike", "calm", "spike"):
            try:
                m = measured_step(run, model, s[name], guard, where, opt=opt)
            except (torch.OutOfMemoryError, DeviceOutOfMemory) as err:
                raise CheckFailed(f"adaptive died on a {name} step, in {where.get('phase')} "
                                  f"of micro-batch {where.get('micro_batch')}: "
                                  f"{first_line(err)}") from None
            rec = m["record"]
            under = m["peak"] <= s["budget"]
            say(f"  adaptive {name:5s}: {peaks_line(m)} | under budget {under} | "
                f"reruns {rec['safety_net_reruns']} | {rec['decisions']}")
            if m["peak"] > s["cap"]:
                over_cap.append(f"{name} {mib(m['peak'])}")
            if not under:
                over_budget.append(name)
            if name == "calm" and rec["safety_net_reruns"]:
                calm_reruns.append(rec["safety_net_reruns"])
    finally:
        guard.detach()
        del model, guard, opt
    run.release("adaptive model")
    if over_cap:
        raise CheckFailed(f"adaptive over the cap {mib(s['cap'])}: {', '.join(over_cap)}")
    if calm_reruns:
        raise CheckFailed(f"adaptive needed the safety net on calm steps ({calm_reruns}): "
                          "the plan did not fit, the net caught it")
    budget_note = ("under the budget too" if not over_budget else
                   f"over the budget {mib(s['budget'])} (not the cap) in {', '.join(over_budget)}")
    return f"adaptive finished calm and spike under the cap, {budget_note}"


def check_throughput(run: Run) -> str:
    s = run.sizes
    model = build_model(s["cfg"], seed=1).to(run.device)
    seconds = {p: [] for p in ("ceiling", "full", "adaptive")}
    rounds = 0
    try:
        for _ in range(run.args.reps):
            if run.time_left_s() <= 0:
                break
            for policy in seconds:  # interleaved: each round times all three in turn
                run.set_cap(None if policy == "ceiling" else s["cap"])
                guard = None if policy == "ceiling" else spikeguard.attach(
                    model, budget=s["budget"], policy=policy)
                measured_step(run, model, s["calm"], guard)   # warm-up, not timed
                seconds[policy].append(measured_step(run, model, s["calm"], guard)["seconds"]
                                       + measured_step(run, model, s["spike"], guard)["seconds"])
                if guard is not None:
                    guard.detach()
                del guard
            rounds += 1
    finally:
        model.zero_grad(set_to_none=True)
        del model
        run.set_cap(None)
    run.release("throughput model")
    if rounds == 0:
        raise TimeUp(f"time limit {run.args.time_limit:.0f} s: skipped every throughput round")
    parts = []
    for policy in ("adaptive", "full"):
        ratios = [c / t for c, t in zip(seconds["ceiling"][:rounds], seconds[policy][:rounds])]
        parts.append(f"{policy}/ceiling {statistics.median(ratios):.3f} "
                     f"(min {min(ratios):.3f}, max {max(ratios):.3f})")
    cut = "" if rounds == run.args.reps else f", cut to {rounds} by the time limit"
    ms = statistics.median(seconds["ceiling"][:rounds]) * 1e3
    return (f"{', '.join(parts)}; medians of {rounds} interleaved rounds{cut} "
            f"(calm + spike step, ceiling {ms:.0f} ms, no limit)")


def blind_prevention(guard) -> None:
    """Every layer saves everything and none falls back whole: only the safety net is left."""
    from spikeguard.plan.catalogue import ALL_SAVE
    guard.decide = lambda layer, num_routed: guard.planner.fixed(ALL_SAVE, num_routed)
    guard.window.layer_cannot_fit = lambda layer: False


def snapshot_files_ok(run: Run, files: list, reruns: int) -> list[str]:
    """What is wrong with the snapshots of `reruns` refusals (empty: nothing)."""
    import json
    import pickle
    wrong = [] if len(files) == reruns else [f"{len(files)} snapshot files for {reruns} re-runs"]
    for path in files:
        if not run.cuda:
            record = json.loads(path.read_text())
            if record["in_use_at_refusal_bytes"] > record["budget_bytes"]:
                wrong.append(f"{path.name}: in use over the budget at the refusal")
            continue
        with open(path, "rb") as f:
            snap = pickle.load(f)
        events = [e for trace in snap["device_traces"] for e in trace]
        reserved = sum(seg["total_size"] for seg in snap["segments"])
        say(f"    {path.name}: {len(snap['segments'])} segments, {mib(reserved)} reserved, "
            f"{len(events)} events, {sum(e['action'] == 'oom' for e in events)} oom")
        if not any(e["action"] == "oom" for e in events):
            wrong.append(f"{path.name}: no 'oom' event in the allocator's history")
        if reserved > run.sizes["cap"]:
            wrong.append(f"{path.name}: {mib(reserved)} reserved, over the cap")
    return wrong


def check_snapshot(run: Run) -> str:
    """`memory_snapshot`: the spike with prevention blinded dies under the cap and is
    re-run; one snapshot per refusal, written at it (CUDA: the allocator's history, with
    its own 'oom' event); then what the recording costs a calm step (reported)."""
    import tempfile
    from pathlib import Path

    s = run.sizes
    run.set_cap(s["cap"])
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(s["cfg"], seed=1).to(run.device)
        guard = spikeguard.attach(model, budget=s["budget"], policy="adaptive",
                                  memory_snapshot=tmp)
        blind_prevention(guard)
        model.zero_grad(set_to_none=True)
        run_guarded(guard, lambda m=model: [m(x, y).loss.backward() for x, y in s["spike"]])
        reruns = guard.history[-1]["safety_net_reruns"]
        guard.detach()
        del model, guard
        run.release("snapshot model")
        wrong = snapshot_files_ok(run, sorted(Path(tmp).iterdir()), reruns)
    if reruns == 0:
        wrong.append("the blinded spike was not refused: nothing to snapshot")
    if wrong:
        raise CheckFailed("; ".join(wrong))
    return f"{reruns} refusal(s), one snapshot each; recording {snapshot_cost(run)}"


def snapshot_cost(run: Run) -> str:
    """A calm step's time with the recording on over off, interleaved rounds (medians)."""
    import tempfile

    s = run.sizes
    run.set_cap(None)
    model = build_model(s["cfg"], seed=1).to(run.device)
    times = {False: [], True: []}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(3):
            for on in (False, True):
                guard = spikeguard.attach(model, budget=s["budget"], policy="adaptive",
                                          memory_snapshot=tmp if on else None)
                for i in range(3):   # the first is a warm-up
                    model.zero_grad(set_to_none=True)
                    run.sync()
                    t0 = time.perf_counter()
                    run_guarded(guard, lambda m=model: [m(x, y).loss.backward()
                                                        for x, y in s["calm"]])
                    run.sync()
                    if i:
                        times[on].append(time.perf_counter() - t0)
                guard.detach()
                del guard   # a detached guard still holds the model
    model.zero_grad(set_to_none=True)
    del model
    run.release("snapshot cost model")
    ratio = statistics.median(times[True]) / statistics.median(times[False])
    return (f"costs a calm step {ratio:.3f}x ({statistics.median(times[True]) * 1e3:.0f} ms "
            f"against {statistics.median(times[False]) * 1e3:.0f} ms, medians of "
            f"{len(times[True])})")


def ep_worker(rank: int, world_size: int, store_path: str, out_dir: str, cuda: bool) -> None:
    """One rank of the EP check: the ceiling, then the same step with rank 0's
    prevention blinded under a budget between its forward and backward peaks."""
    import torch.distributed as dist

    from spikeguard.parallel.launch_utils import close_gloo, init_gloo

    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", init_method=f"file://{store_path}", rank=rank,
                                world_size=world_size)
    else:
        init_gloo(rank, world_size, store_path)
    try:
        _ep_rank(rank, world_size, out_dir, cuda, device)
    except BaseException:
        dist.destroy_process_group()   # no barrier: the peer may be inside a collective
        raise
    if cuda:
        dist.destroy_process_group()
    else:
        close_gloo()   # the models died with _ep_rank's frame (see close_gloo)


def _ep_rank(rank: int, world_size: int, out_dir: str, cuda: bool, device) -> None:
    import torch.distributed as dist

    from spikeguard.parallel import allreduce_replicated_grads, parallelize_experts

    cfg = model_config("tiny" if not cuda else "small", num_experts=4)
    data = batches(cfg, device, [4, 8], seed=100 + rank)

    def model_and_guard(budget):
        model = parallelize_experts(build_model(cfg, seed=0).to(device), dist.group.WORLD)
        return model, spikeguard.attach(model, budget=budget, policy="adaptive")

    peaks = {"forward": 0, "backward": 0}

    def step(model, guard, measure=False):
        def fn():
            for x, y in data:
                if measure:   # the ceiling's own device: each phase's peak apart
                    guard.meter.reset_peak()
                loss = model(x, y).loss / world_size
                if measure:
                    peaks["forward"] = max(peaks["forward"], guard.meter.peak())
                    guard.meter.reset_peak()
                loss.backward()
                del loss
                if measure:
                    peaks["backward"] = max(peaks["backward"], guard.meter.peak())
        guard.run_step(fn)
        allreduce_replicated_grads(model, dist.group.WORLD)
        return {n: p.grad.detach().cpu() for n, p in model.named_parameters()}

    model, guard = model_and_guard(HUGE)
    ceiling = step(model, guard, measure=True)
    forward, whole = peaks["forward"], peaks["backward"]
    guard.detach()
    del model, guard
    budget = (forward + whole) // 2 if rank == 0 else HUGE
    model, guard = model_and_guard(budget)
    if rank == 0:
        blind_prevention(guard)
    forced = step(model, guard)
    record = guard.history[-1]
    torch.save({"equal": all(torch.equal(ceiling[n], forced[n]) for n in ceiling),
                "record": record, "budget": budget, "forward": forward, "whole": whole},
               os.path.join(out_dir, f"ep{rank}.pt"))
    guard.detach()


def check_ep(run: Run) -> str:
    import tempfile

    from spikeguard.parallel.launch_utils import run_spawned

    if run.cuda and torch.cuda.device_count() < 2:
        return "skipped: one GPU (the EP check needs two)"
    with tempfile.TemporaryDirectory() as tmp:
        run_spawned(ep_worker, 2, (tmp, run.cuda), store_path=os.path.join(tmp, "store"),
                    timeout_s=max(30.0, min(120.0, run.time_left_s())))
        results = [torch.load(os.path.join(tmp, f"ep{r}.pt"), weights_only=False)
                   for r in range(2)]
    failures = []
    for rank, res in enumerate(results):
        rec = res["record"]
        say(f"  rank {rank}: budget {mib(res['budget'])} (forward {mib(res['forward'])}, "
            f"step {mib(res['whole'])}) | peak {mib(rec['peak_bytes'])} | reruns "
            f"{rec['safety_net_reruns']} {[r['scope'] for r in rec['safety_net']]} | "
            f"gradients {'equal' if res['equal'] else 'DIFFERENT'}")
        if not res["equal"]:
            failures.append(f"rank {rank}: gradients differ from the uninterrupted job")
        if [r["scope"] for r in rec["safety_net"]] != ["step"]:
            failures.append(f"rank {rank}: no step-level re-run ({rec['safety_net']})")
    if not results[0]["forward"] < results[0]["budget"] < results[0]["whole"]:
        failures.append("rank 0's budget is not between its forward and step peaks")
    if failures:
        raise CheckFailed("; ".join(failures))
    return ("one rank refused in backward: both re-ran the step together, gradients "
            f"bitwise equal ({'NCCL' if run.cuda else 'gloo, cpu dry run'})")


CHECKS = (("bitwise", check_bitwise, True), ("sizes", check_sizes, True),
          ("none", check_none, True), ("adaptive", check_adaptive, True),
          ("snapshot", check_snapshot, True), ("ep", check_ep, True),
          ("throughput", check_throughput, False))   # the last is reported, never asserted


def run_checks(run: Run) -> None:
    for name, fn, asserted in CHECKS:
        run.current = name
        if name not in ("bitwise", "sizes", "ep") and run.sizes is None:
            run.results.append((name, "FAIL", f"{name}: not run, it needs the sizes check"))
            say(f"[{name}] NOT RUN (the sizes check did not pass)")
            continue
        if run.time_left_s() <= 0:
            run.results.append((name, "FAIL", f"time limit {run.args.time_limit:.0f} s: "
                                              f"skipped {name}"))
            say(f"[{name}] SKIPPED (time limit)")
            continue
        say(f"[{name}]")
        t0 = time.perf_counter()
        try:
            detail = fn(run)
            status = "PASS" if asserted else "REPORT"
        except TimeUp as err:
            status, detail = "FAIL", str(err)
        except CheckFailed as err:
            status, detail = "FAIL", f"{name}: {err}"
        except Exception as err:  # noqa: BLE001 - torch.OutOfMemoryError too: a FAIL line
            status, detail = "FAIL", f"{name}: {first_line(err)}"
        if status == "FAIL":
            try:  # the failed check's tensors went with its exception: free them
                run.set_cap(None)
                run.release(f"failed {name}")
            except Exception as err:  # noqa: BLE001
                detail += f"; then {first_line(err)}"
        run.results.append((name, status, detail))
        say(f"[{name}] {status} ({time.perf_counter() - t0:.1f} s): {detail}")


def final_line(run: Run) -> str:
    reasons = [r.replace("\n", " ")[:300] for _, status, r in run.results if status == "FAIL"]
    return "gpu_check: PASS" if not reasons else f"gpu_check: FAIL ({'; '.join(reasons)})"


def start_watchdog(run: Run) -> threading.Timer:
    """A check stuck in a device call never returns to the time checks: end the process."""
    def stop():
        say(f"gpu_check: FAIL (hung in {run.current}: past the time limit "
            f"{run.args.time_limit:.0f} s + {WATCHDOG_GRACE_S} s)")
        os._exit(1)
    timer = threading.Timer(run.args.time_limit + WATCHDOG_GRACE_S, stop)
    timer.daemon = True
    timer.start()
    return timer


def indexed(device: torch.device) -> torch.device:
    """`cuda` as `cuda:N` (the current device): set_per_process_memory_fraction, the cap,
    takes an indexed device only (the first H200 run failed on a bare `cuda`)."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="spikeguard GPU check")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--preset", default=None, help="checks 2-4 (medium; tiny on cpu)")
    parser.add_argument("--batch", type=int, default=None, help="sequences per calm "
                        "micro-batch (16; 8 on cpu); the spike has twice as many")
    parser.add_argument("--bitwise-preset", default=None, help="check 1 (small; tiny on cpu)")
    parser.add_argument("--bitwise-batch", type=int, default=4)
    parser.add_argument("--reps", type=int, default=3, help="throughput rounds")
    parser.add_argument("--time-limit", type=float, default=240.0, help="seconds")
    args = parser.parse_args(argv)
    cpu = args.device == "cpu"
    args.preset = args.preset or ("tiny" if cpu else "medium")
    args.bitwise_preset = args.bitwise_preset or ("tiny" if cpu else "small")
    args.batch = args.batch or (8 if cpu else 16)
    if IMPORT_ERROR:
        say(f"gpu_check: FAIL (spikeguard does not import: {IMPORT_ERROR})")
        return 1
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        say("gpu_check: FAIL (no CUDA device here; --device cpu is the dry run)")
        return 1
    # cuBLAS is bitwise reproducible only with a fixed workspace: set before its first use.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    device = indexed(torch.device(args.device))
    if cpu:
        torch.set_num_threads(1)  # tiny models; two threads on shared cores stall each other
    run = Run(args, device)
    watchdog = start_watchdog(run)
    try:
        name = torch.cuda.get_device_name(device) if run.cuda else "cpu"
        step_api = ("guard.run_step(fn)" if hasattr(Guard, "run_step")
                    else "with guard.step() (no run_step yet)")
        say(f"device {name}, torch {torch.__version__}, preset {args.preset} "
            f"(bitwise {args.bitwise_preset}), batch {args.batch}, steps by {step_api}, "
            f"time limit {args.time_limit:.0f} s")
        if not run.cuda:
            say("cpu dry run: memory figures are the guard's ledger (no allocator to read); "
                "the cap is the emulated device the guard is given; fractions skipped")
        run.warm_up()
        run_checks(run)
    except BaseException as err:  # noqa: BLE001 - even Ctrl-C ends in the one line
        run.results.append((run.current, "FAIL", f"{run.current}: {first_line(err)}"))
    finally:
        # Joined, not only cancelled: a timer thread still alive at interpreter exit made
        # 1 run in 5 abort after its last line (torch 2.13, CPU, "terminate called").
        watchdog.cancel()
        watchdog.join(timeout=5)
    say(f"total {time.perf_counter() - run.start_s:.1f} s")
    line = final_line(run)
    say(line)
    return 0 if line == "gpu_check: PASS" else 1


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # The verdict is the last line and this code: interpreter teardown (thread pools, the
    # CUDA context) checks nothing, and must not turn a 0 or 1 into an abort's 134.
    os._exit(code)
