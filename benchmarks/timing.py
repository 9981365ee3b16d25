"""Timing helpers shared by the benchmarks: wall and process-CPU seconds of a block."""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass
class Timed:
    """One timed run: wall and process CPU seconds (CPU / (wall x threads) well under 1 hints at contention)."""

    wall_s: float
    cpu_s: float

    def utilization(self, threads: int) -> float:
        return self.cpu_s / (self.wall_s * threads) if self.wall_s > 0 else 0.0


class Stopwatch:
    def __enter__(self) -> "Stopwatch":
        self._wall, self._cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.timed = Timed(time.perf_counter() - self._wall, time.process_time() - self._cpu)
