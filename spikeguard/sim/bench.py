"""How fast the simulator is: issue 7 asks for 12,288 devices x 1,000 steps in under 60 s
on this 2-core machine. A benchmark script, not a timed test.

    .venv/bin/python -m spikeguard.sim.bench --reps 3

Runs `simulate` on each published-scale preset at its 12,288 devices and 1,000 steps, all
seven policies, and prints the median wall time with the work it did (walks of a stage
under one load, and planner decisions).
"""

from __future__ import annotations

import argparse
import statistics
import time

from spikeguard.plan.planner import Planner
from spikeguard.sim.config import load_config
from spikeguard.sim.engine import simulate


def time_preset(preset: str, steps: int, reps: int) -> dict:
    cfg = load_config(preset, overrides={"workload.steps": steps})
    calls = [0]
    real = Planner.decide

    def counted(self, *args, **kwargs):
        calls[0] += 1
        return real(self, *args, **kwargs)

    seconds = []
    for _ in range(reps):
        calls[0] = 0
        Planner.decide = counted
        try:
            start = time.perf_counter()
            simulate(cfg)
            seconds.append(time.perf_counter() - start)
        finally:
            Planner.decide = real
    return {"preset": preset, "devices": cfg.layout.devices, "steps": steps,
            "median_s": statistics.median(seconds), "runs_s": seconds, "decide_calls": calls[0]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--presets", default="188b,500b,1t")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args(argv)
    for preset in args.presets.split(","):
        r = time_preset(preset.strip(), args.steps, args.reps)
        print(f"{r['preset']:5s} {r['devices']} devices x {r['steps']} steps, 7 policies: "
              f"median {r['median_s']:.1f} s (runs {', '.join(f'{s:.1f}' for s in r['runs_s'])}); "
              f"{r['decide_calls']} Planner.decide calls per run")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
