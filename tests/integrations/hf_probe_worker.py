"""One torchrun rank of the calm-peak probe's check under transformers' own layout
(tests/integrations/test_integrations_hf_probe.py): `DistributedConfig(fsdp_size=2,
ep_size=2)`, the `--hf qwen3_moe` run's default sizes, the probe's micro-batch drawn from
the default corpus as `spikeguard train` draws it (seed 0, rank r).

    .venv/bin/python -m torch.distributed.run --nproc-per-node 2 \
        tests/integrations/hf_probe_worker.py OUT_DIR

Writes OUT_DIR/rank<r>.json: the probe's figure (the worst rank's), then for the
learning rate of a run (3e-3) and for 0 (the weights never move): each of two real
steps' whole peak (engine.step under policy none, no limit), the rows this rank's
experts received per layer, and the AdamW state's bytes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import spikeguard
from spikeguard.data.corpus import load_corpus
from spikeguard.integrations.hf_models import HFSizes, build_hf_model, distribute_hf_model
from spikeguard.memory.static import optimizer_state_bytes
from spikeguard.parallel.mesh import MeshGroups, ParallelLayout
from spikeguard.train.auto_budget import calm_peak_bytes
from spikeguard.train.engines import LocalEngine
from spikeguard.train.families import HFFamily
from spikeguard.train.run import AUTO_PROBE_SEED
from spikeguard.train.train_config import TrainConfig, make_optimizer

SIZES = HFSizes()


def engine(groups, lr: float) -> LocalEngine:
    model = distribute_hf_model(build_hf_model("qwen3_moe", SIZES, seed=0), 2, 2)
    out = LocalEngine(model, HFFamily, groups, grad_clip=1.0)
    out.build_optimizers(lambda m: make_optimizer(m, TrainConfig()))
    for group in out.optimizers[0].param_groups:   # 0: AdamW leaves every weight as it is
        group["lr"] = lr
    return out


def real_steps(eng: LocalEngine, batches) -> list[dict]:
    eng.attach_guards(lambda m, o: spikeguard.attach(m, budget="1TiB", policy="none",
                                                     optimizer=o))
    guard, out = eng.guards[0], []
    for _ in range(2):
        eng.step(batches)
        out.append({"peak": max(guard.history[-1]["peak_bytes"], guard.meter.peak()),
                    "received": guard.history[-1]["received_per_layer"],
                    "state": optimizer_state_bytes(eng.model, eng.optimizers[0])[1]})
    return out


if __name__ == "__main__":
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    groups = MeshGroups.build(ParallelLayout(nproc=2, ep=2))
    gen = torch.Generator().manual_seed(0 + AUTO_PROBE_SEED + rank)
    batches = [HFFamily.draw(load_corpus(None), "train", 8, SIZES.seq_len, gen)]
    probed = engine(groups, 3e-3)
    found = {"probe": calm_peak_bytes(probed, batches, group=dist.group.WORLD)[0],
             "after_probe": real_steps(probed, batches),
             "run": real_steps(engine(groups, 3e-3), batches),
             "lr0": real_steps(engine(groups, 0.0), batches)}
    (Path(sys.argv[1]) / f"rank{rank}.json").write_text(json.dumps(found))
    dist.barrier()
    dist.destroy_process_group()
