"""The one fitted number: kernel efficiency, so that full recompute runs at a target MFU.

    cfg, eff = calibrate_efficiency(cfg, target_mfu=0.246)

Issue 7: "calibrate one number only (kernel efficiency) so that full recompute gives 24.6%
MFU at the published scale", then read what the simulator predicts for the other
policies. A step's time is, per stage, compute / efficiency plus all-to-all time (which
does not depend on efficiency), so MFU is monotone in the efficiency: a secant search on
1/efficiency converges in a few simulations of `full` alone (a static policy, fast).
"""

from __future__ import annotations

from spikeguard.errors import UsageError
from spikeguard.sim.config import SimConfig
from spikeguard.sim.engine import simulate

TOLERANCE = 1e-4   # of MFU


def full_mfu(cfg: SimConfig, efficiency: float) -> float:
    trial = cfg.with_changes(device={"efficiency": efficiency}, run={"policies": ("full",)})
    return simulate(trial).policies["full"].mfu


def calibrate_efficiency(cfg: SimConfig, target_mfu: float, max_iter: int = 12) -> tuple[SimConfig, float]:
    """(cfg with the fitted efficiency, that efficiency); a clear error when no efficiency
    in (0, 1] reaches the target (the all-to-all and bubble alone cost more)."""
    if not 0 < target_mfu < 1:
        raise UsageError(f"--calibrate-mfu must be a fraction in (0, 1), got {target_mfu}")
    best = full_mfu(cfg, 1.0)
    if best < target_mfu:
        raise UsageError(f"full recompute reaches at most {best:.1%} MFU at kernel efficiency 1.0 "
                         f"on this layout (all-to-all and bubbles), below the target "
                         f"{target_mfu:.1%}: lower the target or change the layout")
    # MFU ~ 1 / (a/eff + c): secant on x = 1/eff against y = 1/MFU, which is close to linear.
    x0, y0 = 1.0, 1 / best
    x1 = x0 * (1 / target_mfu) / y0
    y1 = 1 / full_mfu(cfg, 1 / x1)
    for _ in range(max_iter):
        if abs(1 / y1 - target_mfu) < TOLERANCE or y1 == y0:
            break
        x0, y0, x1 = x1, y1, x1 + (1 / target_mfu - y1) * (x1 - x0) / (y1 - y0)
        x1 = max(x1, 1.0)
        y1 = 1 / full_mfu(cfg, 1 / x1)
    efficiency = 1 / x1
    return cfg.with_changes(device={"efficiency": efficiency}), efficiency
