"""GPU check of the runtime: bitwise gradients, a real OOM for "none", ratios. < 5 minutes.

    .venv/bin/python scripts/gpu_check.py            # on a CUDA machine
    .venv/bin/python scripts/gpu_check.py --device cpu   # same logic, emulated budget

On CUDA it makes a smaller device with `torch.cuda.set_per_process_memory_fraction` so
that calm micro-batches fit with everything saved and a spike micro-batch (twice the
tokens) does not; "none" must then die of a real `torch.cuda.OutOfMemoryError`, and
"adaptive" must finish under the limit. Prints one line per check and the throughput
ratios adaptive/ceiling and full/ceiling (medians of interleaved runs).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

import spikeguard
from spikeguard.model import build_model, model_config

POLICIES = ("none", "full", "experts", "offload", "adaptive")


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def batches(cfg, device, sizes, seed=0):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for b in sizes:
        idx = torch.randint(0, cfg.vocab_size, (b, cfg.seq_len + 1), generator=gen)
        out.append((idx[:, :-1].to(device), idx[:, 1:].to(device)))
    return out


def run_step(model, data, guard=None):
    model.zero_grad(set_to_none=True)
    sync(next(model.parameters()).device)
    start = time.perf_counter()
    ctx = guard.step() if guard else _null()
    with ctx:
        for idx, tgt in data:
            model(idx, tgt).loss.backward()
    sync(next(model.parameters()).device)
    return time.perf_counter() - start


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def check_bitwise(cfg, device, data) -> bool:
    ref = build_model(cfg, seed=1).to(device)
    run_step(ref, data)
    ok = True
    for policy in POLICIES:
        model = build_model(cfg, seed=1).to(device)
        guard = spikeguard.attach(model, budget=1 << 50, policy=policy)
        run_step(model, data, guard)
        same = all(torch.equal(a.grad, b.grad) for a, b in zip(ref.parameters(), model.parameters()))
        print(f"bitwise gradients {policy:9s}: {'equal' if same else 'DIFFERENT'}")
        ok &= same
        guard.detach()
    return ok


def peak_of(cfg, device, data) -> int:
    model = build_model(cfg, seed=1).to(device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        run_step(model, data)
        return torch.cuda.max_memory_allocated(device)
    guard = spikeguard.attach(model, budget=1 << 50, policy="none")
    run_step(model, data, guard)
    return guard.history[-1]["peak_bytes"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="spikeguard GPU check")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--preset", default="medium")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; run it on a CUDA machine (or --device cpu)")
        return 0
    device = torch.device(args.device)
    cfg = model_config(args.preset)
    calm = batches(cfg, device, [args.batch, args.batch])
    spike = batches(cfg, device, [args.batch, 2 * args.batch], seed=1)
    print(f"device {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}, "
          f"preset {args.preset}, torch {torch.__version__}")
    ok = check_bitwise(cfg, device, calm)

    calm_peak, spike_peak = peak_of(cfg, device, calm), peak_of(cfg, device, spike)
    limit = int(calm_peak + 0.5 * (spike_peak - calm_peak))  # calm fits, the spike does not
    print(f"peak calm {calm_peak / 2**20:.1f} MiB, spike {spike_peak / 2**20:.1f} MiB, "
          f"limit {limit / 2**20:.1f} MiB")
    if device.type == "cuda":
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(limit / total, device)
    budget = limit

    model = build_model(cfg, seed=1).to(device)
    guard = spikeguard.attach(model, budget=budget, policy="none")
    try:
        run_step(model, spike, guard)
        print("none on the spike: no out-of-memory (UNEXPECTED)")
        ok = False
    except (spikeguard.DeviceOutOfMemory, torch.OutOfMemoryError) as err:
        print(f"none on the spike: out of memory, as a real job would die ({type(err).__name__})")
    guard.detach()
    del model, guard
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)

    models = {p: build_model(cfg, seed=1).to(device) for p in ("ceiling", "full", "adaptive")}
    guards = {p: spikeguard.attach(models[p], budget=budget, policy=p) for p in ("full", "adaptive")}
    times = {p: [] for p in models}
    for rep in range(args.reps + 1):
        for p, m in models.items():
            if p == "ceiling" and device.type == "cuda":
                continue  # the ceiling has no limit: timed after lifting it
            seconds = run_step(m, spike, guards.get(p))
            if rep:
                times[p].append(seconds)
    adaptive_hist = guards["adaptive"].history
    worst = max(h["peak_bytes"] for h in adaptive_hist)
    under = worst <= limit
    print(f"adaptive on the spike: peak {worst / 2**20:.1f} MiB <= limit: {under}, "
          f"decisions {adaptive_hist[-1]['decisions']}, "
          f"safety-net reruns {sum(h['safety_net_reruns'] for h in adaptive_hist)}")
    ok &= under
    if device.type == "cuda":
        torch.cuda.set_per_process_memory_fraction(1.0, device)
        for rep in range(args.reps + 1):
            seconds = run_step(models["ceiling"], spike)
            if rep:
                times["ceiling"].append(seconds)
    med = {p: statistics.median(t) for p, t in times.items()}
    print(f"throughput vs ceiling: adaptive {med['ceiling'] / med['adaptive']:.3f}, "
          f"full {med['ceiling'] / med['full']:.3f} (medians of {args.reps})")
    print("gpu_check: PASS" if ok else "gpu_check: FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
