"""PNG plots of a simulation (matplotlib, Agg: no display needed).

    sim_peaks.png    worst device's peak bytes per step, per policy, against the capacity
    sim_mfu.png      MFU per policy, beside the published figures when the preset has them
    sim_scaling.png  tokens/s and MFU over device counts (when a scaling table was run)
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from spikeguard.errors import UsageError
from spikeguard.sim.engine import SimResult

# Published (issue 7): full recompute 24.6%, aggressive static 30% (crashing), adaptive 32.9%.
PUBLISHED_MFU = {"full": 0.246, "none": 0.30, "adaptive": 0.329}


def plot_paths(folder: str, scaling: bool, prefix: str = "sim_") -> list[Path]:
    """The files `write_plots` writes (so a command can refuse existing ones first)."""
    names = ["peaks", "mfu"] + (["scaling"] if scaling else [])
    return [Path(folder) / f"{prefix}{name}.png" for name in names]


def write_plots(result: SimResult, folder: str, scaling_rows: Optional[list[dict]] = None,
                prefix: str = "sim_") -> list[str]:
    from spikeguard.extras import require

    require("matplotlib", "plots", "simulate --plots").use("Agg")
    plt = require("matplotlib.pyplot", "plots", "simulate --plots")

    out = Path(folder)
    if not out.is_dir():
        raise UsageError(f"--plots {folder}: not a folder")
    cfg = result.config
    tag = " (CPU, emulated device)" if cfg.device.kind == "cpu" else ""
    written = []

    fig, ax = plt.subplots(figsize=(9, 4.5))
    steps = min(cfg.workload.steps, 400)
    for name, r in result.policies.items():
        if name == "safe-static":
            continue
        ax.plot(range(steps), r.peak_step[:steps] / 1e9, label=name, lw=1)
    ax.axhline(cfg.device.capacity_bytes / 1e9, color="k", ls="--", lw=1, label="capacity")
    for s in [i for i in range(steps) if result.spike_steps[i]]:
        ax.axvline(s, color="r", alpha=0.15, lw=2)
    ax.set_xlabel("step (red: routing spike)")
    ax.set_ylabel("worst device peak (GB)")
    ax.set_title(f"{cfg.model.name}, {cfg.layout.devices} devices: peak memory per step{tag}")
    ax.legend(fontsize=8, ncol=3)
    written.append(_save(fig, out / f"{prefix}peaks.png"))

    fig, ax = plt.subplots(figsize=(8, 4))
    names = list(result.policies)
    values = [result.policies[n].mfu * 100 for n in names]
    ax.bar(names, values, color="tab:blue", label="simulated")
    if cfg.device.kind == "cuda":
        xs = [i for i, n in enumerate(names) if n in PUBLISHED_MFU]
        ax.scatter(xs, [PUBLISHED_MFU[names[i]] * 100 for i in xs], color="tab:red",
                   zorder=3, label="published")
    for i, v in enumerate(values):
        ax.text(i, v + 0.3, f"{v:.1f}", ha="center", fontsize=8)
    ax.set_ylabel("MFU (%)")
    ax.set_title(f"{cfg.model.name}, {cfg.layout.devices} devices: MFU per policy{tag}")
    ax.legend(fontsize=8)
    written.append(_save(fig, out / f"{prefix}mfu.png"))

    rows = [r for r in (scaling_rows or []) if "policies" in r]
    if rows:
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
        devices = [r["devices"] for r in rows]
        for name in rows[0]["policies"]:
            a1.plot(devices, [r["policies"][name]["tokens_per_s"] for r in rows], "o-", label=name)
            a2.plot(devices, [r["policies"][name]["mfu"] * 100 for r in rows], "o-", label=name)
        for a in (a1, a2):
            a.set_xscale("log", base=2)
            a.set_xlabel("devices")
        a1.set_yscale("log")
        a1.set_ylabel("tokens/s")
        a2.set_ylabel("MFU (%)")
        a2.legend(fontsize=8)
        fig.suptitle(f"{cfg.model.name}: scaling{tag}")
        written.append(_save(fig, out / f"{prefix}scaling.png"))
    return written


def _save(fig, path: Path) -> str:
    import matplotlib.pyplot as plt

    from spikeguard.files import atomic_write

    fig.tight_layout()
    try:   # a reader sees the old image or the new one, never half of one
        atomic_write(path, overwrite=True, what="plot",
                     writer=lambda tmp: fig.savefig(tmp, format="png", dpi=110))
    finally:
        plt.close(fig)
    return str(path)
