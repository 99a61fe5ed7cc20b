"""Throughput of a torchtitan MoE under the guard at EP=2, side by side (CPU, emulated device).

    .venv/bin/python -m spikeguard.bench.titan_ratios --reps 5 --steps 8

Two spawned gloo ranks run torchtitan's own expert parallelism on a tiny `deepseek_v3`
(spikeguard.integrations.titan_models). Each segment is `--steps` steps of one setting;
segments are interleaved (ceiling, none, full, adaptive, ceiling, ...) `--reps` times, the
first round dropped as warm-up. Every `--spike-every`-th step routes every token of both
ranks to rank 0's experts (torchtitan's expert_bias_E): 2x rank 0's share. Settings:
  ceiling   the unguarded torchtitan model, no budget;
  none      the guard with everything kept and no budget;
  full      the guard recomputing every layer whole, at the budget;
  adaptive  the guard deciding per layer and micro-batch, at the budget;
and what a user would pick instead, torchtitan's own activation checkpointing applied as
its parallelize_fn applies it (`ac_config.build(dump_folder=...).apply(model)`), unguarded
(torchtitan's AC and the guard refuse each other), at the same budget:
  titan-full     FullAC: every transformer block recomputed in backward;
  titan-op       SelectiveAC, per op (this deepseek_v3's default in torchtitan's config
                 registry): the matmuls' outputs kept but every second, the rest recomputed;
  titan-every-2  FullAC on every 2nd block (the 2nd, 4th, ...: torchtitan's former
                 selective_ac_option "2"; 0.3.0 has no per-layer option, so its FullAC is
                 applied to those blocks alone).
Each is applied for its segment and the blocks put back after. Their device counts and
never refuses: a step past the budget on any rank `ran out`.
The budget is the calm step's true peak with everything kept, its optimizer step included
(worst rank), x 1.04. Each
segment's tokens/s over the ceiling's in the same round: the median with its quartiles and
the rounds a +-0.01 would need (spikeguard.bench.spread; a measurement, never asserted).
Peaks are the device's whole count over each step and its optimizer step (AdamW). The
guard's rows count the forwards that ran calm (runtime/calm_forward.py: no hook, no
per-layer bookkeeping) among rank 0's timed ones: each segment attaches a fresh guard, whose
first forwards run hooked. Needs `pip install 'spikeguard[titan]'`.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

from spikeguard.bench.runtime_ratios import ACTIONS, decision_cells, moved_of
from spikeguard.bench.spread import cell, needed, ratio_spread
from spikeguard.errors import ArgumentParser, UsageError
from spikeguard.memory.device import make_device
from spikeguard.parallel.launch_utils import close_gloo, init_gloo, run_spawned
from spikeguard.runtime.device_state import move_state_to_device
from spikeguard.train.engines import whole_step_peak

TITAN_AC = ("titan-full", "titan-op", "titan-every-2")
SETTINGS = ("ceiling", "none", "full", "adaptive") + TITAN_AC
EVERY = 2   # titan-every-2's period


def apply_titan_ac(model, setting: str) -> dict:
    """torchtitan's own activation checkpointing of `setting` (TITAN_AC) on `model`'s
    blocks; returns the blocks it wrapped, which `restore_blocks` puts back."""
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

    originals = dict(model.layers.named_children())
    if setting == "titan-op":
        SelectiveAC.Config().build(dump_folder="").apply(model)
    elif setting == "titan-full":
        FullAC.Config().build(dump_folder="").apply(model)
    elif setting == "titan-every-2":
        some = torch.nn.Module()   # FullAC.apply wraps every child of `.layers`
        some.layers = torch.nn.ModuleDict({k: v for i, (k, v) in enumerate(originals.items())
                                           if (i + 1) % EVERY == 0})
        FullAC.Config().build(dump_folder="").apply(some)
        for name, block in some.layers.named_children():
            model.layers.register_module(name, block)
    else:
        raise ValueError(f"unknown torchtitan AC setting {setting!r}; one of {TITAN_AC}")
    return originals


def restore_blocks(model, originals: dict) -> None:
    """Put back the blocks apply_titan_ac wrapped (the guard refuses a wrapped model)."""
    for name, block in originals.items():
        model.layers.register_module(name, block)


def _batches(rank: int, step: int, batch: int, seq: int):
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return [(torch.randint(0, 256, (batch, seq), generator=gen),
             torch.randint(0, 256, (batch, seq), generator=gen)) for _ in range(2)]


def _worker(rank, world, store, out, reps, steps, spike_every, batch, seq):
    warnings.filterwarnings("ignore", message="In CPU autocast")
    init_gloo(rank, world, store)
    import spikeguard
    from spikeguard.integrations.titan_models import TitanSizes, build_titan_model, lm_loss
    model = build_titan_model("deepseek_v3", TitanSizes(seq_len=seq), ep=2)
    blocks = [l.moe for l in model.layers.values() if getattr(l, "moe", None) is not None]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def one_step(guard, i, meter=None) -> int:
        """One step, its optimizer step included; the device's peak over both (0 for the
        ceiling; `meter`: torchtitan's AC rows' device, counting)."""
        for b in blocks:
            b.expert_bias_E.zero_()
            if spike_every and i % spike_every == spike_every - 1:
                b.expert_bias_E[:4] = 10.0
        data = _batches(rank, i, batch, seq)

        def body():
            for x, y in data:
                lm_loss(model, x, y).backward()
        if meter is not None:
            with meter.active():
                meter.reset_peak()
                body()
                opt.step()
                opt.zero_grad()
                return meter.peak()
        if guard is None:
            body()
        else:
            guard.run_step(body)
        opt.step()
        opt.zero_grad()
        # The step's record ends before the optimizer step, which the meter (reset at the
        # step's start, active in the optimizer's step hooks) counts too.
        return 0 if guard is None else whole_step_peak(guard)

    probe = spikeguard.attach(model, budget="1GiB", policy="none", optimizer=opt)
    # calm steps (even i never spikes with spike_every >= 2)
    calm = torch.tensor([max(one_step(probe, 2 * i) for i in range(2))])
    probe.detach()
    torch.distributed.all_reduce(calm, op=torch.distributed.ReduceOp.MAX)
    budget = int(calm.item() * 1.04)
    rows = []
    for rep in range(reps + 1):
        for setting in SETTINGS:
            guard = meter = None
            if setting in TITAN_AC:
                originals = apply_titan_ac(model, setting)
                meter = make_device(torch.device("cpu"), budget)   # not enforcing: counts
                move_state_to_device(model, [opt], meter)
            elif setting != "ceiling":
                guard = spikeguard.attach(model, budget="1GiB" if setting == "none" else budget,
                                          policy=setting, optimizer=opt)
            torch.distributed.barrier()
            start, cpu_start = time.perf_counter(), time.process_time()
            peak = max(one_step(guard, i, meter) for i in range(steps))
            cpu_s = time.process_time() - cpu_start   # this rank's CPU, before the barrier
            torch.distributed.barrier()
            seconds = time.perf_counter() - start
            moved = {} if guard is None else {
                **moved_of(guard.history),
                "calm": sum(h["calm_forwards"] for h in guard.history)}
            if guard is not None:
                guard.detach()
            if meter is not None:
                restore_blocks(model, originals)
                meter.close()
            rows.append({"rep": rep, "setting": setting, "s": seconds, "cpu_s": cpu_s,
                         "peak": peak,
                         "tokens": steps * 2 * batch * seq, "steps": steps, **moved})
    (Path(out) / f"{rank}.json").write_text(json.dumps({"budget": budget, "rows": rows}))
    del model, opt, guard, probe, meter
    close_gloo()


def main(argv=None) -> int:
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--spike-every", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=64)
    try:
        args = parser.parse_args(argv)   # a mistake is one line (UsageError), no abbreviation
        for name in ("reps", "steps", "spike_every", "batch_size", "seq_len"):
            if not 0 < getattr(args, name) <= 100_000:
                raise UsageError(f"--{name.replace('_', '-')} must be in [1, 100000], "
                                 f"got {getattr(args, name)}")
        if args.reps < 2:
            raise UsageError("--reps must be at least 2 (the first round is dropped)")
    except UsageError as err:
        print(f"spikeguard: error: {err}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="spikeguard-titan-") as tmp:
        out = Path(tmp)
        run_spawned(_worker, 2, (str(out), args.reps, args.steps, args.spike_every,
                                 args.batch_size, args.seq_len), out / "store", timeout_s=3000)
        ranks = [json.loads((out / f"{r}.json").read_text()) for r in range(2)]
    rows = ranks[0]["rows"]
    peaks = {s: max(r["peak"] for rk in ranks for r in rk["rows"] if r["setting"] == s)
             for s in SETTINGS}
    # The ceiling runs unmetered: it keeps what `none` keeps, so its peak is none's.
    peaks["ceiling"] = peaks["none"]
    print(f"budget {ranks[0]['budget'] / 2**20:.2f} MiB (calm peak x 1.04, worst rank); "
          f"medians of {args.reps} interleaved rounds (first dropped), EP=2, CPU, emulated device")
    print("\n".join(table(rows, peaks, ranks[0]["budget"])))
    print("(vs ceiling: per-round ratios of wall-clock tokens/s, median (quartiles); the CPU "
          "column the same of rank 0's CPU seconds, with the median's 95% interval; "
          "peak: the device's whole count, "
          "the optimizer step included; the ceiling's is none's, which keeps the same; "
          "titan-*: torchtitan's own activation checkpointing, unguarded, 'ran out' where a "
          "step passed the budget on a rank)")
    return 0


def table(rows: list[dict], peaks: dict, budget: int = 0) -> list[str]:
    """The markdown table from rank 0's rows and the worst rank's peaks; decisions,
    evictions and calm forwards are rank 0's, summed over the timed rounds' steps (two
    micro-batches a step). An unguarded torchtitan
    AC row whose peak passed `budget` ran out (on a device, at the allocation)."""
    ceiling = {r["rep"]: r["s"] for r in rows if r["setting"] == "ceiling"}
    ceiling_cpu = {r["rep"]: r.get("cpu_s") for r in rows if r["setting"] == "ceiling"}
    lines = ["| setting | tokens/s (rank 0) | vs ceiling | rounds for +-0.01 | vs ceiling, "
             "rank 0's CPU [95%] | peak (worst rank) | save / recompute / offload (rank 0) "
             "| evicted (rank 0) | calm forwards (rank 0) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for s in [s for s in SETTINGS if any(r["setting"] == s for r in rows)]:
        mine = [r for r in rows if r["setting"] == s and r["rep"] > 0]
        tps = statistics.median(r["tokens"] / r["s"] for r in mine)
        vs = ratio_spread([r["s"] for r in mine], [ceiling[r["rep"]] for r in mine])
        peak = f"{peaks[s] / 2**20:.2f} MiB" if peaks[s] else "-"
        guarded = [r for r in mine if "decisions" in r]
        moved = {"decisions": {a: sum(r["decisions"][a] for r in guarded) for a in ACTIONS},
                 "evicted_bytes": sum(r["evicted_bytes"] for r in guarded),
                 "prefetched_bytes": sum(r["prefetched_bytes"] for r in guarded)} \
            if guarded else {"decisions": {}}
        out = budget and s in TITAN_AC and peaks[s] > budget
        timed = s != "ceiling" and not out and all(r.get("cpu_s") is not None for r in mine)
        cpu = _cpu_cell(ratio_spread([r["cpu_s"] for r in mine],
                                     [ceiling_cpu[r["rep"]] for r in mine])) if timed else "-"
        calm = f"{sum(r['calm'] for r in guarded)} of {2 * sum(r['steps'] for r in guarded)}" \
            if guarded and all("calm" in r for r in guarded) else "-"
        lines.append(f"| {s} | {tps:.0f} | {'ran out' if out else cell(vs)} | "
                     f"{'-' if s == 'ceiling' else needed(vs)} | {cpu} | {peak} | "
                     + " | ".join(decision_cells(moved)) + f" | {calm} |")
    return lines


def _cpu_cell(s: dict) -> str:
    """'0.962 [0.95-0.97] (~40)': the median CPU ratio, its 95% interval, the rounds for
    +-0.01 (CPU time is blind to the waits in collectives: a rank's own work only)."""
    return f"{s['median']:.3f} [{s['ci95'][0]:.2f}-{s['ci95'][1]:.2f}] ({needed(s)})"


if __name__ == "__main__":
    sys.exit(main())
