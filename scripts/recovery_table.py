"""The recovery table of docs/recovery.md: one rank refused by the device, what every rank
then reaches, measured by the independent meter (tests/meter.py), not by spikeguard.

    .venv/bin/python scripts/recovery_table.py            # prints the markdown table (~6 min)

Scenarios (the same spawned workers as the tests, gloo on CPU, the emulated device that
refuses at its limit as CUDA does):
- EP=2 backward: rank 0's prevention blinded under a budget between its forward and
  backward peaks (tests/parallel/true_device_workers.py, forced_backward_oom_worker);
- EP=2 forward: rank 1's, between full recompute's step peak and the all-saved forward
  peak (forced_forward_oom_worker);
- PP=2 x EP=2 warm-up forward: rank 0 (stage 0), an allocation no plan foresees in
  micro-batch 1's forward; backward: rank 2 (stage 1), one in micro-batch 1's backward
  (tests/parallel/pp_workers.py, "squeeze" and "squeeze_backward"), at a budget halfway
  between full recompute's and the all-saved peak.
For tiny and small. Each cell: the meter's true peak / the rank's budget, the re-runs
(micro-batch nets, step-level), whether the gradients are bitwise the uninterrupted job's.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "parallel"))

from spikeguard.parallel.launch_utils import run_spawned  # noqa: E402

MiB = 1 << 20


def _ep_rows(preset: str) -> list[str]:
    os.environ["SPIKEGUARD_TABLE_PRESET"] = preset
    import true_device_workers as workers

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        run_spawned(workers.forced_backward_oom_worker, 2, (str(out), 0),
                    store_path=out / "store1", timeout_s=600)
        run_spawned(workers.forced_forward_oom_worker, 2, (str(out), 1),
                    store_path=out / "store2", timeout_s=600)
        for scenario, ceiling, refused in (("forced", "ceiling", 0),
                                           ("fwd_forced", "fwd_ceiling", 1)):
            cells = []
            for rank in range(2):
                got = torch.load(out / f"{scenario}_rank{rank}.pt", weights_only=False)
                ref = torch.load(out / f"{ceiling}_rank{rank}.pt", weights_only=False)
                equal = all(torch.equal(ref["grads"][n], got["grads"][n]) for n in ref["grads"])
                cells.append(_cell(got["meter_peak"], got["budget"], got["record"], equal))
            where = "backward" if scenario == "forced" else "forward"
            rows.append(f"| {preset} | EP=2 | rank {refused}, {where} | " + " | ".join(cells)
                        + " | – | – |")
    return rows


def _pp_rows(preset: str) -> list[str]:
    import pp_workers

    cfg = {"preset": preset, "num_layers": 4, "num_experts": 8, "seq_len": 64}
    scenarios = [
        {"name": "plain", "policy": "plain", "budget": 1 << 40},
        {"name": "calm", "policy": "none", "budget": 1 << 40, "calm": True},
        {"name": "full", "policy": "full", "budget": 1 << 40},
        {"name": "sq_fwd", "policy": "adaptive", "budget": "range*0.5", "squeeze": (1, 1),
         "meter": True},
        {"name": "sq_bwd", "policy": "adaptive", "budget": "range*0.5",
         "squeeze_backward": (2, 1), "meter": True},
    ]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        run_spawned(pp_workers.pp_worker, 4,
                    (str(out), 4, 2, [{"prefix": "", "pp": 2, "ep": 2, "cfg": cfg,
                                       "scenarios": scenarios}]),
                    store_path=out / "store", timeout_s=900)
        for name, what in (("sq_fwd", "rank 0 (stage 0), warm-up forward"),
                           ("sq_bwd", "rank 2 (stage 1), backward")):
            cells = []
            for rank in range(4):
                got = torch.load(out / f"{name}_rank{rank}.pt", weights_only=False)
                ref = torch.load(out / f"plain_rank{rank}.pt", weights_only=False)
                equal = all(torch.equal(ref["grads"][n][0], got["grads"][n][0])
                            for n in ref["grads"])
                record = got["records"][0]
                cells.append(_cell(got["meter_peak"], record["budget_bytes"], record, equal))
            rows.append(f"| {preset} | PP=2 x EP=2 | {what} | " + " | ".join(cells) + " |")
    return rows


def _cell(peak: int, budget: int, record: dict, equal: bool) -> str:
    steps = sum(1 for r in record["safety_net"] if r["scope"] == "step")
    nets = record["safety_net_reruns"] - steps
    budget_text = "no limit" if budget >= 1 << 39 else f"{budget / MiB:.2f}"
    ratio = "" if budget >= 1 << 39 else f" ({peak / budget:.3f})"
    return (f"{peak / MiB:.2f} / {budget_text}{ratio}, {nets} mb + {steps} step, "
            f"{'bitwise' if equal else 'DIFFERENT'}")


def main() -> int:
    print("| model | layout | refused | rank 0 | rank 1 | rank 2 | rank 3 |")
    print("|---|---|---|---|---|---|---|")
    for preset in ("tiny", "small"):
        for row in _ep_rows(preset) + _pp_rows(preset):
            print(row, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
