"""How the durable tier meets a failing object store: which errors are transient, retries, the breaker.

- `is_transient` / `is_timeout`: whether an error (or what caused it) may go away on retry;
- `RetryPolicy`: exponential backoff on transient errors, bounded in attempts and in seconds;
- `CircuitBreaker`: stops calling a store that keeps failing (`TierUnavailable` while open);
- `transport_options` / `open_store` / `store_endpoint`: the fsspec filesystem of a store URL with
  bounded connect and read timeouts and no retry layer of its own, and where a URL points, for messages.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import fsspec

from kvbatch.io.kvstore.tiers import TIER_UNAVAILABLE, TierCounters
from kvbatch.io.urls import redact, redact_text

log = logging.getLogger(__name__)

T = TypeVar("T")

_TRANSIENT_ERRNOS = {
    errno.EBUSY,  # s3fs: 503 SlowDown / ServiceUnavailable
    errno.EREMOTEIO,  # s3fs: 500 InternalError
    errno.ETIMEDOUT,
    errno.ECONNRESET,
    errno.ECONNREFUSED,
    errno.ECONNABORTED,
    errno.EAGAIN,
    errno.EPIPE,
}


# Transport errors of botocore and aiohttp, by class name so that io/ needs neither import:
# a refused or dropped connection, a timeout, a body shorter than its Content-Length.
_TRANSIENT_TYPES = {
    "EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError", "ConnectionClosedError",
    "HTTPClientError", "ResponseStreamingError", "IncompleteRead", "ClientPayloadError",
    "ServerDisconnectedError", "ClientConnectionError", "ClientOSError", "ContentLengthError",
}


class TierUnavailable(RuntimeError):
    """The tier's circuit breaker is open: the call was not made (a lookup is a miss, a put fails)."""


def _causes(exc: BaseException) -> list[BaseException]:
    out, seen = [], set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen and len(out) < 8:  # bounded: cause chains can loop
        out.append(e)
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return out


def is_timeout(exc: BaseException) -> bool:
    """Whether an error (or what caused it) is a connect or read timeout."""
    return any(isinstance(e, TimeoutError) or "Timeout" in type(e).__name__ for e in _causes(exc))


def is_transient(exc: BaseException) -> bool:
    """Whether an object store error may go away on retry: 5xx, throttling, timeouts, dropped connections."""
    if isinstance(exc, TierUnavailable):
        return False  # retrying would only ask the breaker again
    if isinstance(exc, FileNotFoundError | PermissionError | IsADirectoryError | NotADirectoryError):
        return False
    if isinstance(exc, TimeoutError | ConnectionError):
        return True
    if any(c.__name__ in _TRANSIENT_TYPES for e in _causes(exc) for c in type(e).__mro__):
        return True
    if isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS:
        return True
    status = _http_status(exc)
    if status is not None:
        return status >= 500 or status == 429
    text = f"{type(exc).__name__} {exc}"
    return any(s in text for s in ("SlowDown", "ServiceUnavailable", "InternalError", "Timeout", "503", "500 "))


def _http_status(exc: BaseException) -> int | None:
    for e in (exc, exc.__cause__, exc.__context__):
        resp = getattr(e, "response", None)
        if isinstance(resp, dict):
            code = resp.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if isinstance(code, int):
                return code
        code = getattr(e, "status", None) or getattr(e, "status_code", None)
        if isinstance(code, int):
            return code
    return None


class CircuitBreaker:
    """Stops calling a tier that keeps failing, so an outage costs seconds, not the whole run.

    Closed: calls go through. After `failures_to_open` consecutive calls that gave up (each after
    its own retries) it opens: for `cooldown_s` no call is made (`allow()` says no, counted as
    `calls_skipped_open`). Then one call is let through as a probe (half-open): success closes
    it, failure opens it for another cool-down. Opening and closing each log one warning line,
    naming the tier and where it points with credentials redacted. A call the store answered,
    even with "not found" or "denied", counts as success: the store is reachable.
    """

    def __init__(self, failures_to_open: int = 3, cooldown_s: float = 30.0, *, name: str = "object",
                 where: str = "", counters: TierCounters | None = None) -> None:
        if failures_to_open < 1:
            raise ValueError(f"CircuitBreaker failures_to_open must be >= 1, got {failures_to_open}")
        if cooldown_s < 0:
            raise ValueError(f"CircuitBreaker cooldown_s must be >= 0, got {cooldown_s}")
        self.failures_to_open = failures_to_open
        self.cooldown_s = cooldown_s
        self.name = name
        self.where = redact(where)
        self.counters = counters if counters is not None else TierCounters()
        self._lock = threading.Lock()
        self._failures = 0
        self._open_until: float | None = None  # monotonic; None while closed
        self._opened_at = 0.0
        self._probing = False
        self._skipped = 0  # calls skipped since it opened, for the closing line

    @property
    def state(self) -> str:
        with self._lock:
            if self._open_until is None:
                return "closed"
            return "half_open" if self._probing or time.monotonic() >= self._open_until else "open"

    @property
    def probing(self) -> bool:
        with self._lock:
            return self._probing

    def blocked(self) -> bool:
        """Whether a call now would be refused (open and cooling down, or a probe in flight)."""
        with self._lock:
            return self._open_until is not None and (self._probing or time.monotonic() < self._open_until)

    def allow(self) -> bool:
        """May a call go out now? Refusals are counted; after the cool-down one probe is let through."""
        with self._lock:
            if self._open_until is None:
                return True
            if self._probing or time.monotonic() < self._open_until:
                self.counters.calls_skipped_open += 1
                self._skipped += 1
                return False
            self._probing = True
            return True

    def skip(self, n: int = 1) -> None:
        """Count calls not made because `blocked()` said so."""
        with self._lock:
            self.counters.calls_skipped_open += n
            self._skipped += n

    def record_success(self) -> None:
        with self._lock:
            was_open = self._open_until is not None
            down_s, skipped = time.monotonic() - self._opened_at, self._skipped
            self._failures, self._open_until, self._probing, self._skipped = 0, None, False, 0
        if was_open:
            log.warning("kv %s tier: %s answers again after %.1f s down; %d calls were skipped meanwhile",
                        self.name, self.where, down_s, skipped)

    def record_failure(self, exc: BaseException) -> None:
        now = time.monotonic()
        with self._lock:
            self._failures += 1
            if self._open_until is not None:  # the probe failed: another cool-down, no new line
                self._probing = False
                self._open_until = now + self.cooldown_s
                return
            if self._failures < self.failures_to_open:
                return
            self._open_until, self._opened_at, self._skipped = now + self.cooldown_s, now, 0
            self.counters.breaker_opens += 1
        last = redact_text(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        log.warning("kv %s tier: %s is unavailable (%d calls in a row failed, last: %s); not calling it for "
                    "%.0f s: lookups are misses (%s), writes are dropped", self.name, self.where,
                    self.failures_to_open, last, self.cooldown_s, TIER_UNAVAILABLE)


@dataclass
class RetryPolicy:
    """Exponential backoff on transient errors, bounded both in attempts and in seconds."""

    attempts: int = 4
    backoff_s: float = 0.05
    max_backoff_s: float = 2.0
    budget_s: float = 10.0

    def call(self, fn: Callable[[], T], what: str, counters: TierCounters | None = None,
             breaker: CircuitBreaker | None = None) -> T:
        """`fn()` with retries; with a breaker, nothing is called while it is open (TierUnavailable)
        and the call's outcome (answered, or gave up after its retries) is reported to it."""
        start = time.monotonic()
        delay = self.backoff_s
        for attempt in range(1, self.attempts + 1):
            if breaker is not None and not breaker.allow():
                if attempt > 1 and counters is not None:
                    counters.failures += 1  # gave up: the breaker opened during our retries
                raise TierUnavailable(f"{what}: the kv {breaker.name} tier at {breaker.where} is unavailable")
            t0 = time.monotonic()
            try:
                out = fn()
            except Exception as exc:
                if not is_transient(exc):
                    if breaker is not None:
                        breaker.record_success()  # the store answered (not found, denied...)
                    raise
                spent = time.monotonic() - start
                if counters is not None:
                    counters.fault_wait_s += time.monotonic() - t0
                    counters.timeouts += is_timeout(exc)
                # A failed probe of a half-open breaker ends the call: it opens for another cool-down.
                probe_failed = breaker is not None and breaker.probing
                if attempt == self.attempts or spent + delay > self.budget_s or probe_failed:
                    if counters is not None:
                        counters.failures += 1
                    if breaker is not None:
                        breaker.record_failure(exc)
                    raise
                log.info("kv object store: %s failed (%s), retry %d in %.2fs", what, redact_text(str(exc)),
                         attempt, delay)
                if counters is not None:
                    counters.retries += 1
                    counters.fault_wait_s += delay
                time.sleep(delay)
                delay = min(delay * 2, self.max_backoff_s)
            else:
                if breaker is not None:
                    breaker.record_success()
                return out
        raise AssertionError("unreachable")  # the loop returns or raises


_S3_PROTOCOLS = ("s3", "s3a")


def transport_options(url: str, storage_options: dict[str, Any] | None, *, connect_timeout_s: float = 5.0,
                      read_timeout_s: float = 20.0) -> dict[str, Any]:
    """fsspec options for `url` with bounded connect and read timeouts (s3fs: botocore's config).

    botocore's own retries are turned off (one attempt) so that RetryPolicy is the only retry
    layer: its attempts, time budget and counters then say what really happened. Options the
    caller set win.
    """
    opts = dict(storage_options or {})
    proto = url.split("://", 1)[0] if "://" in url else "file"
    if proto in _S3_PROTOCOLS:
        ck = dict(opts.get("config_kwargs") or {})
        ck.setdefault("connect_timeout", connect_timeout_s)
        ck.setdefault("read_timeout", read_timeout_s)
        ck.setdefault("retries", {"total_max_attempts": 1, "mode": "standard"})
        opts["config_kwargs"] = ck
    return opts


def open_store(url: str, storage_options: dict[str, Any] | None = None, *, connect_timeout_s: float = 5.0,
               read_timeout_s: float = 20.0) -> tuple[fsspec.AbstractFileSystem, str]:
    """(filesystem, root) for a store URL with the bounded transport of `transport_options`."""
    opts = transport_options(url, storage_options, connect_timeout_s=connect_timeout_s,
                             read_timeout_s=read_timeout_s)
    fs, root = fsspec.core.url_to_fs(url, **opts)
    if (url.split("://", 1)[0] in _S3_PROTOCOLS) and hasattr(fs, "retries"):
        # s3fs retries inside each call as well (5 times, with sleeps, uncounted); these options
        # are ours alone (the config_kwargs make the instance distinct), so take that down to one.
        fs.retries = 1
    return fs, root


def store_endpoint(url: str, storage_options: dict[str, Any] | None = None) -> str:
    """Where a store URL points, for messages: the URL, plus the S3 endpoint when one is set."""
    proto = url.split("://", 1)[0] if "://" in url else "file"
    endpoint = ""
    if proto in _S3_PROTOCOLS:
        endpoint = ((storage_options or {}).get("endpoint_url") or os.environ.get("AWS_ENDPOINT_URL_S3")
                    or os.environ.get("AWS_ENDPOINT_URL") or "")
    return redact(f"{url} (endpoint {endpoint})" if endpoint else url)
