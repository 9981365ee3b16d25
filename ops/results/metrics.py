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
    every ``every_s`` seconds, and once more at the end. ``emit`` None makes it a no-op.

    The ETA extrapolates from rows done, which misleads under continuous batching: every row
    is in flight at once and the first ones finish near the end, so one row done after 25 s
    of 58 read as "ETA 1,400 s" for a shard that ended seconds later. A step that can measure
    its work while rows are in flight says so with :meth:`track` (decode: output tokens
    generated so far, against the rows' ``max_tokens``); the ETA is then the smaller of the
    two estimates, each of which can only overstate the time left."""

    def __init__(self, what: str, total_rows: int, emit: Callable[[str], None] | None, *,
                 every_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.what, self.total_rows, self.emit, self.every_s, self.clock = what, total_rows, emit, every_s, clock
        self.rows = self.tokens = 0
        self.started = self.last = clock()
        self._work: tuple[Callable[[], float], float] | None = None

    def restart(self) -> None:
        """Start the clock now (the step's measured work begins here, after its set-up)."""
        self.started = self.last = self.clock()

    def track(self, done: Callable[[], float], total: float) -> None:
        """Also estimate the ETA from ``done()`` of ``total`` units of work (an upper bound of
        the work left is fine: the smaller estimate wins)."""
        if total > 0:
            self._work = (done, total)

    def _eta(self, elapsed: float) -> str:
        left = self.total_rows - self.rows
        if left <= 0:
            return "0 s"
        estimates = [left * elapsed / self.rows] if self.rows > 0 else []
        if self._work is not None:
            done, total = self._work
            fraction = min(max(done() / total, 0.0), 1.0)
            if fraction > 0:
                estimates.append(elapsed * (1 - fraction) / fraction)
        return f"{min(estimates):.0f} s" if estimates else "unknown"

    def message(self, *, tokens: int | None = None, elapsed_s: float | None = None) -> str:
        elapsed = max(self.clock() - self.started if elapsed_s is None else elapsed_s, 1e-9)
        tokens = self.tokens if tokens is None else tokens
        pct = 100.0 * self.rows / self.total_rows if self.total_rows else 100.0
        return (f"{self.what}: {self.rows:,}/{self.total_rows:,} rows ({pct:.0f}%), {tokens:,} tokens, "
                f"{tokens / elapsed:,.1f} tokens/s, ETA {self._eta(elapsed)}")

    def advance(self, rows: int = 1, tokens: int = 0) -> None:
        self.rows += rows
        self.tokens += tokens
        if self.emit is not None and self.clock() - self.last >= self.every_s:
            self.last = self.clock()
            self.emit(self.message())

    def finish(self, *, tokens: int | None = None, elapsed_s: float | None = None) -> None:
        """The last line. A step that measured its own figures passes them (``tokens``, its wall
        ``elapsed_s``), so the log's last line says what the step's metadata says."""
        if self.emit is not None:
            self.emit(self.message(tokens=tokens, elapsed_s=elapsed_s))
