"""One torchrun rank of the FSDP2 byte-model sweep under transformers' own layout
(tests/integrations/test_integrations_hf_fsdp.py): `DistributedConfig(fsdp_size=2,
ep_size=2)`, a tiny Qwen3-MoE (hf_ep_worker.build), each rank its own data.

    .venv/bin/python -m torch.distributed.run --nproc-per-node 2 \
        tests/integrations/hf_fsdp_worker.py OUT_DIR

The all-saved (`none`) and full-recompute peaks (the worst rank's, the device's own
counter), then adaptive at budgets from just above full's peak to just under the
all-saved one, 4 steps each: per step, the gradients against the unguarded layout's,
the safety-net re-runs, the device's peak. Writes OUT_DIR/rank<r>.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

import spikeguard  # noqa: E402
from hf_ep_worker import HUGE, batches, build, differ, run, world_max  # noqa: E402

FRACTIONS, STEPS = (0.1, 0.5, 0.9), 4


def peaks(reference: dict) -> dict:
    out = {}
    for policy in ("none", "full"):
        model = build()
        guard = spikeguard.attach(model, budget=HUGE, policy=policy)
        assert not differ(reference, run(model, batches(), guard)), policy
        out[policy] = world_max(guard.meter.peak())
        guard.detach()
    return out


def sweep(reference: dict, peak: dict) -> list[dict]:
    out = []
    for fraction in FRACTIONS:
        budget = int(peak["full"] + fraction * (peak["none"] - peak["full"]))
        model = build()
        guard = spikeguard.attach(model, budget=budget, policy="adaptive")
        assert guard.layer_room.fsdp.active   # transformers' FSDP2 units were found
        for _ in range(STEPS):
            grads = run(model, batches(), guard)
            record = guard.history[-1]
            out.append({"fraction": fraction, "budget": budget, "differ": differ(reference, grads),
                        "reruns": len(record["safety_net"]), "peak": guard.meter.peak(),
                        "decisions": record["decisions"]})
        guard.detach()
    return out


if __name__ == "__main__":
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    reference = run(build(), batches())
    peak = peaks(reference)
    found = {"peaks": peak, "runs": sweep(reference, peak)}
    (Path(sys.argv[1]) / f"rank{dist.get_rank()}.json").write_text(json.dumps(found))
    dist.barrier()
    dist.destroy_process_group()
