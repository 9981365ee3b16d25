"""Object-store requests, counted by kind, so that a request price can turn them into dollars.

Object stores bill per request (a PUT or LIST costs about ten GETs) as well as per byte, and a
layout that makes many small requests can cost more in requests than in storage. Every call the
durable KV tier makes goes through `ObjectLayout`, which counts it here under the kind the store
bills it as: GET (a whole object or one byte range), PUT, LIST (one folder listing), HEAD (a size
or existence check) and DELETE.
"""

from __future__ import annotations

import threading

REQUEST_KINDS = ("GET", "PUT", "LIST", "HEAD", "DELETE")


class RequestCounter:
    """Requests made, by kind; thread-safe. `snapshot()` and `since()` give plain dicts."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(REQUEST_KINDS, 0)

    def add(self, kind: str, n: int = 1) -> None:
        if kind not in self._counts:
            raise ValueError(f"unknown object-store request kind {kind!r}; expected one of {REQUEST_KINDS}")
        with self._lock:
            self._counts[kind] += n

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def since(self, before: dict[str, int]) -> dict[str, int]:
        """Requests made after `before` (an earlier `snapshot()`), every kind present."""
        now = self.snapshot()
        return {k: now[k] - int(before.get(k, 0)) for k in REQUEST_KINDS}


def add_requests(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    """The sum of two request counts, every kind present."""
    return {k: int(a.get(k, 0)) + int(b.get(k, 0)) for k in REQUEST_KINDS}
