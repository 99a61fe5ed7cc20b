"""Throughput through transformers' real `Trainer`: adaptive and full against the ceiling.

    .venv/bin/python -m spikeguard.bench.trainer_bench --reps 5
    .venv/bin/python -m torch.distributed.run --standalone --nproc-per-node 2 \
        -m spikeguard.bench.trainer_bench --reps 5 --ep 2    # under DistributedConfig

Each round trains a fresh Trainer per policy, the policies taking turns (ceiling, full,
adaptive, ceiling, ...) so that machine noise hits all alike: `--steps` optimizer steps of
`--batch` sequences of 129 bytes of a Qwen3-MoE at spikeguard's HF sizes (4 layers, 8
experts top-2, D = F = 128), timed per step by a callback from the second step on (the
first pays the Trainer's and the guard's setup). The ceiling is the Trainer with no guard;
full and adaptive run under `guard_trainer` at `--fraction` x the ceiling's peak (the
device's own peak counter with everything kept, the worst rank's). Each round's ratio is
the ceiling's median step time over the policy's; printed: the median over rounds and the
quartiles and the rounds a +-0.01 would need (spikeguard.bench.spread), with each policy's
largest device peak (the guard's meter at each step's end: the optimizer step included;
the ceiling's from a Trainer under a guard that keeps everything). On a CPU-only machine the
device is emulated by the CPU allocator: CPU figures, not GPU ones.

Under `--ep` a step's time is the group's: per step the slowest rank's wall seconds.
Beside it, the CPU seconds of the busiest rank's process per step (`time.process_time`),
which the seconds a process waits (for its peer in a collective, for a core on a shared
machine) do not count. Why: rank 0's wall ratio alone put adaptive at 1.2-1.5x the
ceiling in two runs at load 11-16; re-measured at load 6-10 the two ranks' walls agree
within 2% (0.367 / 0.372 s a ceiling step), so rank 0's clock was not biased, but only
half of a step's wall is the process's own CPU (0.17-0.19 s of 0.25-0.40 s, the rest
waits that the machine's load decides), and a median of 3 steps over 3 rounds moved by
half. The CPU ratio is the steady one there: adaptive 0.75-0.80 of the ceiling's.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from spikeguard.bench.runtime_ratios import ACTIONS, decision_cells, moved_of
from spikeguard.bench.spread import needed, spread

POLICIES = ("ceiling", "full", "adaptive")
HUGE = 1 << 40


def _model(ep: int):
    from spikeguard.integrations.hf_models import HFSizes, build_hf_model, distribute_hf_model
    sizes = HFSizes(d_model=128, d_expert=128, num_layers=4, seq_len=128)
    model = build_hf_model("qwen3_moe", sizes, seed=0)
    return model if ep == 1 else distribute_hf_model(model, ep, ep)


class _Clock:
    """A TrainerCallback: wall seconds of each optimizer step, and the device's peak."""

    def __init__(self, trainer):
        from transformers import TrainerCallback
        clock = self
        self.seconds, self.cpu_seconds, self.peak, self.reruns = [], [], 0, 0
        self.moved: dict = {}

        class _Callback(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                clock.start, clock.cpu_start = time.perf_counter(), time.process_time()

            def on_step_end(self, args, state, control, **kwargs):
                clock.seconds.append(time.perf_counter() - clock.start)
                clock.cpu_seconds.append(time.process_time() - clock.cpu_start)
                guard = getattr(trainer, "spikeguard", None)
                if guard is not None:
                    clock.peak = max(clock.peak, guard.meter.peak())
        self.callback = _Callback()


def train(policy: str, budget: int, steps: int, batch: int, ep: int, rank: int) -> _Clock:
    import transformers
    from spikeguard.integrations.hf_trainer import guard_trainer
    gen = torch.Generator().manual_seed(0)
    data = [{"input_ids": w, "labels": w}
            for w in torch.randint(0, 256, (steps * batch * ep, 129), generator=gen)]
    args = transformers.TrainingArguments(
        output_dir="/tmp/spikeguard_trainer_bench", max_steps=steps,
        per_device_train_batch_size=batch, report_to="none", save_strategy="no",
        logging_strategy="no", use_cpu=True, seed=0, disable_tqdm=True,
        **({"ddp_backend": "gloo"} if ep > 1 else {}))
    trainer = transformers.Trainer(model=_model(ep), args=args, train_dataset=data)
    if policy != "ceiling":
        guard_trainer(trainer, budget=budget, policy=policy)
    clock = _Clock(trainer)
    trainer.add_callback(clock.callback)
    trainer.train()
    guard = getattr(trainer, "spikeguard", None)
    if guard is not None:
        clock.reruns = sum(len(r["safety_net"]) for r in guard.history)
        clock.moved = moved_of(guard.history)
    return clock


def _world_max(value: int, ep: int) -> int:
    if ep == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return int(t.item())


def _group_steps(seconds: list[float], ep: int) -> list[float]:
    """Per step, the largest over the group's ranks (the group's step: see the doc)."""
    if ep == 1:
        return seconds
    t = torch.tensor(seconds, dtype=torch.float64)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return t.tolist()


def measure(reps: int, steps: int, batch: int, fraction: float, ep: int, rank: int) -> dict:
    ceiling_peak = _world_max(train("none", HUGE, 2, batch, ep, rank).peak, ep)
    budget = int(fraction * ceiling_peak)
    ratios = {p: [] for p in POLICIES if p != "ceiling"}
    cpu_ratios = {p: [] for p in ratios}
    peaks = {p: 0 for p in ratios}
    reruns = {p: 0 for p in ratios}
    moved = {p: [] for p in ratios}   # this rank's, per round
    for _ in range(reps):
        medians, cpu = {}, {}
        for policy in POLICIES:
            clock = train(policy, budget, steps, batch, ep, rank)
            medians[policy] = statistics.median(_group_steps(clock.seconds, ep)[1:])
            cpu[policy] = statistics.median(_group_steps(clock.cpu_seconds, ep)[1:])
            if policy in peaks:
                peaks[policy] = max(peaks[policy], _world_max(clock.peak, ep))
                reruns[policy] += clock.reruns
                moved[policy].append(clock.moved)
        for policy in ratios:
            ratios[policy].append(medians["ceiling"] / medians[policy])
            cpu_ratios[policy].append(cpu["ceiling"] / cpu[policy])
    return {"ceiling_peak": ceiling_peak, "budget": budget, "ratios": ratios,
            "cpu_ratios": cpu_ratios, "peaks": peaks, "reruns": reruns,
            "moved": {p: _summed(m) for p, m in moved.items()}}


def _summed(rounds: list[dict]) -> dict:
    """Decisions and evictions summed over the rounds (runtime_ratios.moved_of's fields)."""
    return {"decisions": {a: sum(m["decisions"][a] for m in rounds) for a in ACTIONS},
            **{k: sum(m[k] for m in rounds) for k in ("evicted_bytes", "prefetched_bytes")}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--fraction", type=float, default=0.85)
    parser.add_argument("--ep", type=int, default=1)
    a = parser.parse_args()
    if a.reps < 1 or a.steps < 2 or a.batch < 1 or not 0 < a.fraction <= 1 or a.ep < 1:
        parser.error("--reps >= 1, --steps >= 2, --batch >= 1, 0 < --fraction <= 1, --ep >= 1")
    torch.set_num_threads(1)
    if a.ep > 1:
        from spikeguard.parallel.launch_utils import run_under_torchrun
        # the Trainers and their models live in measure's frames: gone before the close
        run_under_torchrun(lambda group: _report(a, group.rank()))
    else:
        _report(a, 0)


def _report(a, rank: int) -> None:
    found = measure(a.reps, a.steps, a.batch, a.fraction, a.ep, rank)
    if rank == 0:
        layout = f", DistributedConfig(fsdp_size={a.ep}, ep_size={a.ep}), the group's steps" \
            if a.ep > 1 else ", one process"
        print(f"transformers Trainer, qwen3_moe 4 layers D=F=128{layout}; CPU, emulated device; "
              f"budget {a.fraction} x ceiling peak = {found['budget']} B; {a.reps} rounds")
        for policy, values in found["ratios"].items():
            wall, cpu = spread(values), spread(found["cpu_ratios"][policy])
            print(f"  {policy:9s} / ceiling  median {wall['median']:.3f}  "
                  f"(25-75%: {wall['q1']:.3f}-{wall['q3']:.3f})  cpu {cpu['median']:.3f} "
                  f"({cpu['q1']:.3f}-{cpu['q3']:.3f})  peak {found['peaks'][policy]} B "
                  f"<= budget: {found['peaks'][policy] <= found['budget']}  "
                  f"re-runs {found['reruns'][policy]}  rounds for +-0.01: {needed(wall)} "
                  f"(cpu {needed(cpu)})  save / recompute / offload "
                  + "  evicted ".join(decision_cells(found["moved"][policy])))
        print("  (per-round ratios; peak: the device's whole count, the optimizer step "
              "included: the guard's meter at each step's end; decisions and evictions: "
              "rank 0's, summed over every round's steps)")


if __name__ == "__main__":
    main()
