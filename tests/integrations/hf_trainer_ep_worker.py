"""One torchrun rank of transformers' `Trainer` under `DistributedConfig(fsdp_size=2,
ep_size=2)` with and without spikeguard (tests/integrations/test_integrations_hf_trainer_ep.py).

    .venv/bin/python -m torch.distributed.run --nproc-per-node 2 \
        tests/integrations/hf_trainer_ep_worker.py OUT_DIR CASE [BUDGET [ACCUMULATION]]

CASE: `plain` (no guard), `none`, `full`, `adaptive`, `blind` (adaptive with a forecast
blind to what is still to come, so a backward runs out and the step-level net re-runs it on
every rank together). ACCUMULATION: the Trainer's gradient_accumulation_steps (the same 4
sequences a rank and step, in that many micro-batches). Writes OUT_DIR/CASE_rank<r>.json:
the history's peaks and re-runs, the device's own peak and the fallback votes gathered per
step, the gradients copied to host, and a digest of the parameters after 3 steps; or the
one-line error.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from hf_ep_worker import build, count_votes  # noqa: E402

STEPS, BATCH, SEQ = 3, 4, 33


class DevicePeaks:
    """A TrainerCallback, after the guard's: the device's own peak counter at each step's
    end (the emulated allocator's, not the guard's ledger or history), and the
    whole-layer fallback votes gathered in each step (FamilyAgreement.vote's all-gathers)."""

    def __init__(self, trainer):
        from transformers import TrainerCallback
        self.trainer, self.peaks, self.votes = trainer, [], []
        outer = self

        class _Callback(TrainerCallback):
            def on_train_begin(self, args, state, control, **kwargs):
                guard = getattr(outer.trainer, "spikeguard", None)
                if guard is not None and CASE == "blind":
                    blind(guard)
                if guard is not None and guard.layers.agreement is not None:
                    count_votes(guard.layers.agreement, outer.votes)

            def on_step_begin(self, args, state, control, **kwargs):
                outer.votes.append(0)

            def on_step_end(self, args, state, control, **kwargs):
                guard = getattr(outer.trainer, "spikeguard", None)
                if guard is not None:
                    outer.peaks.append(guard.meter.peak())
        self.callback = _Callback()



def blind(guard) -> None:
    """The forecast blind to what is still to come (as the one-process Trainer test), and
    the cost model's default rates, frozen (plan/cost_rates.py): the plans, hence whether
    and where a backward runs out, the same from run to run (timed rates once ranked an
    offload below a recompute on a loaded machine: no step ran out, at accumulation 2)."""
    from spikeguard.plan.cost import CostModel
    from spikeguard.plan.cost_rates import rates_of, use_rates
    use_rates(guard.cost, rates_of(CostModel()))
    guard.forecast.still_to_come = lambda *a, **k: 0
    guard.forecast.head_bytes_per_token = 0.0
    guard.forecast.observe = lambda *a, **k: None
    guard.layer_room.room = dataclasses.replace(
        guard.layer_room.room, expert_grad_bytes=0, expert_grad_sum_bytes=0)


def train(out_dir: Path, budget) -> dict:
    import transformers
    from spikeguard.integrations.hf_trainer import guard_trainer
    from spikeguard.runtime import device_state
    copies, copy = [], device_state._host_copy   # gradients copied to host, counted
    device_state._host_copy = lambda t: copies.append(t.numel()) or copy(t)
    gen = torch.Generator().manual_seed(0)
    data = [{"input_ids": w, "labels": w}
            for w in torch.randint(0, 256, (STEPS * BATCH * 2, SEQ), generator=gen)]
    args = transformers.TrainingArguments(
        output_dir=str(out_dir / "trainer"), max_steps=STEPS,
        per_device_train_batch_size=BATCH // ACCUM, gradient_accumulation_steps=ACCUM,
        learning_rate=1e-3, report_to="none", save_strategy="no", logging_strategy="no",
        use_cpu=True, seed=0, disable_tqdm=True, ddp_backend="gloo")
    model = build()
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
    if CASE != "plain":
        guard_trainer(trainer, budget=budget, policy="adaptive" if CASE == "blind" else CASE)
    peaks = DevicePeaks(trainer)
    trainer.add_callback(peaks.callback)
    loss = trainer.train().training_loss
    digest = [float(p.to_local().double().sum()) for p in model.parameters()]
    params = {n: p.to_local().detach().clone() for n, p in model.named_parameters()}
    torch.save(params, out_dir / f"{CASE}_params_rank{dist.get_rank()}.pt")
    out = {"digest": digest, "device_peaks": peaks.peaks, "votes": peaks.votes, "loss": loss,
           "grad_copies": len(copies)}
    if CASE != "plain":
        history = trainer.spikeguard.history
        out.update(peaks=[r["peak_bytes"] for r in history],
                   reruns=[[n["scope"] + ": " + n["reason"] for n in r["safety_net"]]
                           for r in history],
                   decisions=[r["decisions"] for r in history])
    return out


if __name__ == "__main__":
    OUT, CASE = Path(sys.argv[1]), sys.argv[2]
    BUDGET = int(sys.argv[3]) if len(sys.argv) > 3 else 1 << 40
    ACCUM = int(sys.argv[4]) if len(sys.argv) > 4 else 1
    torch.set_num_threads(1)
    try:
        found = train(OUT, BUDGET)
    except Exception as err:   # noqa: BLE001  written for the test, as a job's last line
        found = {"error": f"{type(err).__name__}: {err}"}
        (OUT / f"{CASE}_rank{int(os.environ['RANK'])}.json").write_text(json.dumps(found))
        sys.stdout.flush()
        os._exit(3)
    (OUT / f"{CASE}_rank{dist.get_rank()}.json").write_text(json.dumps(found))
