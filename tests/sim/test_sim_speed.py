"""The simulator's speed-ups change no figure: every per-step number, bit for bit.

The speed-ups (sim/steps.py: each distinct step summed once; sim/layer_figures.py: the
byte model remembered; sim/residents.py: the residency read once per forward; the walk's
probes built only where they calibrate) must leave every figure as it was. The reference,
`sim_figures.json` beside this file, was written by the code *before* them (commit
93685a4, the parent of the speed-up commits) with

    PYTHONPATH=<a checkout of 93685a4> .venv/bin/python tests/sim/test_sim_speed.py --write

and is compared here with what the code computes now: every policy's time, crash flag,
peak and per-stage peaks of every step, its decisions per step and in total, the
run's summary. The configurations exercise every path of the walk: the CPU preset
whose layer slopes calibrate after each step, a pipeline with spikes (evictions,
whole-layer recompute), the interleaved schedule, and a device small enough for the
forward's safety net and step re-runs. Rewrite the file only for a change that is meant
to move a figure, and say so in its commit. Rewritten twice since: when a layer's entry
first asked the layers below for the bytes it lacks (plan/decide.py `entry_fallback`),
which moved adaptive's figures on the pipeline configurations (fewer whole layers); and
(`small` only, the one that calibrates) when an eviction stopped raising the forward
slope of the layers it did not follow (plan/layer_room.py `Probe.evicted_later`,
`evicted_first`): adaptive's evicted bytes over the run 1.42 GB -> 0.45 GB; and when
the layers' later supply for lazy eviction counted their expert paths' least kept bytes
beside their attention parts (plan/forecast.py `later_evictable`): two steps of
188b-256-48GB peak 0.16 MB higher (of 47.3 GB), no time or decision moved; and when an
eviction stopped overshooting its ask by a whole storage (runtime/hooks.py
`SavedTensorTracker.evict`, sim/chunk_parts.py `ChunkEvictor.evict`: a storage larger than
what is still needed waits for smaller ones, then the smallest passed over): adaptive's
evicted bytes over the run 453 -> 268 MB on `small`, 1.49 -> 1.04 GB on 188b-256, 2.054
-> 2.038 TB on 188b-256-48GB, more offload decisions instead, step times the same within
0.04%, no crash.
"""

import json
import sys
from pathlib import Path

import pytest

from spikeguard.sim.config import load_config
from spikeguard.sim.engine import simulate

STORED = Path(__file__).with_name("sim_figures.json")
_SPIKY = {"workload.steps": 40, "layout.devices": 256, "layout.global_batch": 128,
          "workload.skew": {"spike_probability": 0.15}}
CONFIGS = {
    "small": ("small", {}),
    "188b-256": ("188b", _SPIKY),
    "188b-256-interleaved": ("188b", {**_SPIKY, "layout.schedule": "interleaved",
                                      "layout.virtual_stages": 2}),
    "188b-256-48GB": ("188b", {**_SPIKY, "device.capacity_bytes": 48e9}),
}


def figures(name: str) -> dict:
    """Every figure `simulate` gives for CONFIGS[name], as JSON keeps it (floats exact)."""
    preset, overrides = CONFIGS[name]
    result = simulate(load_config(preset, overrides=overrides))
    out = {"summary": result.to_dict(), "spike_steps": result.spike_steps.tolist()}
    for policy, r in result.policies.items():
        out[policy] = {"step_s": r.step_s.tolist(), "crashed": r.crashed.tolist(),
                       "peak_step": r.peak_step.tolist(), "peak_bytes": list(r.peak_bytes),
                       "peak_stage_step": r.peak_stage_step.tolist(),
                       "decisions": list(r.decisions.items()),
                       "decisions_step": [list(c.items()) for c in r.decisions_step]}
    # through JSON, as stored: tuples become lists, dict order is kept
    return json.loads(json.dumps(out))


def _stored(name: str) -> dict:
    return json.loads(STORED.read_text())[name]


def test_small_preset_figures_unchanged():
    """The CPU preset: layer slopes calibrated after every step, state carried per step."""
    assert figures("small") == _stored("small")


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in CONFIGS if n != "small"])
def test_pipeline_figures_unchanged(name):
    got, want = figures(name), _stored(name)
    for key in want:   # one key at a time, so a failure names what moved
        assert got[key] == want[key], f"{name}: {key} differs from the stored figures"
    assert got == want


if __name__ == "__main__":
    if sys.argv[1:2] != ["--write"]:
        raise SystemExit("usage: python tests/sim/test_sim_speed.py --write [--overwrite]")
    if STORED.exists() and "--overwrite" not in sys.argv:
        raise SystemExit(f"{STORED} exists: it is the reference; --overwrite to replace it")
    STORED.write_text(json.dumps({n: figures(n) for n in CONFIGS}) + "\n")
    print(f"wrote {STORED}")
