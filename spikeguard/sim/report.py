"""What `spikeguard simulate` prints and writes: the policy table, the scaling table, JSON.

Rich tables for the terminal (CONVENTIONS.md: rich for CLI reports, not in the library);
`to_json` is the machine form: {"policies": {NAME: {"mfu", "tokens_per_s", "flops_per_s",
"crashes", "lost_seconds", "peak_bytes", ...}}, "config": ..., "scaling": [...], ...}.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from spikeguard.errors import UsageError
from spikeguard.memory.budget import format_bytes
from spikeguard.sim.config import SimConfig
from spikeguard.sim.engine import SimResult, simulate

ACTIONS = ("save", "recompute", "offload")


def scaling(cfg: SimConfig, devices: list[int], steps: Optional[int] = None) -> list[dict]:
    """One row per device count: data parallelism grows with the devices and every
    pipeline keeps its micro-batches per step (weak scaling); a count the layout cannot
    take is a row with the reason instead of figures."""
    rows = []
    lay = cfg.layout
    per_replica = lay.micro_batches * lay.micro_batch_size
    for n in devices:
        row: dict = {"devices": n}
        try:
            dp = n // (lay.tp * lay.pp)
            changes = {"devices": n, "global_batch": per_replica * max(dp, 1)}
            other = cfg.with_changes(layout=changes,
                                     workload={"steps": steps or cfg.workload.steps})
            res = simulate(other)
        except UsageError as err:
            row["error"] = str(err)
            rows.append(row)
            continue
        row["policies"] = {name: {"mfu": r.mfu, "tokens_per_s": r.tokens_per_s,
                                  "flops_per_s": r.flops_per_s, "crashes": r.crashes}
                           for name, r in res.policies.items()}
        rows.append(row)
    return rows


def to_json(result: SimResult, path: str, extra: Optional[dict] = None) -> None:
    data = result.to_dict()
    data.update(extra or {})
    target = Path(path)
    if target.parent and not target.parent.is_dir():
        raise UsageError(f"--json {path}: folder {target.parent} does not exist")
    from spikeguard.files import atomic_write

    # An earlier file is only replaced by a complete one; whether it may be replaced at
    # all is the command's check (simulate --overwrite), made before the simulation.
    atomic_write(target, json.dumps(data, indent=1, default=_plain), overwrite=True,
                 what="--json")


def _plain(value):
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def _count(n: float) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n:,.0f}"


def _mix(decisions: dict) -> str:
    total = sum(decisions.get(a, 0) for a in ACTIONS)
    if not total:
        return "-"
    parts = [f"{decisions.get(a, 0) / total:.1%}" for a in ACTIONS]
    extra = ""
    if decisions.get("safety_net"):
        extra += f" +{decisions['safety_net']} net"
    if decisions.get("full_layer"):
        extra += f" +{decisions['full_layer']} whole"
    return " / ".join(parts) + extra


def print_report(console, result: SimResult, calibration: Optional[dict] = None,
                 scaling_rows: Optional[list[dict]] = None) -> None:
    from rich.table import Table

    cfg, dm = result.config, result.device_model
    lay, dev = cfg.layout, cfg.device
    cpu = " (CPU, emulated device)" if dev.kind == "cpu" else ""
    console.print(
        f"model {cfg.model.name}: {_count(dm.num_params)} parameters, {cfg.model.num_layers} "
        f"layers, {cfg.model.num_experts} experts top-{cfg.model.top_k} | {lay.devices} devices "
        f"= tp {lay.tp} x pp {lay.pp} x dp {lay.dp} (ep {lay.ep}), {lay.schedule}"
        f"{f' v={lay.virtual_stages}' if lay.virtual_stages > 1 else ''}, {lay.micro_batches} "
        f"micro-batches of {lay.micro_batch_size} x {cfg.model.seq_len} tokens | {dev.name}{cpu}: "
        f"{format_bytes(dev.capacity_bytes)}, efficiency {dev.efficiency:.3f} | "
        f"{cfg.workload.steps} steps, {int(result.spike_steps.sum())} spike steps",
        soft_wrap=True, markup=False, highlight=False)
    if calibration:
        console.print(f"calibrated: kernel efficiency {calibration['efficiency']:.4f} makes full "
                      f"recompute {calibration['target_mfu']:.1%} MFU (the only fitted number)",
                      markup=False, highlight=False)
    table = Table(title=f"per policy{cpu}")
    for col in ("policy", "MFU", "tokens/s", "FLOP/s", "crashes", "lost s",
                "peak (worst stage)", "save / recompute / offload"):
        table.add_column(col, justify="right" if col not in ("policy",) else "left")
    for name, r in result.policies.items():
        label = f"{name} ({r.setting})" if r.setting else name
        peak = max(r.peak_bytes)
        stage = r.peak_bytes.index(peak)
        table.add_row(label, f"{r.mfu:.1%}", f"{r.tokens_per_s:,.0f}",
                      f"{r.flops_per_s:.3g}", str(r.crashes), f"{r.lost_s:,.0f}",
                      f"{format_bytes(peak)} s{stage}", _mix(r.decisions))
    console.print(table)
    if scaling_rows:
        names = list(result.policies)
        table = Table(title=f"scaling (MFU; tokens/s){cpu}")
        table.add_column("devices", justify="right")
        for name in names:
            table.add_column(name, justify="right")
        for row in scaling_rows:
            if "error" in row:
                table.add_row(str(row["devices"]), *(["-"] * (len(names) - 1)),
                              f"n/a: {row['error'][:60]}")
                continue
            cells = []
            for name in names:
                p = row["policies"][name]
                cells.append(f"{p['mfu']:.1%}; {p['tokens_per_s']:.3g}")
            table.add_row(str(row["devices"]), *cells)
        console.print(table)
