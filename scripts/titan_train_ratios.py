"""Tokens/s through torchtitan's own entry point: adaptive and full vs the unguarded run.

    .venv/bin/python scripts/titan_train_ratios.py --rounds 5 --steps 30   # ~12 min here

Each job is `torchrun -m torchtitan.train` on the test's config registry
(tests/integrations/titan_train_job.py: the tiny deepseek_v3, torchtitan's FSDP2 on one
rank, its data loader; torchtitan's CPU shims), spikeguard on only through the config.
Settings, interleaved in every round: the unguarded Trainer (the ceiling), `none` (the
guard, no budget that bites), `full` and `adaptive` at the budget halfway between full
recompute's and the all-kept true peak (the independent meter's, measured first). A
job's figure is the median of torchtitan's own `tps` over its steps after the first 3;
a round's ratio is a setting's figure over the ceiling's of that round; printed: the
median over rounds and the min-max. CPU, emulated device: read the ratios as shares of a
CPU step, not as GPU figures.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "integrations"))

from titan_train_job import make_assets, run_job  # noqa: E402

SETTINGS = ("ceiling", "none", "full", "adaptive")
WARMUP_STEPS = 3
NO_BUDGET = "1GiB"


def _tps(output: str) -> float:
    plain = re.sub(r"\x1b\[[0-9;]*m", "", output)
    values = [float(v.replace(",", "")) for v in re.findall(r"tps: ([\d,]+)", plain)]
    if len(values) <= WARMUP_STEPS:
        raise SystemExit(f"a job logged {len(values)} steps; see its output:\n{output[-3000:]}")
    return statistics.median(values[WARMUP_STEPS:])


def _job(assets, work: Path, setting: str, budget: str, steps: int):
    options = ["--training.steps", str(steps)]
    if setting == "ceiling":
        return run_job(assets, work, *options, config="tiny_deepseek", timeout_s=600)
    if setting == "none":   # the guard's bookkeeping alone: a budget that never bites
        budget = NO_BUDGET
    return run_job(assets, work, *options, "--spikeguard.policy", setting,
                   "--spikeguard.budget", budget, timeout_s=600)


def _budget(assets, root: Path) -> int:
    peaks = {}
    for policy in ("none", "full"):
        job = run_job(assets, root / f"probe_{policy}", "--spikeguard.policy", policy,
                      "--spikeguard.budget", NO_BUDGET)
        if job.returncode != 0:
            raise SystemExit(job.output[-3000:])
        peaks[policy] = job.peak()
    return (peaks["none"] + peaks["full"]) // 2


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.steps <= WARMUP_STEPS:
        parser.error(f"--rounds >= 1 and --steps > {WARMUP_STEPS}")
    root = Path(tempfile.mkdtemp(prefix="titan_ratios_"))
    assets = make_assets(root)
    budget = _budget(assets, root)
    ratios = {s: [] for s in SETTINGS[1:]}
    for r in range(args.rounds):
        tps = {s: _tps(_job(assets, root / f"r{r}_{s}", s, str(budget), args.steps).output)
               for s in SETTINGS}
        for s in SETTINGS[1:]:
            ratios[s].append(tps[s] / tps["ceiling"])
        print(f"round {r}: " + "  ".join(f"{s} {v:,.0f} tok/s" for s, v in tps.items()),
              flush=True)
    print(f"\nbudget {budget} B ({budget / 2**20:.2f} MiB); {args.rounds} rounds, "
          f"{args.steps} steps a job; CPU, emulated device")
    print("| setting | tokens/s vs ceiling: median (min-max) |\n|---|---|")
    print("| ceiling: torchtitan's Trainer, no spikeguard | 1.000 |")
    for s in SETTINGS[1:]:
        v = ratios[s]
        print(f"| `{s}` | {statistics.median(v):.3f} ({min(v):.3f}-{max(v):.3f}) |")


if __name__ == "__main__":
    main()
