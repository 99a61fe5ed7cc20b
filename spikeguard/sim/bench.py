"""How fast the simulator is: issue 24 asks for 12,288 devices x 1,000 steps, all
policies, in under 5 s on this 2-core machine. A benchmark script, not a timed test.

    .venv/bin/python -m spikeguard.sim.bench --reps 3
    .venv/bin/python -m spikeguard.sim.bench --reps 3 --before /tmp/sim-before

Runs `simulate` on each published-scale preset at its 12,288 devices and 1,000 steps, all
seven policies, and prints the median wall time (and the median CPU time of the process,
which the other jobs on a shared machine move less) with the work it did (planner
decisions). Each run is a fresh process, so nothing one run remembers helps the next.
`--before DIR`: also time the code of DIR (a checkout of an earlier commit, e.g. `git
worktree add /tmp/sim-before 93685a4`), interleaved run by run with this checkout's, and
print both as a table with the ratio of the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# One timed run in a fresh process: simulate() only (imports excluded), wall and CPU.
_RUN = """
import json, sys, time
from spikeguard.plan.planner import Planner
from spikeguard.sim.config import load_config
from spikeguard.sim.engine import simulate
cfg = load_config(sys.argv[1], overrides={"workload.steps": int(sys.argv[2])})
calls, real = [0], Planner.decide
def counted(self, *args, **kwargs):
    calls[0] += 1
    return real(self, *args, **kwargs)
Planner.decide = counted
wall, cpu = time.perf_counter(), time.process_time()
simulate(cfg)
print(json.dumps({"wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu,
                  "decide_calls": calls[0], "devices": cfg.layout.devices}))
"""


def run_once(code: Path, preset: str, steps: int) -> dict:
    """One simulation of `preset` by the package under `code`, in its own process."""
    env = {**os.environ, "PYTHONPATH": str(code)}
    out = subprocess.run([sys.executable, "-c", _RUN, preset, str(steps)], env=env,
                         capture_output=True, text=True, check=True, cwd=code)
    return json.loads(out.stdout.strip().splitlines()[-1])


def time_preset(preset: str, steps: int, reps: int, before: Path | None = None) -> dict:
    """Medians over `reps` runs (interleaved with `before`'s when given)."""
    runs: dict = {"after": [], "before": []}
    for _ in range(reps):
        if before is not None:
            runs["before"].append(run_once(before, preset, steps))
        runs["after"].append(run_once(ROOT, preset, steps))
    out = {"preset": preset, "steps": steps}
    for which, rs in runs.items():
        if rs:
            out[which] = {"wall_s": [r["wall_s"] for r in rs], "cpu_s": [r["cpu_s"] for r in rs],
                          "decide_calls": rs[0]["decide_calls"], "devices": rs[0]["devices"]}
    return out


def _runs(values: list) -> str:
    return f"{statistics.median(values):.1f} ({', '.join(f'{v:.1f}' for v in values)})"


def _commit(code: Path) -> str:
    try:
        return subprocess.run(["git", "-C", str(code), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--presets", default="188b,500b,1t")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--before", default=None, metavar="DIR",
                        help="a checkout of an earlier commit to time against, interleaved")
    args = parser.parse_args(argv)
    if args.steps <= 0 or args.reps <= 0:
        parser.error("--steps and --reps must be positive")
    before = Path(args.before).resolve() if args.before else None
    if before is not None and not (before / "spikeguard" / "sim" / "engine.py").is_file():
        parser.error(f"--before {args.before}: not a spikeguard checkout")
    rows = [time_preset(p.strip(), args.steps, args.reps, before) for p in args.presets.split(",")]
    if before is None:
        for r in rows:
            a = r["after"]
            print(f"{r['preset']:5s} {a['devices']} devices x {r['steps']} steps, 7 policies: "
                  f"median {_runs(a['wall_s'])} s wall, {_runs(a['cpu_s'])} s CPU; "
                  f"{a['decide_calls']} Planner.decide calls per run")
        return 0
    print(f"| preset | before ({_commit(before)}): wall s | CPU s | after ({_commit(ROOT)}): "
          f"wall s | CPU s | after / before (wall, CPU) | Planner.decide calls |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        b, a = r["before"], r["after"]
        ratio_wall = statistics.median(a["wall_s"]) / statistics.median(b["wall_s"])
        ratio_cpu = statistics.median(a["cpu_s"]) / statistics.median(b["cpu_s"])
        print(f"| `{r['preset']}` ({a['devices']} devices x {r['steps']} steps, 7 policies) | "
              f"{_runs(b['wall_s'])} | {_runs(b['cpu_s'])} | {_runs(a['wall_s'])} | "
              f"{_runs(a['cpu_s'])} | {ratio_wall:.2f}, {ratio_cpu:.2f} | "
              f"{b['decide_calls']} / {a['decide_calls']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
