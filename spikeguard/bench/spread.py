"""The spread of a ratio over interleaved repetitions, and the repetitions that would
resolve it to +-0.01: the one procedure every bench of this folder quotes its ratios with.

    s = ratio_spread(policy_s, ceiling_s)   # per round: the ceiling's seconds / the policy's
    s = spread([0.93, 0.95, 0.91])          # or ratios already taken (segments, rounds)
    cell(s)         -> '0.932 (0.91-0.95)'        the median, its quartiles in brackets
    rounds_text(s)  -> '11 rounds, range 0.88-0.97, ~40 resolve +-0.01'
    interval(s)     -> '0.93-0.94'                the median's 95% interval (below)

Quartiles are `statistics.quantiles(..., method="inclusive")`: they stay inside the range
(the default, "exclusive", puts the first quartile of 2 rounds below the smaller one).
`n_for_0.01`: the rounds for which a 95% interval of the median is +-0.01, the median's
standard error being about 1.2533 sd / sqrt(n) for a normal spread:
ceil((1.96 x 1.2533 x sd / 0.01)^2), at least 1, sd the rounds' sample standard deviation
(None from one round: no spread to scale).

`ci95`: a 95% interval of the median that assumes no distribution (order statistics: the
count of rounds below the true median is Binomial(n, 1/2), so [x_(j), x_(k)] with j, k at
n/2 -+ 1.96 sqrt(n)/2, 1-based, clamped to the rounds: the whole range up to 10 rounds). A
figure claims a bound (a cost under 2%) only where this interval is inside it.
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
            "n": len(r), "sd": sd, "n_for_0.01": rounds_for(sd) if sd is not None else None,
            "ci95": list(median_interval(r))}   # a list: the same after a JSON round trip


def median_interval(ordered: Sequence[float]) -> tuple[float, float]:
    """A 95% interval of the median of `ordered` (sorted), free of any distribution (see
    the module doc)."""
    n = len(ordered)
    half = Z_95 * math.sqrt(n) / 2
    lo = max(1, math.floor(n / 2 - half))        # 1-based order statistics
    hi = min(n, math.ceil(n / 2 + 1 + half))
    return ordered[lo - 1], ordered[hi - 1]


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


def interval(s: dict) -> str:
    """'0.93-0.94': the median's 95% interval (`ci95`)."""
    return f"{s['ci95'][0]:.3f}-{s['ci95'][1]:.3f}"


def rounds_text(s: dict, unit: str = "rounds") -> str:
    """'11 rounds, range 0.88-0.97, ~40 resolve +-0.01'."""
    return (f"{s['n']} {unit}, range {s['min']:.2f}-{s['max']:.2f}, {needed(s)} "
            f"resolve +-0.01")


def of(values: Optional[Sequence[float]]) -> Optional[dict]:
    """spread(values), or None for none (a row that did not run, a one-segment bench)."""
    return spread(values) if values else None
