"""Races in tests: the same call started on several threads at the same instant."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


def run_at_once(call: Callable[[], Any], count: int = 2, timeout_s: float = 60) -> tuple[list[Any], list[Exception]]:
    """``call`` on ``count`` threads released together by a barrier: (its results, the errors raised).
    Each thread is joined for at most ``timeout_s``, so a hang fails the test instead of the suite."""
    barrier = threading.Barrier(count)
    outs: list[Any] = []
    errors: list[Exception] = []

    def run() -> None:
        barrier.wait()
        try:
            outs.append(call())
        except Exception as exc:  # noqa: BLE001 - returned for the test's assertion to report
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    assert not any(t.is_alive() for t in threads), f"a thread of {count} did not finish in {timeout_s} s"
    return outs, errors
