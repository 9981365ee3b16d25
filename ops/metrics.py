"""Small statistics shared by the metrics of every step."""

from __future__ import annotations

import math
from collections.abc import Sequence


def percentile(values: Sequence[float], pct: float) -> float | None:
    """The ``pct``-th percentile with linear interpolation (numpy's default); None when empty."""
    if not values:
        return None
    xs = sorted(values)
    rank = (len(xs) - 1) * pct / 100.0
    lo, hi = math.floor(rank), math.ceil(rank)
    value = xs[lo] + (xs[hi] - xs[lo]) * (rank - lo)
    return round(value, 6)
