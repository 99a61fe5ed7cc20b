"""The simulator against the runtime on 4 processes, PP=2 x EP=2 (CPU, emulated device),
`small` model: each rank's device peak per step against the simulator replaying the loads
those ranks logged, every policy. One part of spikeguard.sim.validate (its `--pp-ep`);
tests/sim/test_sim_validation.py holds the static policies within 5%, adaptive within 5%
where its plans are the model's and under its budget everywhere (that test says why).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Optional

import torch

from spikeguard.sim.config import load_config


def _rank_logs(folder: Path) -> list[list[dict]]:
    logs = [folder / "run.jsonl"] + sorted(folder.glob("run.rank*.jsonl"))
    return [[json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            for path in logs]


def _trace_from_logs(ranks: list[list[dict]], path: Path, *, layers_per_stage: int,
                     num_experts: int, top_k: int, ep: int, micro_batches: int,
                     tokens: int) -> None:
    """A trace (spikeguard.routing.trace format) of what each rank's log says it received per
    (micro-batch, layer): `train --pp` records no trace yet, but its logs carry exactly the
    per-rank loads the simulator uses. Each rank's count is spread over its experts."""
    from spikeguard.routing.trace import TraceWriter, make_header

    pp = 1 + max(r[0]["coords"]["pp"] for r in ranks)
    per_rank = num_experts // ep
    writer = TraceWriter(path, make_header(num_layers=pp * layers_per_stage, num_experts=num_experts,
                                           top_k=top_k, ep=ep, micro_batches=micro_batches,
                                           tokens_per_micro_batch=tokens), overwrite=True)
    for step in range(len(ranks[0])):
        counts = [[[0] * num_experts for _ in range(pp * layers_per_stage)]
                  for _ in range(micro_batches)]
        for records in ranks:
            rec = records[step]
            r = rec["coords"]["ep"]
            if rec["coords"]["dp"]:
                continue
            for item in rec["routing"]:
                layer = item["layer"]   # the logs number layers globally
                share, extra = divmod(item["received"], per_rank)
                for j in range(per_rank):
                    counts[item["micro_batch"]][layer][r * per_rank + j] = share + (j < extra)
        writer.write_step(step + 1, counts)
    writer.close()


PRESET, EP = "small", 2   # the model and expert-parallel size of the 4 processes (PP=2)
PP_EP_POLICIES = (("none", "1GiB"), ("offload", "1GiB"), ("experts", "1GiB"), ("full", "1GiB"),
                  ("adaptive", "tight"))


def compare_pp_ep(policies=PP_EP_POLICIES, steps: int = 3, micro_batches: int = 4,
                  batch_size: int = 8, folder: Optional[str] = None, timeout_s: int = 600,
                  pool=None) -> dict:
    """4 processes, PP=2 x EP=2 (`spikeguard train --nproc 4 --pp 2 --ep 2`, production skew
    with frequent spikes): each rank's device peak per step against the simulator replaying
    the loads those ranks logged. "tight" is 0.9x the worst peak `none` reached.

    `pool`: something with spikeguard.bench.worker.WorkerPool's `run(argv, out, err,
    timeout_s) -> (exit code, ...)`, to run every policy on one reused worker (one torchrun
    start-up for all; a static policy under 1 GiB never runs out, so it lives to the end).
    The simulator's room comes before bench's and cannot import it: the caller (the test,
    `main`) hands it in. None: one `spikeguard train` process tree per policy."""
    from spikeguard.model.config import model_config
    from spikeguard.plan.catalogue import ExpertShape
    from spikeguard.plan.cost import CostModel
    from spikeguard.plan.cost_rates import write_rates

    tmp = tempfile.TemporaryDirectory() if folder is None else None
    root = Path(folder or tmp.name)
    model = model_config(PRESET)
    # One set of rates for the simulator and every rank, frozen: the ranks' plans are then
    # the simulator's to check, the planning stage's included (no rank times its own).
    cost = CostModel()
    cost.calibrate(ExpertShape(d_model=model.d_model, d_expert=model.d_expert),
                   model.num_experts // EP, torch.device("cpu"))
    rates = root / "cost_rates.json"
    write_rates(cost.freeze(), rates, overwrite=True)
    out: dict = {"policies": {}}
    worst_none = None
    try:
        for policy, budget in policies:
            if budget == "tight":
                budget = str(int(0.9 * worst_none))
            run_dir = root / policy
            run_dir.mkdir(parents=True, exist_ok=True)
            argv = ["train", "--preset", PRESET, "--nproc", "4", "--pp", "2", "--ep", str(EP),
                    "--steps", str(steps), "--batch-size", str(batch_size), "--micro-batches",
                    str(micro_batches), "--skew", "production", "--spike-prob", "0.5",
                    "--spike-max", "2", "--budget", budget, "--policy", policy, "--log",
                    str(run_dir / "run.jsonl"), "--threads", "1", "--eval-every", "1000",
                    "--cost-rates", str(rates)]
            code = _run_train(pool, argv, run_dir, timeout_s)
            if code:
                err = (run_dir / "train.err").read_text(errors="replace")
                raise RuntimeError(f"{policy}: train exited {code}: {err[-800:]}")
            measured, ranks, exchanged = _pp_ep_measured(run_dir, steps, micro_batches,
                                                         batch_size, model)
            if policy == "none":
                worst_none = max(max(row) for row in measured)
            sim = _pp_ep_simulated(policy, budget, steps, micro_batches, batch_size,
                                   run_dir / "loads.trace.jsonl", cost)
            out["policies"][policy] = {"budget": budget, "measured": measured,
                                       "exchanged_bytes": exchanged,
                                       "predicted": sim.peak_stage_step.tolist(),
                                       "sim_crashes": sim.crashes,
                                       "runtime_decisions": [r[-1]["guards"][0]["decisions"] for r in ranks],
                                       # per step, the most safety-net re-runs of a rank:
                                       # a re-run step's peak is the net's (full recompute)
                                       "runtime_reruns": [
                                           max(r[step]["guards"][0].get("safety_net_reruns", 0)
                                               for r in ranks) for step in range(steps)],
                                       "sim_decisions": dict(sim.decisions)}
    finally:
        if tmp is not None:
            tmp.cleanup()
    return out


def _run_train(pool, argv: list[str], run_dir: Path, timeout_s: int) -> int:
    """`spikeguard <argv>` on the pool's worker, or as its own process tree; its exit code,
    its output in run_dir/train.out and train.err."""
    import subprocess
    import sys

    out, err = run_dir / "train.out", run_dir / "train.err"
    if pool is not None:
        return pool.run(argv, out, err, timeout_s)[0]
    with open(out, "w") as out_f, open(err, "w") as err_f:
        return subprocess.run([sys.executable, "-m", "spikeguard", *argv], stdout=out_f,
                              stderr=err_f, timeout=timeout_s).returncode


def _pp_ep_measured(run_dir: Path, steps: int, micro_batches: int, batch_size: int, model):
    """The worst rank's device peak per step and stage; the largest all-to-all of each
    (rows sent and received by one layer of one micro-batch, D x b each: what gloo may
    still hold at a peak, which the simulator takes as freed); and the loads the ranks
    logged, written as a trace beside them (loads.trace.jsonl)."""
    ranks = _rank_logs(run_dir)
    tokens, top_k, row_bytes = batch_size * model.seq_len, model.top_k, model.d_model * 4
    _trace_from_logs(ranks, run_dir / "loads.trace.jsonl",
                     layers_per_stage=model.num_layers // 2, num_experts=model.num_experts,
                     top_k=top_k, ep=EP, micro_batches=micro_batches, tokens=tokens)
    measured = [[0, 0] for _ in range(steps)]
    exchanged = [[0, 0] for _ in range(steps)]
    for records in ranks:
        for step, rec in enumerate(records):
            stage = rec["coords"]["pp"]
            measured[step][stage] = max(measured[step][stage], rec["guards"][0]["peak_bytes"])
            rows = max((tokens * top_k + item["received"] for item in rec["routing"]), default=0)
            exchanged[step][stage] = max(exchanged[step][stage], rows * row_bytes)
    return measured, ranks, exchanged


def _pp_ep_simulated(policy: str, budget: str, steps: int, micro_batches: int, batch_size: int,
                     trace: Path, cost):
    from spikeguard.sim.engine import simulate

    cfg = load_config(PRESET, overrides={
        "layout.devices": 4, "layout.pp": 2, "layout.ep": 2,
        "layout.micro_batch_size": batch_size,
        "layout.global_batch": batch_size * micro_batches * 2,
        "training.optimizer_bytes": 8, "training.distributed_optimizer": False,
        "device.capacity_bytes": int(budget) if budget.isdigit() else 1 << 30,
        "workload.steps": steps, "workload.trace": str(trace),
        "run.policies": [policy]})
    return simulate(cfg, cost=cost).policies[policy]
