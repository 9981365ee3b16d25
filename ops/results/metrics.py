"""Small statistics shared by the metrics of every step: percentiles, latency SLOs, progress.

Plain Python (no Dagster): the pipeline's assets and checks call these, and so do the workers
that Dagster Pipes launches.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

LATENCY_PERCENTILES = (50, 95, 99)
LATENCIES = ("ttft_s", "tpot_s")


def percentile(values: Sequence[float], pct: float) -> float | None:
    """The ``pct``-th percentile with linear interpolation (numpy's default); None when empty."""
    if not values:
        return None
    xs = sorted(values)
    rank = (len(xs) - 1) * pct / 100.0
    lo, hi = math.floor(rank), math.ceil(rank)
    value = xs[lo] + (xs[hi] - xs[lo]) * (rank - lo)
    return round(value, 6)


def latency_percentiles(columns: Mapping[str, Sequence[float | None]]) -> dict[str, float | None]:
    """``ttft_s_p50`` ... ``tpot_s_p99`` over the per-request values (nulls skipped; None when none)."""
    out: dict[str, float | None] = {}
    for name in LATENCIES:
        values = [x for x in columns.get(name, []) if x is not None]
        for pct in LATENCY_PERCENTILES:
            out[f"{name}_p{pct}"] = percentile(values, pct)
    return out


@dataclass(frozen=True)
class LatencySLO:
    """P95 thresholds in seconds: time to first token and time per output token after it."""

    ttft_s_p95: float
    tpot_s_p95: float

    def __post_init__(self) -> None:
        for name in ("ttft_s_p95", "tpot_s_p95"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value > 0 and math.isfinite(value)):
                raise ValueError(f"SLO {name} must be a positive number of seconds, got {value!r}")


@dataclass(frozen=True)
class SLOVerdict:
    passed: bool
    measured: dict[str, float | None]
    breaches: list[str] = field(default_factory=list)


def check_slo(measured: Mapping[str, float | None], slo: LatencySLO) -> SLOVerdict:
    """Each P95 against its threshold (a P95 at exactly the threshold passes). A latency with no
    measurement (no request, or no request past its first token) cannot breach."""
    got = {name: measured.get(name) for name in ("ttft_s_p95", "tpot_s_p95")}
    breaches = [f"{name} {value:.4g} s > {getattr(slo, name):.4g} s" for name, value in got.items()
                if value is not None and value > getattr(slo, name)]
    return SLOVerdict(not breaches, got, breaches)


class ProgressMeter:
    """Rows done, tokens per second and the ETA of a step, sent to ``emit`` (a run's log) at most
    every ``every_s`` seconds, and once more at the end. ``emit`` None makes it a no-op."""

    def __init__(self, what: str, total_rows: int, emit: Callable[[str], None] | None, *,
                 every_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.what, self.total_rows, self.emit, self.every_s, self.clock = what, total_rows, emit, every_s, clock
        self.rows = self.tokens = 0
        self.started = self.last = clock()

    def message(self) -> str:
        elapsed = max(self.clock() - self.started, 1e-9)
        rate = self.tokens / elapsed
        rows_per_s = self.rows / elapsed
        left = self.total_rows - self.rows
        eta = f"{left / rows_per_s:.0f} s" if rows_per_s > 0 and left > 0 else ("0 s" if left <= 0 else "unknown")
        pct = 100.0 * self.rows / self.total_rows if self.total_rows else 100.0
        return (f"{self.what}: {self.rows:,}/{self.total_rows:,} rows ({pct:.0f}%), {self.tokens:,} tokens, "
                f"{rate:,.1f} tokens/s, ETA {eta}")

    def advance(self, rows: int = 1, tokens: int = 0) -> None:
        self.rows += rows
        self.tokens += tokens
        if self.emit is not None and self.clock() - self.last >= self.every_s:
            self.last = self.clock()
            self.emit(self.message())

    def finish(self) -> None:
        if self.emit is not None:
            self.emit(self.message())
