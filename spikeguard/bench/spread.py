"""The spread of a ratio over interleaved repetitions, and the repetitions that would
resolve it to +-0.01: the one procedure every bench of this folder quotes its ratios with.

    s = ratio_spread(policy_s, ceiling_s)   # per round: the ceiling's seconds / the policy's
    s = spread([0.93, 0.95, 0.91])          # or ratios already taken (segments, rounds)
    cell(s)         -> '0.932 (0.91-0.95)'        the median, its quartiles in brackets
    rounds_text(s)  -> '11 rounds, range 0.88-0.97, ~40 resolve +-0.01'

Quartiles are `statistics.quantiles(..., method="inclusive")`: they stay inside the range
(the default, "exclusive", puts the first quartile of 2 rounds below the smaller one).
`n_for_0.01`: the rounds for which a 95% interval of the median is +-0.01, the median's
standard error being about 1.2533 sd / sqrt(n) for a normal spread:
ceil((1.96 x 1.2533 x sd / 0.01)^2), at least 1, sd the rounds' sample standard deviation
(None from one round: no spread to scale).
"""

from __future__ import annotations

import math
import statistics
from typing import Optional, Sequence

HALF_WIDTH = 0.01
Z_95 = 1.96
MEDIAN_SE = 1.2533   # sqrt(pi / 2): the median's standard error over the mean's, normal


def rounds_for(sd: float, half_width: float = HALF_WIDTH) -> int:
    """Repetitions for a 95% interval of the median of +-half_width, given the spread sd."""
    return max(1, math.ceil((Z_95 * MEDIAN_SE * sd / half_width) ** 2))


def spread(values: Sequence[float]) -> dict:
    """Median, quartiles, range, count, standard deviation and `n_for_0.01` of `values`."""
    r = sorted(float(v) for v in values)
    if not r:
        raise ValueError("spread of no values")
    q = statistics.quantiles(r, n=4, method="inclusive") if len(r) > 1 else [r[0]] * 3
    sd = statistics.stdev(r) if len(r) > 1 else None
    return {"median": statistics.median(r), "q1": q[0], "q3": q[2], "min": r[0], "max": r[-1],
            "n": len(r), "sd": sd, "n_for_0.01": rounds_for(sd) if sd is not None else None}


def ratio_spread(num_s: Sequence[float], den_s: Sequence[float]) -> dict:
    """The spread of the per-round ratio of tokens/s, round i's den_s[i] / num_s[i] (the
    ceiling's seconds over the policy's, taken in the same round)."""
    if len(num_s) != len(den_s):
        raise ValueError(f"{len(num_s)} rounds against {len(den_s)}")
    return spread([d / n for n, d in zip(num_s, den_s)])


def cell(s: dict) -> str:
    """'0.932 (0.91-0.95)': the median, its quartiles in brackets."""
    return f"{s['median']:.3f} ({s['q1']:.2f}-{s['q3']:.2f})"


def needed(s: dict) -> str:
    """'~40': the repetitions `n_for_0.01` says, '-' from one round."""
    return "-" if s.get("n_for_0.01") is None else f"~{s['n_for_0.01']}"


def rounds_text(s: dict, unit: str = "rounds") -> str:
    """'11 rounds, range 0.88-0.97, ~40 resolve +-0.01'."""
    return (f"{s['n']} {unit}, range {s['min']:.2f}-{s['max']:.2f}, {needed(s)} "
            f"resolve +-0.01")


def of(values: Optional[Sequence[float]]) -> Optional[dict]:
    """spread(values), or None for none (a row that did not run, a one-segment bench)."""
    return spread(values) if values else None
