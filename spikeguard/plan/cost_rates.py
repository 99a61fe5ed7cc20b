"""A cost model's rates as a file, for plans that do not move with the machine's load.

The guard times its stages and host copies at attach and corrects the rates online, so two
runs on the same loads (or two ranks of one job) may rank plans differently: on a loaded
machine an offload and a recompute trade places. A run given a rates file plans with those
rates, frozen (never timed, never corrected): its plans are the same from run to run and on
every rank, and the simulator given the same file makes the same plans (the 4-process
validation, spikeguard/sim/validate_pp.py, relies on it).

    {"format": "spikeguard-cost-rates", "version": 1,
     "stage_s_per_token": {"gate_up": 1.2e-08, "silu": ..., "act": ..., "down": ...},
     "d2h_s_per_byte": 1e-10, "h2d_s_per_byte": 1e-10, "copies_overlap": false}

    spikeguard train ... --cost-rates rates.json      # or [guard] cost_rates = "rates.json"
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from spikeguard.errors import UsageError
from spikeguard.plan.catalogue import EXPERT_STAGES
from spikeguard.plan.cost import CostModel

FORMAT, VERSION = "spikeguard-cost-rates", 1


def rates_of(cost: CostModel) -> dict:
    """The file's content for `cost`."""
    return {"format": FORMAT, "version": VERSION,
            "stage_s_per_token": {s: cost.stage_s_per_token[s] for s in EXPERT_STAGES},
            "d2h_s_per_byte": cost.d2h_s_per_byte, "h2d_s_per_byte": cost.h2d_s_per_byte,
            "copies_overlap": cost.copies_overlap}


def write_rates(cost: CostModel, path: str | Path, overwrite: bool = False) -> None:
    from spikeguard.files import atomic_write

    atomic_write(Path(path), json.dumps(rates_of(cost), indent=1) + "\n", overwrite=overwrite)


def load_rates(path: str | Path) -> dict:
    """The rates in `path`, checked: one UsageError naming the file and what is wrong."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UsageError(f"--cost-rates {path}: no such file") from None
    except IsADirectoryError:
        raise UsageError(f"--cost-rates {path} is a folder, not a rates file") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise UsageError(f"--cost-rates {path} is not a rates file (JSON)") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("version") != VERSION:
        raise UsageError(f"--cost-rates {path} is not a rates file ({FORMAT}, version {VERSION})")
    stages = data.get("stage_s_per_token")
    if not isinstance(stages, dict) or set(stages) != set(EXPERT_STAGES):
        raise UsageError(f"--cost-rates {path}: stage_s_per_token must give exactly "
                         f"{', '.join(EXPERT_STAGES)}")
    for name, value in [*stages.items(), ("d2h_s_per_byte", data.get("d2h_s_per_byte")),
                        ("h2d_s_per_byte", data.get("h2d_s_per_byte"))]:
        if not isinstance(value, (int, float)) or isinstance(value, bool) \
                or not math.isfinite(value) or value <= 0:
            raise UsageError(f"--cost-rates {path}: {name} must be a positive number of "
                             f"seconds, got {value!r}")
    if not isinstance(data.get("copies_overlap"), bool):
        raise UsageError(f"--cost-rates {path}: copies_overlap must be true or false")
    return data


def use_rates(cost: CostModel, rates: dict) -> CostModel:
    """Plan with `rates` (load_rates' result) from now on, frozen."""
    cost.stage_s_per_token = {s: float(v) for s, v in rates["stage_s_per_token"].items()}
    cost.d2h_s_per_byte = float(rates["d2h_s_per_byte"])
    cost.h2d_s_per_byte = float(rates["h2d_s_per_byte"])
    cost.copies_overlap = rates["copies_overlap"]
    return cost.freeze()
