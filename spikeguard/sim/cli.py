"""`spikeguard simulate`: what a memory policy would do on a cluster, before booking it.

    .venv/bin/spikeguard simulate --preset 1t --calibrate-mfu 0.246 --json sim.json
    .venv/bin/spikeguard simulate --preset 188b --devices 2048 --set layout.pp=4 --plots docs/img
    .venv/bin/spikeguard simulate --config my_cluster.toml --scaling

Settings come from the preset, then the TOML file (sections model, layout, device,
training, workload, run), then `--set section.key=value` and the shortcut flags. Bad or
impossible settings are one line and exit code 2 (spikeguard.cli's contract).
"""

from __future__ import annotations

import argparse
import tomllib
from typing import Any, Optional

from spikeguard.errors import UsageError

SHORTCUTS = {  # flag -> (dotted setting, type)
    "devices": ("layout.devices", int), "tp": ("layout.tp", int), "pp": ("layout.pp", int),
    "ep": ("layout.ep", int), "schedule": ("layout.schedule", str),
    "virtual_stages": ("layout.virtual_stages", int),
    "micro_batch_size": ("layout.micro_batch_size", int),
    "global_batch": ("layout.global_batch", int),
    "efficiency": ("device.efficiency", float), "steps": ("workload.steps", int),
    "seed": ("workload.seed", int), "trace": ("workload.trace", str),
    "checkpoint_interval": ("run.checkpoint_interval", int),
    "restart_s": ("run.restart_s", float),
}


def add_parser(commands) -> argparse.ArgumentParser:
    """Register `simulate` on the top-level parser's subcommands."""
    from spikeguard.sim.presets import PRESETS

    p = commands.add_parser("simulate", help="simulate a memory policy on a cluster (no devices needed)")
    p.add_argument("--preset", default="1t", help=f"{', '.join(PRESETS)} (default 1t)")
    p.add_argument("--config", default=None, metavar="FILE.toml", help="settings file (tomllib)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override any setting, e.g. --set device.host_bytes_per_s=5e10 (repeatable)")
    g = p.add_argument_group("shortcuts for common settings")
    for flag, (_, kind) in SHORTCUTS.items():
        g.add_argument(f"--{flag.replace('_', '-')}", type=kind, default=None, dest=flag)
    g.add_argument("--capacity", default=None, help="device memory: 64GB, 80GiB or bytes")
    g.add_argument("--policies", default=None,
                   help="comma list of ceiling,none,experts,offload,full,safe-static,adaptive")
    out = p.add_argument_group("what to run and write")
    out.add_argument("--calibrate-mfu", type=float, default=None, metavar="FRACTION",
                     help="fit kernel efficiency so that full recompute reaches this MFU "
                          "(the published 0.246), then simulate")
    out.add_argument("--scaling", nargs="?", const="default", default=None, metavar="N,N,...",
                     help="also a scaling table over device counts (default 128 .. 12288)")
    out.add_argument("--scaling-steps", type=int, default=None,
                     help="steps per scaling row (default: --steps)")
    out.add_argument("--json", default=None, metavar="FILE", help="write the results as JSON")
    out.add_argument("--plots", default=None, metavar="DIR", help="write sim_*.png there")
    out.add_argument("--overwrite", action="store_true",
                     help="replace existing --json and --plots files (refused without it)")
    p.set_defaults(run=run)
    return p


def overrides_from(args: argparse.Namespace) -> dict[str, Any]:
    """Dotted settings from --set and the shortcuts (shortcuts win, they are explicit)."""
    out: dict[str, Any] = {}
    for item in args.set:
        key, eq, raw = item.partition("=")
        if not eq or "." not in key:
            raise UsageError(f"--set needs SECTION.KEY=VALUE, got {item!r}")
        out[key.strip()] = _value(raw.strip())
    for flag, (key, _) in SHORTCUTS.items():
        value = getattr(args, flag)
        if value is not None:
            out[key] = value
    if args.capacity is not None:
        from spikeguard.memory.budget import parse_bytes
        out["device.capacity_bytes"] = parse_bytes(args.capacity, "--capacity")
    if args.policies is not None:
        out["run.policies"] = [p.strip() for p in args.policies.split(",") if p.strip()]
    return out


def _value(raw: str) -> Any:
    """A TOML value (numbers, booleans, strings, arrays); bare words stay strings."""
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def _scaling_devices(spec: str) -> list[int]:
    from spikeguard.sim.presets import SCALING_DEVICES

    if spec == "default":
        return list(SCALING_DEVICES)
    try:
        values = [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"--scaling takes device counts like 128,1024,12288, got {spec!r}") from None
    if not values or any(v <= 0 for v in values):
        raise UsageError(f"--scaling device counts must be positive, got {spec!r}")
    return values


def _check_outputs(args: argparse.Namespace) -> None:
    from pathlib import Path

    if args.json is not None:
        parent = Path(args.json).parent
        if not parent.is_dir():
            raise UsageError(f"--json {args.json}: folder {parent} does not exist")
        if Path(args.json).is_dir():
            raise UsageError(f"--json {args.json} is a folder; give a file name")
    if args.plots is not None and not Path(args.plots).is_dir():
        raise UsageError(f"--plots {args.plots}: not a folder")
    _check_overwrites(args)


def _check_overwrites(args: argparse.Namespace) -> None:
    """No output is the --config or --trace it reads; an existing one needs --overwrite
    (the README's `--plots docs/img` must not silently replace a tracked image)."""
    from spikeguard.files import check_outputs
    from spikeguard.sim.plots import plot_paths

    plots = plot_paths(args.plots, args.scaling is not None) if args.plots is not None else None
    check_outputs({"--json": args.json, "--plots": plots},
                  inputs={"--config": args.config, "--trace": args.trace},
                  overwrite=getattr(args, "overwrite", False))


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from spikeguard.sim.calibrate import calibrate_efficiency
    from spikeguard.sim.config import load_config
    from spikeguard.sim.engine import simulate
    from spikeguard.sim.report import print_report, scaling, to_json

    if args.scaling_steps is not None and args.scaling_steps <= 0:
        raise UsageError(f"--scaling-steps must be positive, got {args.scaling_steps}")
    devices = _scaling_devices(args.scaling) if args.scaling is not None else None
    _check_outputs(args)   # before minutes of simulation, not after
    cfg = load_config(args.preset, args.config, overrides_from(args))
    calibration: Optional[dict] = None
    if args.calibrate_mfu is not None:
        cfg, eff = calibrate_efficiency(cfg, args.calibrate_mfu)
        calibration = {"target_mfu": args.calibrate_mfu, "efficiency": eff}
    result = simulate(cfg)
    rows = scaling(cfg, devices, args.scaling_steps) if devices else None
    console = Console(width=140)
    print_report(console, result, calibration, rows)
    if args.json is not None:
        to_json(result, args.json, {"calibration": calibration, "scaling": rows})
        console.print(f"wrote {args.json}", markup=False, highlight=False)
    if args.plots is not None:
        from spikeguard.sim.plots import write_plots
        for path in write_plots(result, args.plots, rows):
            console.print(f"wrote {path}", markup=False, highlight=False)
    return 0
