"""torchtitan's deepseek_v3 under torchtitan's own FSDP2: adaptive between full recompute's
peak and the all-saved peak, every step, no safety-net re-run, bitwise.

FSDP2's gathered parameters, its backward prefetch and reduce-scatter buffers are in the
byte model (spikeguard/plan/fsdp_bytes.py, read from each unit's FSDPParamGroup by
spikeguard/runtime/fsdp.py). Shown on one rank (torchtitan applies FSDP2 there too) and
on 2 spawned gloo ranks, FSDP over both and FSDP with torchtitan's EP=2:
  * gradients `torch.equal` to the unguarded model's in the same layout, every step;
  * at budgets from just above full's peak (0.05 of the way) to just under the all-saved
    peak, 4 steps of adaptive, the first one uncalibrated: no safety-net re-run, the
    device's own peak counter (the emulated allocator's, not the guard's ledger) under
    the budget on every rank;
  * under EP, a budget below full recompute's own peak, which no plan meets, ends every
    rank in the one agreed line (JobEnds), within the spawn's deadline: never a hang;
  * with the FSDP2 terms taken out of the byte model (what it was before), the same
    budget runs out in backward and the net re-runs the step: with FSDP2's iteration state
    reset after the abandoned attempt, the re-run fits, bitwise.

    .venv/bin/python -m pytest tests/integrations/test_integrations_titan_fsdp.py -q
"""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("torchtitan")

from spikeguard.parallel.launch_utils import close_gloo, init_gloo, run_spawned  # noqa: E402

pytestmark = [pytest.mark.timeout(300), pytest.mark.filterwarnings("ignore:In CPU autocast"),
              pytest.mark.filterwarnings("ignore:FSDP2-wrapped module")]

# Of the way from full's peak to the all-saved one. Under torchtitan's EP the first step
# (slopes still the shapes') found no plan at layer 0 at 0.05-0.1 (11-73 KiB short of
# ~1.7 MiB) while the head's FSDP2 phase was counted on top of its loss phase
# (plan/fsdp_bytes.py: they are not alive at once); a refusal there cannot be settled
# under torchtitan's EP, so the job ended. Now 0.0 (full's own peak) passes too; 0.05
# is the floor tested. 1.5: above the all-saved peak, where calm forwards run.
FRACTIONS = (0.05, 0.5, 0.9, 1.5)
STEPS = 4


def _peak(guard) -> int:
    """The step's peak on the device's own counter, the largest over the group's ranks."""
    peak = torch.tensor([guard.meter.peak()])
    if torch.distributed.get_world_size() > 1:
        torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX)
    return int(peak.item())


def _policy_peaks(model, data, reference) -> dict:
    import spikeguard
    from titan_helpers import HUGE, bitwise, step
    peaks = {}
    for policy in ("none", "full"):
        guard = spikeguard.attach(model, budget=HUGE, policy=policy)
        assert bitwise(reference, step(model, data, guard)), policy
        assert bitwise(reference, step(model, data, guard)), policy
        if policy == "none":   # its second step's forwards ran calm, FSDP2 units and all
            assert guard.history[-1]["calm_forwards"] == len(data), guard.history
        peaks[policy] = _peak(guard)
        guard.detach()
    return peaks


def _adaptive_runs(model, data, reference, peaks, fractions=FRACTIONS) -> list[dict]:
    """4 steps of adaptive at each budget: per step, bitwise, re-runs, peak, budget; above
    the all-saved peak, where forwards run calm, the last step's peak by the independent
    meter too (tests/meter.py: the local shards of the model's state as its baseline)."""
    import spikeguard
    from host_marks import metered
    from titan_helpers import bitwise, step
    out = []
    for fraction in fractions:
        budget = int(peaks["full"] + fraction * (peaks["none"] - peaks["full"]))
        guard = spikeguard.attach(model, budget=budget, policy="adaptive")
        for k in range(STEPS):
            meter = None
            if fraction > 1 and k == STEPS - 1:
                with metered(model) as meter:
                    grads = step(model, data, guard)
            else:
                grads = step(model, data, guard)
            same = bitwise(reference, grads)
            record = guard.history[-1]
            out.append({"fraction": fraction, "bitwise": same, "budget": budget,
                        "reruns": len(record["safety_net"]), "peak": guard.meter.peak(),
                        "decisions": record["decisions"], "calm": record["calm_forwards"],
                        "meter_peak": None if meter is None else meter.peak_bytes})
        guard.detach()
    return out


def _check(runs: list[dict]) -> None:
    for run in runs:
        assert run["bitwise"], run
        assert run["reruns"] == 0, run
        assert run["peak"] <= run["budget"], run
    assert any(r["decisions"]["save"] < 4 for r in runs)   # the low budgets mixed plans
    # above the all-saved peak forwards ran calm (FSDP2's bytes to come in the start
    # proof's walk, as in the hooked path's), bitwise and under the budget (one rank: both
    # of the last step's; under EP the walk's predictions hold on some steps)
    above = [r for r in runs if r["fraction"] > 1]
    assert above and sum(r["calm"] for r in above) > 0, above
    # ... and the device's peak is the independent meter's: more by at most 2% (gloo's
    # threads and scratch inside one op are the meter's blind spots), never less
    for run in above:
        if run["meter_peak"] is not None:
            seen = run["meter_peak"]
            assert seen <= run["peak"] <= seen + max(0.02 * seen, 32 * 1024), run


@pytest.mark.slow
def test_one_rank_adaptive_between_full_and_all_saved(one_rank):
    from titan_fsdp_helpers import build_fsdp
    from titan_helpers import batches, step
    model = build_fsdp(world=1)
    data = batches(1, seq=64)
    reference = step(model, data)
    peaks = _policy_peaks(model, data, reference)
    assert peaks["full"] < peaks["none"]
    _check(_adaptive_runs(model, data, reference, peaks))


def _short_sequences(rank, world, store, out_dir):
    """One spawned rank: the re-runs of 3 adaptive steps at 16 tokens a sequence, 0.9 of
    the range, with the FSDP2 terms and with them emptied."""
    import warnings
    warnings.filterwarnings("ignore")
    init_gloo(rank, world, store)
    import spikeguard
    from spikeguard.plan.cost import CostModel
    from spikeguard.plan.fsdp_bytes import FsdpBytes
    from titan_fsdp_helpers import build_fsdp
    from titan_helpers import batches, bitwise, step
    model = build_fsdp(world=1)
    data = batches(1, seq=16)
    reference = step(model, data)
    peaks = _policy_peaks(model, data, reference)
    budget = int(peaks["full"] + 0.9 * (peaks["none"] - peaks["full"]))
    found = {"peaks": peaks, "budget": budget}
    for terms in (True, False):
        guard = spikeguard.attach(model, budget=budget, policy="adaptive")
        pinned = CostModel()   # timed on a loaded machine, the rates (and plans) moved
        guard.cost.stage_s_per_token = dict(pinned.stage_s_per_token)
        guard.cost.d2h_s_per_byte = guard.cost.h2d_s_per_byte = pinned.d2h_s_per_byte
        guard.cost.freeze()
        guard.planner.refresh()
        if not terms:
            guard.layer_room.fsdp = FsdpBytes()
        steps = []
        for _ in range(3):
            same = bitwise(reference, step(model, data, guard))
            steps.append({"bitwise": same, "under": guard.meter.peak() <= budget,
                          "reruns": len(guard.history[-1]["safety_net"])})
        found[str(terms)] = steps
        guard.detach()
    (out_dir / "short.json").write_text(json.dumps(found))
    close_gloo()


@pytest.mark.multiprocess
def test_one_rank_the_fsdp2_terms_are_what_keeps_short_sequences_calm(tmp_path):
    """Where the FSDP2 terms matter: at 16 tokens a sequence the units' gathered parameters
    and gradients are large beside the activations, so the shapes' per-routed slopes of the
    first step do not cover them. At 0.9 of the way from full's peak to the all-saved one,
    3 steps with no re-run; the same budget with the FSDP2 part of the byte model emptied
    (as before it existed) re-runs the first step in backward. (At 64 tokens, the sweep
    above, the shapes' slopes cover them: emptied, no step re-ran at 0.0-0.3, measured.)
    In a fresh process with the cost model pinned (CostModel's defaults, frozen): run in
    the test process after another test, full recompute's own peak came out 79 KB higher
    (1,318,384 against 1,239,196 B) and the check measured something else (not explained)."""
    run_spawned(_short_sequences, 1, (tmp_path,), tmp_path / "store", timeout_s=200)
    found = json.loads((tmp_path / "short.json").read_text())
    for terms in ("True", "False"):
        assert all(s["bitwise"] and s["under"] for s in found[terms]), found
    assert [s["reruns"] for s in found["True"]] == [0, 0, 0], found
    assert sum(s["reruns"] for s in found["False"]) > 0, found


def _worker(rank, world, store, out_dir, ep):
    import warnings
    warnings.filterwarnings("ignore")
    init_gloo(rank, world, store)
    from titan_fsdp_helpers import build_fsdp
    from titan_helpers import batches, step
    model = build_fsdp(world=world, ep=ep)
    data = batches(20 + rank, seq=64)   # each data-parallel rank its own batches
    reference = step(model, data)
    peaks = _policy_peaks(model, data, reference)
    runs = _adaptive_runs(model, data, reference, peaks)
    found = {"peaks": peaks, "runs": runs}
    if ep > 1:
        found["infeasible"] = _infeasible(model, data, peaks)
    (out_dir / f"{rank}.json").write_text(json.dumps(found))
    if "infeasible" in found:
        return   # the agreed end aborted the group: nothing left to close
    del model
    close_gloo()


def _infeasible(model, data, peaks) -> str:
    """Adaptive at half of full recompute's peak: no plan fits, and under torchtitan's EP no
    refusal can be settled, so the job ends; the line this rank ends with."""
    import spikeguard
    from spikeguard.runtime.agreement import JobEnds
    from titan_helpers import step
    guard = spikeguard.attach(model, budget=peaks["full"] // 2, policy="adaptive")
    try:
        step(model, data, guard)
    except JobEnds as err:
        return f"JobEnds: {err}"
    except Exception as err:   # noqa: BLE001  reported, the test fails on it
        return f"{type(err).__name__}: {err}"
    return "finished"


@pytest.mark.parametrize("ep", [1, 2])
@pytest.mark.multiprocess
def test_two_ranks_adaptive_between_full_and_all_saved(tmp_path, ep):
    run_spawned(_worker, 2, (tmp_path, ep), tmp_path / "store", timeout_s=280)
    for rank in range(2):
        result = json.loads((tmp_path / f"{rank}.json").read_text())
        assert result["peaks"]["full"] < result["peaks"]["none"], result["peaks"]
        _check(result["runs"])
        if ep > 1:
            line = result["infeasible"]
            assert line.startswith("JobEnds: ") and "ran out of memory" in line, line
            assert "\n" not in line, line


def test_an_abandoned_attempt_leaves_nothing_of_fsdp2_on_the_device(one_rank):
    """`none` refused in the head's backward: FSDP2 still held the head's gathered
    parameters (it does not reshard them after forward); after the guard frees the attempt
    the device holds what it held before the step (32,896 bytes stayed without the
    reset of FSDP2's iteration state)."""
    import spikeguard
    from titan_fsdp_helpers import build_fsdp
    from titan_helpers import batches, step
    model = build_fsdp(world=1)
    data = batches(1, seq=64)
    guard = spikeguard.attach(model, budget=2_400_000, policy="none")
    try:
        before = guard.meter.allocated()
        with pytest.raises(spikeguard.DeviceOutOfMemory, match="backward"):
            step(model, data, guard)
        for p in model.parameters():
            p.grad = None
        assert guard.meter.allocated() == before
    finally:
        guard.detach()
