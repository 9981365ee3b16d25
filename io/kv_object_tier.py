"""The durable tier: packed KV objects on any fsspec URL, with an index, retries and retention.

Layout under the store's root (one folder per model fingerprint, so a reader lists only its own
model's packs and gc/stats can still walk them all):

    objects/<fingerprint id>/<created ms>-<digest>.arrow   a pack: many blocks, one Arrow IPC file
    index/<fingerprint id>/<created ms>-<digest>.json      its index: key -> offset, length, checksums

Writes go object first, index second; the index file is what publishes a pack (Mooncake's
PutStart/PutEnd in two PUTs). Objects are immutable and never appended to.
"""

from __future__ import annotations

import atexit
import errno
import itertools
import json
import logging
import math
import os
import threading
import time
import uuid
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import fsspec
import torch
from fsspec.implementations.local import LocalFileSystem

from kvbatch.io.kv_block_format import (
    LAYOUT_VERSION,
    BlockCorrupt,
    BlockEntry,
    digest,
    pack_blocks,
    unpack_block,
)
from kvbatch.io.kv_index import IndexReader
from kvbatch.io.kv_requests import RequestCounter
from kvbatch.io.kv_rewrite import DEFAULT_REWRITE_BELOW, DEFAULT_REWRITE_GRACE_S, plan_rewrites, rewrite_segment
from kvbatch.io.kv_tiers import (
    IO_ERROR,
    MISSING,
    OBJECT_DELETED,
    TIER_UNAVAILABLE,
    Lookup,
    Tier,
    TierCounters,
    _nbytes,
    _unlink_quiet,
    check_key,
)
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


from kvbatch.io.kv_index_files import (  # noqa: F401 - the index file format; names kept importable here
    _DIGEST,
    _FPID_NAME,
    _MAX_DIMS,
    _MAX_FINGERPRINT_CHARS,
    _PACK_NAME,
    _PARTITION,
    IndexInvalid,
    PackManifest,
    _checked_entry,
    _checked_int,
    _checked_name,
    _pack_created_s,
    _shown,
    fingerprint_id,
)


class ObjectLayout:
    """Paths under the store's root. Objects: objects/<fpid>/<pack>.arrow; index: index/<fpid>/<pack>.json."""

    def __init__(self, fs: fsspec.AbstractFileSystem, root: str, requests: RequestCounter | None = None) -> None:
        self.fs = fs
        self.root = root.rstrip("/")
        self.local = isinstance(fs, LocalFileSystem)
        # Every request below is counted by the kind the store bills it as (kv_requests.py).
        self.requests = requests if requests is not None else RequestCounter()

    # -- requests: every call to the store goes through one of these, and is counted --

    def get(self, path: str) -> bytes:
        """A whole object (one GET)."""
        self.requests.add("GET")
        return self.fs.cat_file(path)

    def get_range(self, path: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of an object (one ranged GET)."""
        self.requests.add("GET")
        return self.fs.cat_file(path, start=start, end=end)

    def get_ranges(self, paths: list[str], starts: list[int], ends: list[int]) -> list[Any]:
        """Many ranges at once (one GET each; concurrent on async stores); an error per failed range."""
        self.requests.add("GET", len(paths))
        return list(self.fs.cat_ranges(paths, starts, ends, on_error="return"))

    def read_ranges(self, ranges: list[tuple[str, int, int]]) -> list[bytes | Exception]:
        """Bytes of each (path, start, end), ranges of one object that touch merged into one GET
        (concurrent on async stores); the error instead where its GET failed."""
        if not ranges:
            return []
        paths, starts, ends, members = coalesce_ranges(ranges)
        out: list[bytes | Exception] = [b""] * len(ranges)
        for r, start, idxs in zip(self.get_ranges(paths, starts, ends), starts, members):
            for i in idxs:
                out[i] = r if isinstance(r, Exception) else bytes(r[ranges[i][1] - start: ranges[i][2] - start])
        return out

    def size(self, path: str) -> int | None:
        """An object's size (one HEAD)."""
        self.requests.add("HEAD")
        return self.fs.size(path)

    def put_new(self, path: str, data: bytes) -> bool:
        """Create an object that must not exist yet: False (and nothing written) if it does.

        Create-only everywhere, so nothing is ever overwritten and two writers of the same name
        cannot interleave: on S3 a PUT with `If-None-Match: *` (s3fs `mode="create"`), on local
        disk a temp file hard-linked into place (`link` fails if the name exists). Names carry
        the digest of what they hold, so "it exists" means "the same bytes are already there".
        """
        self.requests.add("PUT")
        try:
            if self.local:
                parent = path.rsplit("/", 1)[0]
                self.fs.makedirs(parent, exist_ok=True)
                tmp = f"{parent}/.tmp-{uuid.uuid4().hex}"
                try:
                    self.fs.pipe_file(tmp, data)
                    os.link(tmp, path)
                finally:
                    _unlink_quiet(tmp)
            else:
                self.fs.pipe_file(path, data, mode="create")
        except FileExistsError:
            return False
        return True

    def object_path(self, fpid: str, pack: str) -> str:
        return f"{self.root}/objects/{self._names(fpid, pack)}.arrow"

    def index_path(self, fpid: str, pack: str) -> str:
        return f"{self.root}/index/{self._names(fpid, pack)}.json"

    def _names(self, fpid: str, pack: str) -> str:
        """`<fpid>/<pack>`, refused unless both are names kvbatch makes: no `..`, `/`, NUL or backslash
        can reach a path, whoever wrote the index file or the listing."""
        _checked_name(fpid, _FPID_NAME, f"kv store {self.root}", "fingerprint id", "32 hex digits")
        _checked_name(pack, _PACK_NAME, f"kv store {self.root}", "pack name", "a pack name (<created ms>-<32 hex>)")
        return f"{fpid}/{pack}"

    def owns(self, path: str) -> bool:
        """Whether `path` is one this layout builds: `<root>/{objects,index}/<fpid>/<pack>.{arrow,json}`,
        and, on local disk, whose folder really is inside the root (no symlinked folder leads out)."""
        if not path.startswith(self.root + "/"):
            return False
        parts = path[len(self.root) + 1:].split("/")
        ext = {"objects": ".arrow", "index": ".json", "usage": ".json", "generations": ".json",
               "partitions": ".arrow"}.get(parts[0]) if len(parts) == 3 else None
        if ext is None or not parts[2].endswith(ext):
            return False
        name = parts[2][: -len(ext)]
        if parts[0] == "partitions":  # "<generation>.<pp>"
            name, _, pp = name.partition(".")
            if not _PARTITION.fullmatch(pp):
                return False
        if not (_FPID_NAME.fullmatch(parts[1]) and _PACK_NAME.fullmatch(name)):
            return False
        if self.local:
            folder = os.path.realpath(os.path.dirname(path))
            if folder != os.path.join(os.path.realpath(self.root), parts[0], parts[1]):
                return False
        return True

    def remove(self, path: str) -> None:
        """Delete one pack's object or index file: only a path `owns` accepts (gc's only way to delete)."""
        if not self.owns(path):
            raise IndexInvalid(f"kv store {self.root}", "path", f"refusing to delete {_shown(path, 200)}: "
                               "not a pack file inside the store")
        self.requests.add("DELETE")
        self.fs.rm_file(path)

    def ls_names(self, folder: str) -> list[str]:
        """Base names in a folder (fresh listing, temp files left out); [] if it does not exist."""
        self.fs.invalidate_cache(folder)
        try:
            items = self.fs.ls(folder, detail=False)
        except FileNotFoundError:
            self.requests.add("LIST")
            return []
        # An object store returns at most 1,000 names per LIST request.
        self.requests.add("LIST", 1 if self.local else max(1, math.ceil(len(items) / 1000)))
        names = [p.rstrip("/").rsplit("/", 1)[-1] for p in items]
        return [n for n in names if n and not n.startswith(".tmp-")]

    def list_manifests(self) -> list[tuple[str, str]]:
        """(fpid, pack) of every published pack whose index file is well named."""
        return self.list_index()[0]

    def list_index(self) -> tuple[list[tuple[str, str]], list[str]]:
        """(fpid, pack) of every well-named index file, and the paths of entries named otherwise
        (skipped: never read, never deleted)."""
        return self._list("index", ".json")

    def list_objects(self) -> list[tuple[str, str]]:
        return self._list("objects", ".arrow")[0]

    # -- the persistent index (kv_index.py): generations and their key partitions --

    def generation_path(self, fpid: str, gen: str) -> str:
        return f"{self.root}/generations/{self._names(fpid, gen)}.json"

    def partition_path(self, fpid: str, gen: str, pp: str) -> str:
        if not _PARTITION.fullmatch(pp):
            raise IndexInvalid(f"kv store {self.root}", "partition", f"{_shown(pp)} is not two hex digits")
        return f"{self.root}/partitions/{self._names(fpid, gen)}.{pp}.arrow"

    def list_generations(self, fpid: str) -> list[str]:
        """Generation names of one model (one LIST)."""
        _checked_name(fpid, _FPID_NAME, f"kv store {self.root}", "fingerprint id", "32 hex digits")
        return [n[:-5] for n in self.ls_names(f"{self.root}/generations/{fpid}")
                if n.endswith(".json") and _PACK_NAME.fullmatch(n[:-5])]

    def list_partitions(self, fpid: str) -> list[tuple[str, str]]:
        """(generation, partition) of every partition file of one model (one LIST)."""
        _checked_name(fpid, _FPID_NAME, f"kv store {self.root}", "fingerprint id", "32 hex digits")
        out = []
        for n in self.ls_names(f"{self.root}/partitions/{fpid}"):
            gen, _, rest = n.partition(".")
            if _PACK_NAME.fullmatch(gen) and rest.endswith(".arrow") and _PARTITION.fullmatch(rest[:-6]):
                out.append((gen, rest[:-6]))
        return out

    def list_index_files(self, fpid: str, prefix: str) -> list[str]:
        """Pack names of one model's index files whose names start with `prefix` (leading digits of
        their time): on S3 one prefix LIST, which costs what it returns, not the folder's size."""
        _checked_name(fpid, _FPID_NAME, f"kv store {self.root}", "fingerprint id", "32 hex digits")
        folder = f"{self.root}/index/{fpid}"
        if self.local or not hasattr(self.fs, "find") or not prefix or \
                type(self.fs).__name__ != "S3FileSystem":
            names = self.ls_names(folder)
        else:
            self.fs.invalidate_cache(folder)
            self.requests.add("LIST")
            try:
                names = [p.rsplit("/", 1)[-1] for p in self.fs.find(folder, prefix=prefix, maxdepth=1)]
            except FileNotFoundError:
                names = []
        packs = [n[:-5] for n in names if n.endswith(".json") and n.startswith(prefix)]
        return [p for p in packs if _PACK_NAME.fullmatch(p)]

    def usage_path(self, fpid: str, name: str) -> str:
        """A usage file: which segments a reader used, and when (see `record_usage`)."""
        return f"{self.root}/usage/{self._names(fpid, name)}.json"

    def list_usage(self) -> list[tuple[str, str]]:
        return self._list("usage", ".json")[0]

    def _list(self, kind: str, ext: str) -> tuple[list[tuple[str, str]], list[str]]:
        good: list[tuple[str, str]] = []
        bad: list[str] = []
        for fpid in self.ls_names(f"{self.root}/{kind}"):
            if not _FPID_NAME.fullmatch(fpid):  # not descended into: a listing's name is not a path
                bad.append(f"{self.root}/{kind}/{fpid}")
                continue
            for name in self.ls_names(f"{self.root}/{kind}/{fpid}"):
                pack = name[: -len(ext)] if name.endswith(ext) else ""
                if _PACK_NAME.fullmatch(pack):
                    good.append((fpid, pack))
                else:
                    bad.append(f"{self.root}/{kind}/{fpid}/{name}")
        return good, bad


def coalesce_ranges(ranges: list[tuple[str, int, int]]) -> tuple[list[str], list[int], list[int], list[list[int]]]:
    """Merge (path, start, end) ranges that touch or overlap within one object into one request.

    Returns (paths, starts, ends, members): one merged range per request, and for each the
    indexes of the input ranges it covers. A prompt's chain is written contiguously, so its
    blocks come back in one GET."""
    order = sorted(range(len(ranges)), key=lambda i: (ranges[i][0], ranges[i][1]))
    paths: list[str] = []
    starts: list[int] = []
    ends: list[int] = []
    members: list[list[int]] = []
    for i in order:
        path, start, end = ranges[i]
        if paths and paths[-1] == path and start <= ends[-1]:
            ends[-1] = max(ends[-1], end)
            members[-1].append(i)
        else:
            paths.append(path)
            starts.append(start)
            ends.append(end)
            members.append([i])
    return paths, starts, ends, members


class StoreLayoutError(RuntimeError):
    """The store at this URL is in a layout this kvbatch does not read (an older one, or newer)."""


LAYOUT_MARKER = "kvbatch-kv-layout"  # JSON; no .json, so it is never taken for an index file
_LAYOUT_FORMAT = "kvbatch.kv-store"
_LAYOUT_BODY = json.dumps({"format": _LAYOUT_FORMAT, "layout_version": LAYOUT_VERSION}).encode()


def ensure_layout(layout: ObjectLayout, retry: RetryPolicy, counters: TierCounters | None = None,
                  breaker: CircuitBreaker | None = None, *, create: bool = True) -> int:
    """Check the store's layout marker (one GET); on a new, empty store write it (create-only).

    A store holding packs but no marker was written by a kvbatch before layout 2 (one pack and
    one index file per sequence per step): it is refused, with a message saying so and what to
    do, rather than read half-right. Returns the layout version (0 for an empty store left
    unmarked when `create` is False)."""
    marker = f"{layout.root}/{LAYOUT_MARKER}"

    def call(fn: Callable[[], T], what: str) -> T:
        return retry.call(fn, what, counters, breaker)

    for _ in range(2):  # a second pass reads the marker a concurrent writer just created
        try:
            raw = call(lambda: layout.get(marker), f"read {marker}")
        except FileNotFoundError:
            raw = None
        if raw is not None:
            try:
                d = json.loads(raw)
                version = d["layout_version"] if isinstance(d, dict) and d.get("format") == _LAYOUT_FORMAT else None
            except ValueError:
                version = None
            if version != LAYOUT_VERSION:
                raise StoreLayoutError(
                    f"kv store {redact(layout.root)} is in KV store layout {version!r}; this kvbatch reads layout "
                    f"{LAYOUT_VERSION}: use another store URL, or remove the store's contents")
            return LAYOUT_VERSION
        top = call(lambda: layout.ls_names(layout.root), f"list {layout.root}")
        if {"objects", "index"} & set(top):
            raise StoreLayoutError(
                f"kv store {redact(layout.root)} is in the old KV store layout 1 (packs without a "
                f"{LAYOUT_MARKER}); this kvbatch reads layout {LAYOUT_VERSION} (segments, create-only "
                "writes): use another store URL, or delete the old store (its blocks are recomputed on demand)")
        if not create:
            return 0
        if call(lambda: layout.put_new(marker, _LAYOUT_BODY), f"write {marker}"):
            return LAYOUT_VERSION
    raise StoreLayoutError(f"kv store {redact(layout.root)}: its layout marker vanished while being read")


# Tiers with writes still pending are flushed at exit, so a process that forgets flush() loses nothing.
_OPEN_TIERS: weakref.WeakSet[ObjectStoreTier] = weakref.WeakSet()


@atexit.register
def _flush_open_tiers() -> None:
    for tier in list(_OPEN_TIERS):
        try:
            tier.flush()
        except Exception as exc:  # noqa: BLE001 - exit must not raise; the blocks are recomputed on demand
            log.warning("kv %s tier: pending blocks lost at exit: %s", tier.name, redact_text(str(exc)))


class ObjectStoreTier(Tier):
    """The durable tier: packed objects on any fsspec URL (s3://, file://, memory://, a local path).

    Writes: the object first (whole), then its index file; only the index publishes it, so a
    reader never finds a block whose object is still being written. Two writers packing the
    same block both publish it; readers use either copy. Reads: byte ranges of the objects,
    verified block by block. The in-memory index refreshes from the store at most every
    `index_refresh_s` seconds when a key is not found, and drops packs that gc removed.
    """

    durable = True

    def __init__(
        self,
        url: str,
        storage_options: dict[str, Any] | None = None,
        *,
        fs: fsspec.AbstractFileSystem | None = None,
        pack_bytes: int = 64 * 2**20,
        ttl_s: float | None = None,
        max_bytes: int | None = None,
        retry: RetryPolicy | None = None,
        index_refresh_s: float = 5.0,
        flush_after_s: float = 30.0,
        name: str = "object",
        connect_timeout_s: float = 5.0,
        read_timeout_s: float = 20.0,
        breaker_failures: int = 3,
        breaker_cooldown_s: float = 30.0,
    ) -> None:
        super().__init__()
        self.name = name
        self.url = url
        self.breaker = CircuitBreaker(breaker_failures, breaker_cooldown_s, name=name,
                                      where=store_endpoint(url, storage_options), counters=self.counters)
        if fs is None:
            fs, root = open_store(url, storage_options, connect_timeout_s=connect_timeout_s,
                                  read_timeout_s=read_timeout_s)
        else:
            root = fs._strip_protocol(url)
        self.fs = fs
        self.layout = ObjectLayout(fs, root)
        if self.layout.local:
            fs.makedirs(root, exist_ok=True)
        self.pack_bytes = pack_bytes
        self.flush_after_s = flush_after_s
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes
        self.retry = retry or RetryPolicy()
        self.index_refresh_s = index_refresh_s
        self._manifests: dict[tuple[str, str], PackManifest] = {}
        self._where: dict[str, list[tuple[PackManifest, BlockEntry]]] = {}
        # Packs whose object vanished while their index file remained (deleted by hand, or a
        # gc elsewhere): refresh must not bring them back. gc removes such index files.
        self._dead: set[tuple[str, str]] = set()
        self._bad: set[tuple[str, str]] = set()  # (pack, key) copies that failed verification
        self._invalid: set[tuple[str, str]] = set()  # index files that failed validation (hostile or corrupt)
        self._invalid_names = 0  # entries of the index folder not named as the store names them
        self._last_refresh = -float("inf")
        # The write buffer (see put_many): blocks accepted but not yet in a segment, in the order
        # they came (a prompt's chain arrives in order, so it lands contiguous in its segment).
        self._pending: dict[str, tuple[str, torch.Tensor]] = {}  # key -> (fingerprint, tensor)
        # Pending blocks by chain: a run is one prompt's blocks in order, extended by each later
        # call that continues it (a chunked prefill saves a prompt over several steps, between
        # other prompts' saves), and written whole into one segment: one byte range per chain.
        # Runs are ordered by their last extension, so a size flush takes finished chains first.
        self._runs: OrderedDict[int, list[str]] = OrderedDict()
        self._tail_run: dict[str, int] = {}  # the last key of each run -> the run
        self._next_run = 0
        self._chain_parent: OrderedDict[str, str] = OrderedDict()  # key -> the key before it (expect_chain)
        self._chain_next: dict[str, str] = {}  # the other way: a run whose tail is here is still growing
        self._pending_bytes = 0
        self._pending_since: float | None = None  # monotonic time of the oldest pending block
        self._flush_lock = threading.Lock()  # one segment write at a time, in order
        self._timer: threading.Timer | None = None
        # Blocks read since the last usage file, by segment (their offsets): gc keeps them, and
        # rewrites a segment whose used blocks are few (kv_rewrite.py).
        self._used: dict[tuple[str, str], set[int]] = {}
        # Nothing is listed here: a reader loads the index partitions its keys need when it first
        # asks for them (kv_index.py), and decode, given each block's location by prefill's
        # manifests (add_locations), needs none at all.
        self._index = IndexReader(self.layout, self._call, name, index_refresh_s)
        self.check_layout()
        _OPEN_TIERS.add(self)

    def check_layout(self) -> None:
        """Refuse a store in another layout (StoreLayoutError); mark a new store with ours.

        A store that cannot be reached is not refused here: its calls fail and are counted like
        any other, and the breaker bounds what that costs."""
        try:
            ensure_layout(self.layout, self.retry, self.counters, self.breaker)
        except StoreLayoutError:
            raise
        except Exception as exc:  # noqa: BLE001 - an unreachable store is counted and bounded by the breaker
            log.info("kv %s tier: cannot check the layout of %s now: %s", self.name, store_endpoint(self.url),
                     redact_text(str(exc)))

    def _call(self, fn: Callable[[], T], what: str) -> T:
        """Every call to the store: retried, counted, and refused while the breaker is open."""
        return self.retry.call(fn, what, self.counters, self.breaker)

    # -- index --

    def refresh(self) -> None:
        """Load index files published since the last refresh; forget packs no longer listed."""
        try:
            listed_ok, bad_names = self._call(self.layout.list_index, "list index")
            listed = set(listed_ok)
        except TierUnavailable:
            return  # the breaker said so once; the index stays as it was
        except Exception as exc:
            # A transient fault is counted, and an outage gets the breaker's one line; a line
            # per failed listing would bury it.
            log.log(logging.INFO if is_transient(exc) else logging.WARNING, "kv %s tier: cannot list the index "
                    "at %s: %s", self.name, store_endpoint(self.url), redact_text(str(exc)))
            return
        with self._lock:
            known = {k for k, m in self._manifests.items() if not m.partial}  # stubs: read the whole file
        new: dict[tuple[str, str], PackManifest] = {}
        with self._lock:
            dead = set(self._dead)
            # Index files are create-only: one found invalid stays so, and is not read again.
            invalid = set(self._invalid)
        for fpid, pack in sorted(listed - known - dead - invalid):
            path = self.layout.index_path(fpid, pack)
            try:
                raw = self._call(lambda p=path: self.layout.get(p), f"read {path}")
                new[(fpid, pack)] = PackManifest.from_json(raw, source=path, where=(fpid, pack))
            except FileNotFoundError:
                continue  # removed by gc between list and read
            except TierUnavailable:
                break  # keep what was read; the next refresh after the cool-down reads the rest
            except IndexInvalid as exc:
                invalid.add((fpid, pack))
                log.warning("kv %s tier: invalid index file skipped: %s", self.name, exc)
            except Exception as exc:
                log.warning("kv %s tier: skipping unreadable index file %s: %s", self.name, path, exc)
        with self._lock:
            for k in known - listed:
                self._manifests.pop(k, None)
            self._manifests.update(new)
            self._invalid = invalid & listed
            self._invalid_names = len(bad_names)
            self._rebuild_where()
            self._last_refresh = time.monotonic()

    def _rebuild_where(self) -> None:
        where: dict[str, list[tuple[PackManifest, BlockEntry]]] = {}
        for m in sorted(self._manifests.values(), key=lambda m: m.created_s, reverse=True):
            for key, entry in m.entries.items():
                where.setdefault(key, []).append((m, entry))
        self._where = where

    def _add_manifest(self, m: PackManifest) -> None:
        with self._lock:
            self._dead.discard((m.fingerprint_id, m.pack))
            self._manifests[(m.fingerprint_id, m.pack)] = m
            for key, entry in m.entries.items():
                self._where.setdefault(key, []).insert(0, (m, entry))

    def _drop_pack(self, m: PackManifest) -> None:
        with self._lock:
            self._dead.add((m.fingerprint_id, m.pack))
            if self._manifests.pop((m.fingerprint_id, m.pack), None) is not None:
                self._rebuild_where()

    def _maybe_refresh(self, keys: list[str], fingerprint: str) -> None:
        """Ask the persistent index about keys with no known copy of this model: it reads the
        partitions they fall in once, and the recent per-writer files at most every
        `index_refresh_s` (kv_index.IndexReader); never the whole store."""
        with self._lock:
            unknown = [k for k in keys if not any(m.fingerprint == fingerprint for m, _ in self._where.get(k, ()))]
        if not unknown:
            return
        try:
            found = self._index.find(fingerprint, unknown, self._known)
        except TierUnavailable:
            return  # the breaker said so once
        except Exception as exc:  # noqa: BLE001 - a lookup that cannot ask is a miss, counted by the call
            log.log(logging.INFO if is_transient(exc) else logging.WARNING, "kv %s tier: cannot read the index "
                    "at %s: %s", self.name, store_endpoint(self.url), redact_text(str(exc)))
            return
        self._merge(found)

    def _known(self, pack: tuple[str, str]) -> bool:
        with self._lock:
            return pack in self._dead or pack in self._invalid or (
                pack in self._manifests and not self._manifests[pack].partial)

    def _merge(self, manifests: list[PackManifest]) -> None:
        """Add what the index (or a manifest's locations) says: whole packs, or some of their entries."""
        with self._lock:
            for m in manifests:
                k = (m.fingerprint_id, m.pack)
                if k in self._dead:
                    continue
                have = self._manifests.get(k)
                if have is None:
                    self._manifests[k] = have = m
                    fresh = dict(m.entries)
                else:
                    fresh = {key: e for key, e in m.entries.items() if key not in have.entries}
                    have.entries.update(fresh)
                    have.partial = have.partial and m.partial
                for key, e in fresh.items():
                    self._where.setdefault(key, []).append((have, e))

    def add_locations(self, manifests: list[PackManifest]) -> None:
        """Where blocks are, as prefill's manifests say (kv_index.parse_location): decode reads them
        with no index request. A wrong location fails verification and is a miss, never wrong data."""
        self._merge(manifests)

    def locations(self, keys: list[str], fingerprint: str) -> list[tuple[PackManifest, BlockEntry] | None]:
        """The newest verified-or-unread copy of each key of this model that is durable (in a
        published segment), or None: what prefill writes into its manifests after flush()."""
        self._maybe_refresh(keys, fingerprint)
        out = []
        for key in keys:
            locs = [(m, e) for m, e in self._locations(key) if m.fingerprint == fingerprint]
            out.append(max(locs, key=lambda me: me[0].created_s) if locs else None)
        return out

    def _locations(self, key: str) -> list[tuple[PackManifest, BlockEntry]]:
        with self._lock:
            return [(m, e) for m, e in self._where.get(key, ()) if (m.pack, key) not in self._bad]

    def _mark_bad(self, m: PackManifest, key: str) -> None:
        """Stop using a copy that failed verification, so contains() says no and put rewrites it."""
        with self._lock:
            self._bad.add((m.pack, key))

    def contains(self, keys: list[str], fingerprint: str) -> list[bool]:
        if self.breaker.blocked():  # unreachable: nothing here can be loaded, so plan no loads
            self.breaker.skip()
            return [False] * len(keys)
        with self._lock:
            pending = [self._pending.get(k, ("", None))[0] == fingerprint for k in keys]
        if all(pending):
            return pending
        self._maybe_refresh([k for k, p in zip(keys, pending) if not p], fingerprint)
        return [p or any(m.fingerprint == fingerprint for m, _ in self._locations(k)) for k, p in zip(keys, pending)]

    # -- reads --

    def get_many(self, keys: list[str], fingerprint: str, *, _again: bool = False) -> list[Lookup]:
        with self._lock:
            buffered = {k: self._pending[k][1] for k in keys if self._pending.get(k, ("", None))[0] == fingerprint}
        if buffered:  # accepted but not yet flushed: served from the buffer, no request made
            rest = iter(self.get_many([k for k in keys if k not in buffered], fingerprint)
                        if len(buffered) < len(keys) else [])
            out = []
            for k in keys:
                if k in buffered:
                    self.counters.hits += 1
                    out.append(Lookup(buffered[k].clone()))
                else:
                    out.append(next(rest))
            return out
        if self.breaker.blocked():
            self.breaker.skip()
            return [self._miss(key, TIER_UNAVAILABLE) for key in keys]
        self._maybe_refresh(keys, fingerprint)
        plans: list[list[tuple[PackManifest, BlockEntry]]] = []
        foreign: list[str] = []  # fingerprint of a copy stored by another model, if that is all there is
        for key in keys:
            locs = self._locations(key)
            plans.append([(m, e) for m, e in locs if m.fingerprint == fingerprint])
            foreign.append(locs[0][0].fingerprint if locs and not plans[-1] else "")
        # First attempt for every key in one batched range fetch (concurrent on async stores).
        fetched = iter(self._fetch_ranges([p[0] for p in plans if p]))
        deleted: dict[str, str] = {}  # keys whose every copy was gone: asked of the index again
        results: list[Lookup | None] = []
        for key, plan, other in zip(keys, plans, foreign):
            if not plan:
                results.append(self._miss(key, "fingerprint", f"stored by {other!r}") if other else self._miss(key, MISSING))
                continue
            tensor, reason, detail = None, "", ""
            for i, (m, entry) in enumerate(plan):
                raw_or_exc = next(fetched) if i == 0 else self._fetch_ranges([(m, entry)])[0]
                tensor, reason, detail = self._decode(raw_or_exc, m, entry, fingerprint)
                if tensor is not None:
                    break
                if reason not in (IO_ERROR, OBJECT_DELETED, TIER_UNAVAILABLE):
                    self._mark_bad(m, key)
            if tensor is not None:
                self.counters.hits += 1
                with self._lock:
                    self._used.setdefault((m.fingerprint_id, m.pack), set()).add(entry.offset)
                results.append(Lookup(tensor))
            elif reason == OBJECT_DELETED and not _again:
                results.append(None)  # asked again below
                deleted[key] = detail
            else:
                results.append(self._miss(key, reason, detail))
        lost = [i for i, r in enumerate(results) if r is None]
        if lost:
            # Every known copy was deleted: gc rewrote the segment a manifest (or a stale index)
            # named, and deleted it after its grace. The index names the new copy, if any.
            self._maybe_refresh([keys[i] for i in lost], fingerprint)
            again = [i for i in lost if any(m.fingerprint == fingerprint for m, _ in self._locations(keys[i]))]
            for i, r in zip(again, self.get_many([keys[i] for i in again], fingerprint, _again=True)):
                results[i] = r
            for i in set(lost) - set(again):
                results[i] = self._miss(keys[i], OBJECT_DELETED, deleted[keys[i]])
        return [r for r in results if r is not None]

    def _miss(self, key: str, reason: str, detail: str = "") -> Lookup:
        if reason == IO_ERROR and self.breaker.blocked():
            # The fetch that gave up opened the breaker, which says so in one line: a line per
            # block would bury it (decode, handed its blocks' locations, fetches before any lookup).
            self.counters.misses[reason] += 1
            return Lookup(None, reason)
        return super()._miss(key, reason, detail)

    def _fetch_ranges(self, spans: list[tuple[PackManifest, BlockEntry]]) -> list[bytes | Exception]:
        """Fetch byte ranges; each result is the bytes or the exception left after retries.

        Neighbouring ranges of one object (a prompt's chain, written contiguously) are coalesced
        into one request, and each block's bytes are cut out of it afterwards."""
        if not spans:
            return []
        paths, starts, ends, members = coalesce_ranges(
            [(self.layout.object_path(m.fingerprint_id, m.pack), e.offset, e.offset + e.length) for m, e in spans])
        merged = self._fetch_merged(paths, starts, ends)
        out: list[bytes | Exception] = [b""] * len(spans)
        for r, start, idxs in zip(merged, starts, members):
            for i in idxs:
                entry = spans[i][1]
                out[i] = r if isinstance(r, Exception) else bytes(r[entry.offset - start: entry.offset - start + entry.length])
        return out

    def _fetch_merged(self, paths: list[str], starts: list[int], ends: list[int]) -> list[bytes | Exception]:
        if not self.breaker.allow():
            return [TierUnavailable(f"the kv {self.name} tier is unavailable")] * len(paths)
        t0 = time.perf_counter()
        try:
            out: list[Any] = self.layout.get_ranges(paths, starts, ends)
        except Exception as exc:  # the whole batch failed; retry range by range below
            out = [exc] * len(paths)
        failed = [r for r in out if isinstance(r, Exception) and is_transient(r)]
        if failed:
            # A closed breaker hears the outcome from the single-range retries below; a failed
            # probe reopens it now (those retries are then refused at once).
            self.counters.fault_wait_s += time.perf_counter() - t0
            self.counters.timeouts += sum(is_timeout(r) for r in failed)
            if self.breaker.probing:
                self.breaker.record_failure(failed[0])
        else:
            self.breaker.record_success()
        for i, r in enumerate(out):
            if isinstance(r, Exception) and is_transient(r):
                self.counters.retries += 1
                out[i] = self._fetch_one(paths[i], starts[i], ends[i])
        self.counters.read_s += time.perf_counter() - t0
        for r in out:
            if isinstance(r, bytes | bytearray):
                self.counters.bytes_read += len(r)
        return out

    def _fetch_one(self, path: str, start: int, end: int) -> bytes | Exception:
        try:
            return self._call(lambda: self.layout.get_range(path, start, end), f"read {path}[{start}:{end}]")
        except Exception as exc:
            return exc

    def _decode(
        self, raw: bytes | Exception, m: PackManifest, entry: BlockEntry, fingerprint: str
    ) -> tuple[torch.Tensor | None, str, str]:
        path = self.layout.object_path(m.fingerprint_id, m.pack)
        if m.fingerprint != fingerprint:
            return None, "fingerprint", f"{path} belongs to fingerprint {m.fingerprint!r}"
        if isinstance(raw, Exception):
            return (None, *self._classify_read_error(raw, m, entry, path))
        try:
            return unpack_block(bytes(raw), entry, fingerprint), "", ""
        except BlockCorrupt as exc:
            return None, exc.reason, f"{path}: {exc.detail}"

    def _classify_read_error(self, exc: Exception, m: PackManifest, entry: BlockEntry, path: str) -> tuple[str, str]:
        if isinstance(exc, TierUnavailable):
            return TIER_UNAVAILABLE, ""
        if isinstance(exc, FileNotFoundError):
            self._drop_pack(m)  # gc (or someone) removed it; stop pointing readers at it
            return OBJECT_DELETED, f"{path} is gone"
        if is_transient(exc):
            return IO_ERROR, f"{path}: gave up after retries: {redact_text(repr(exc))}"
        # A range past the end is refused by some stores: find out whether the object shrank.
        try:
            size = self._call(lambda: self.layout.size(path), f"size {path}")
        except FileNotFoundError:
            self._drop_pack(m)
            return OBJECT_DELETED, f"{path} is gone"
        except Exception:
            return IO_ERROR, f"{path}: {exc!r}"
        if size is not None and size < entry.offset + entry.length:
            return "truncated", f"{path} has {size} bytes, block ends at {entry.offset + entry.length}"
        return IO_ERROR, f"{path}: {exc!r}"

    # -- writes --

    def put_many(self, blocks: list[tuple[str, torch.Tensor]], fingerprint: str) -> int:
        """Accept the blocks the store lacks into the write buffer; return how many were accepted.

        The buffer gathers blocks across calls (sequences, engine steps) and writes them as big
        segments: a segment goes out as soon as `pack_bytes` are pending, and the rest on `flush()`
        (the end of a prefill shard), when the oldest pending block is `flush_after_s` old, and at
        exit. Object stores charge per request and are slow at small objects: one PUT per segment
        of tens of MB, instead of one per sequence per step. A write that fails is counted
        (`write_errors`, `blocks_failed`) and logged, never raised; those blocks are recomputed
        by whoever needs them."""
        for key, _ in blocks:
            check_key(key)
        present = self.contains([k for k, _ in blocks], fingerprint)
        accepted = 0
        with self._lock:
            run: list[str] | None = None
            for (key, tensor), have in zip(blocks, present):
                parent = self._chain_parent.pop(key, None)
                if parent is not None and self._chain_next.get(parent) == key:
                    del self._chain_next[parent]
                if have or key in self._pending:
                    continue
                if run is None:  # the call's blocks go to the pending chain they continue, or a new one
                    rid = self._tail_run.pop(parent, None) if parent else None
                    if rid is None or self._pending[parent][0] != fingerprint:
                        rid, self._next_run = self._next_run, self._next_run + 1
                        self._runs[rid] = []
                    self._runs.move_to_end(rid)
                    run = self._runs[rid]
                run.append(key)
                self._pending[key] = (fingerprint, tensor.detach().to("cpu"))
                self._pending_bytes += _nbytes(tensor)
                accepted += 1
            if run:
                self._tail_run[run[-1]] = rid
            if self._pending and self._pending_since is None:
                self._pending_since = time.monotonic()
            full = self._pending_bytes >= self.pack_bytes
            overdue = self._pending_since is not None and time.monotonic() - self._pending_since >= self.flush_after_s
        if full or overdue:
            self.flush(full_only=not overdue)
        elif accepted:
            self._arm_timer()
        return accepted

    def expect_chain(self, keys: list[str]) -> None:
        """`keys` are one prompt's chain, in order, to be put over several calls (a chunked prefill):
        a call whose first block continues a pending chain is appended to it, so the chain stays
        contiguous in one segment. Advisory: remembered for the last 2^20 keys."""
        with self._lock:
            for parent, key in itertools.pairwise(keys):
                self._chain_parent[key] = parent
                self._chain_parent.move_to_end(key)
                self._chain_next[parent] = key
            while len(self._chain_parent) > 1 << 20:
                key, parent = self._chain_parent.popitem(last=False)
                if self._chain_next.get(parent) == key:
                    del self._chain_next[parent]

    def pending(self) -> tuple[int, int]:
        """(blocks, bytes) accepted but not yet written."""
        with self._lock:
            return len(self._pending), self._pending_bytes

    def _arm_timer(self) -> None:
        """Flush after `flush_after_s` even if no more writes come (a daemon timer, one at a time)."""
        with self._lock:
            if self._timer is not None or not self._pending or not math.isfinite(self.flush_after_s):
                return
            self._timer = threading.Timer(self.flush_after_s, self._timed_flush)
            self._timer.daemon = True
            self._timer.start()

    def _timed_flush(self) -> None:
        with self._lock:
            self._timer = None
        self.flush()

    def flush(self, *, full_only: bool = False) -> int:
        """Write pending blocks as segments of about `pack_bytes`; return how many were written.

        `full_only` writes only segments that reach `pack_bytes` and keeps the rest pending."""
        written = 0
        with self._flush_lock:
            while True:
                with self._lock:
                    group: list[tuple[str, str, torch.Tensor]] = []
                    taken: list[tuple[int, int]] = []  # (run, how many of its leading blocks)
                    size = 0
                    runs = list(self._runs.items())  # whole chains, least recently extended first
                    if full_only and self._pending_bytes < 2 * self.pack_bytes:
                        # A size flush leaves the chains still being prefilled (their next block is
                        # expected) in the buffer, unless it has grown to twice a segment.
                        runs = [(rid, run) for rid, run in runs if run[-1] not in self._chain_next]
                    for rid, run in runs:
                        fp = self._pending[run[0]][0]
                        if group and (fp != group[0][1] or size >= self.pack_bytes):
                            break
                        n = run_bytes = 0
                        for key in run:  # a chain longer than a segment is cut at pack_bytes
                            if n and run_bytes >= self.pack_bytes:
                                break
                            tensor = self._pending[key][1]
                            group.append((key, fp, tensor))
                            run_bytes += _nbytes(tensor)
                            n += 1
                        taken.append((rid, n))
                        size += run_bytes
                    if not group or (full_only and size < self.pack_bytes):
                        break
                # Still pending while it is written: readers of this process are served from the
                # buffer until the segment is published.
                written += self._write_pack([(k, t) for k, _, t in group], group[0][1])
                with self._lock:
                    for rid, n in taken:
                        run = self._runs[rid]
                        if n < len(run):
                            del run[:n]  # the rest of a long chain stays pending, still extendable
                        else:
                            del self._runs[rid]
                            self._tail_run.pop(run[-1], None)
                    for key, _, tensor in group:
                        if self._pending.pop(key, None) is not None:
                            self._pending_bytes -= _nbytes(tensor)
                    if not self._pending:
                        self._pending_since = None
                    elif not full_only:
                        self._pending_since = time.monotonic()
        if not full_only:
            with self._lock:
                timer, self._timer = self._timer, None
            if timer is not None:
                timer.cancel()
            self.record_usage()
        else:
            self._arm_timer()
        return written

    def record_usage(self, now: float | None = None) -> int:
        """Write which segments this reader used since the last call (one create-only usage file per
        model), so that `kv gc --unused-days` keeps them; returns how many segments it named.

        One small file per reader per flush (a decode's end), never a write per read; gc folds
        them into one. A failure is logged: the segments then look unused for that one use."""
        with self._lock:
            used, self._used = self._used, {}
        if not used:
            return 0
        now = time.time() if now is None else now
        by_fpid: dict[str, dict[str, set[int]]] = {}
        for (fpid, pack), offsets in sorted(used.items()):
            by_fpid.setdefault(fpid, {})[pack] = offsets
        for fpid, packs in by_fpid.items():
            path = self.layout.usage_path(fpid, f"{int(now * 1000):013d}-{uuid.uuid4().hex}")
            body = UsageFile({p: now for p in packs},
                             {p: {o: now for o in offsets} for p, offsets in packs.items()}).to_json()
            try:
                self._call(lambda p=path, b=body: self.layout.put_new(p, b), f"write {path}")
            except Exception as exc:  # noqa: BLE001 - usage is advisory; the read itself succeeded
                log.warning("kv %s tier: cannot record the use of %d segments: %s", self.name, len(packs),
                            redact_text(str(exc)))
        return len(used)

    def close(self) -> None:
        """Flush what is pending; the tier stays usable."""
        self.flush()

    def _write_pack(self, group: list[tuple[str, torch.Tensor]], fingerprint: str) -> int:
        data, entries = pack_blocks(fingerprint, group)
        created_s = time.time()
        pack = f"{int(created_s * 1000):013d}-{digest(data)}"
        fpid = fingerprint_id(fingerprint)
        manifest = PackManifest(pack, fingerprint, fpid, len(data), created_s, entries)
        obj, idx = self.layout.object_path(fpid, pack), self.layout.index_path(fpid, pack)
        try:
            # Create-only, object first: the index file publishes it. A name that exists holds the
            # same bytes (the name carries their digest), so "already there" is success.
            self._call(lambda: self.layout.put_new(obj, data), f"write {obj}")
            self._call(lambda: self.layout.put_new(idx, manifest.to_json()), f"write {idx}")
        except Exception as exc:
            self.counters.write_errors += 1
            self.counters.blocks_failed += len(entries)
            if not isinstance(exc, TierUnavailable):  # an open breaker has said so in one line
                log.warning("kv %s tier: cannot publish pack %s (%d blocks): %s", self.name, obj, len(entries),
                            redact_text(str(exc)))
            return 0
        self._add_manifest(manifest)
        self.counters.blocks_written += len(entries)
        self.counters.bytes_written += len(data)
        return len(entries)

    # -- size, retention --

    def resident(self) -> tuple[int, int]:
        with self._lock:
            return len(self._where), sum(m.object_bytes for m in self._manifests.values())

    def stats(self) -> dict[str, Any]:
        with self._lock:
            invalid = len(self._invalid) + self._invalid_names + self._index.invalid_files
            pending_blocks, pending_bytes = len(self._pending), self._pending_bytes
        return {**super().stats(), "invalid_index_files": invalid, "object_requests": self.layout.requests.snapshot(),
                "blocks_pending": pending_blocks, "kv_bytes_pending": pending_bytes}

    def gc(self, now: float | None = None) -> dict[str, Any]:
        """Apply this tier's TTL and size policy to the whole store, then refresh the index."""
        out = gc_objects(self.layout, self.ttl_s, self.max_bytes, now=now, retry=self.retry)
        self.refresh()
        return out


@dataclass
class UsageFile:
    """When segments, and which of their blocks, were last used. Written by readers, folded by gc.

    `last_used`: `{pack name: seconds}`, the segment's latest use. `blocks`: `{pack name: {block
    offset: seconds}}`, which blocks were read: gc rewrites a segment whose used blocks are few
    (kv_rewrite.py). A pack named in `last_used` without `blocks` (a reader before block-level
    usage) counts as a use of every block it holds."""

    last_used: dict[str, float]
    blocks: dict[str, dict[int, float]] = field(default_factory=dict)

    def to_json(self) -> bytes:
        blocks = {p: sorted([o, t] for o, t in offs.items()) for p, offs in self.blocks.items()}
        return json.dumps({"format": "kvbatch.kv-usage", "version": LAYOUT_VERSION,
                           "packs": self.last_used, "blocks": blocks}, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes, source: str) -> UsageFile:
        try:
            d = json.loads(raw)
        except (ValueError, RecursionError):
            raise IndexInvalid(source, "$", "not JSON") from None
        if not isinstance(d, dict) or d.get("format") != "kvbatch.kv-usage" or d.get("version") != LAYOUT_VERSION:
            raise IndexInvalid(source, "format", "not a kvbatch usage file of this layout")
        packs = d.get("packs")
        if not isinstance(packs, dict):
            raise IndexInvalid(source, "packs", f"must be an object, got {_shown(packs)}")
        out: dict[str, float] = {}
        for pack, t in packs.items():
            _checked_name(pack, _PACK_NAME, source, "packs", "a pack name (<created ms>-<32 hex>)")
            out[pack] = _checked_time(t, source, f"packs.{pack}")
        raw_blocks = d.get("blocks", {})
        if not isinstance(raw_blocks, dict):
            raise IndexInvalid(source, "blocks", f"must be an object, got {_shown(raw_blocks)}")
        blocks: dict[str, dict[int, float]] = {}
        for pack, pairs in raw_blocks.items():
            if pack not in out:
                raise IndexInvalid(source, "blocks", f"{_shown(pack)} is not one of the file's packs")
            if not isinstance(pairs, list):
                raise IndexInvalid(source, f"blocks.{pack}", f"must be a list of [offset, time], got {_shown(pairs)}")
            offs: dict[int, float] = {}
            for i, pair in enumerate(pairs):
                if not isinstance(pair, list) or len(pair) != 2:
                    raise IndexInvalid(source, f"blocks.{pack}.{i}", f"must be [offset, time], got {_shown(pair)}")
                offset = _checked_int(pair[0], source, f"blocks.{pack}.{i}.offset", 0)
                offs[offset] = max(offs.get(offset, 0.0), _checked_time(pair[1], source, f"blocks.{pack}.{i}.time"))
            blocks[pack] = offs
        return cls(out, blocks)


def _checked_time(t: Any, source: str, field_name: str) -> float:
    if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t) or not 0 <= t <= 1e15:
        raise IndexInvalid(source, field_name, f"must be a time in seconds, got {_shown(t)}")
    return float(t)


@dataclass
class UsageSeen:
    """What gc read from every usage file: last use per segment, per block, and whole-segment uses."""

    segments: dict[tuple[str, str], float] = field(default_factory=dict)  # (fpid, pack) -> latest use
    blocks: dict[tuple[str, str], dict[int, float]] = field(default_factory=dict)  # -> {offset: time}
    whole: dict[tuple[str, str], float] = field(default_factory=dict)  # uses of every block (older readers)
    files: list[str] = field(default_factory=list)  # the usage files read (folded afterwards)
    invalid: int = 0

    def block_last(self, m: PackManifest, offset: int) -> float:
        """A block's last use: its segment's write, its own reads, or a whole-segment use."""
        k = (m.fingerprint_id, m.pack)
        return max(m.created_s, self.whole.get(k, 0.0), self.blocks.get(k, {}).get(offset, 0.0))


USAGE_RELISTS = 8  # listings of the usage files one gc makes while another gc keeps folding them


def read_usage(layout: ObjectLayout, retry: RetryPolicy) -> UsageSeen:
    """Every usage file of the store, merged (latest use wins); invalid ones counted and left alone.

    A file listed but gone when read was folded by a gc running at the same time, and its content
    is in the fold that gc wrote *before* deleting it, but that fold may postdate this listing: so
    the folder is listed again and the files not read yet are read, until a pass loses none. A gc
    that went on without the fold would see a used segment as unused and delete it."""
    seen = UsageSeen()
    read: set[tuple[str, str]] = set()
    for _ in range(USAGE_RELISTS):
        lost = False
        for fpid, name in retry.call(layout.list_usage, "list usage"):
            if (fpid, name) in read:
                continue
            read.add((fpid, name))
            lost |= not _read_usage_file(layout, retry, seen, fpid, name)
        if not lost:
            return seen
    raise RuntimeError(f"kv gc: usage files kept vanishing across {USAGE_RELISTS} listings (another gc "
                       "folding them?); nothing was deleted, run gc again")


def _read_usage_file(layout: ObjectLayout, retry: RetryPolicy, seen: UsageSeen, fpid: str, name: str) -> bool:
    """Merge one usage file into ``seen``; False if it was gone (folded by another gc meanwhile)."""
    path = layout.usage_path(fpid, name)
    try:
        usage = UsageFile.from_json(retry.call(lambda p=path: layout.get(p), f"read {path}"), path)
    except FileNotFoundError:
        return False
    except IndexInvalid as exc:
        seen.invalid += 1
        log.warning("kv gc: invalid usage file skipped: %s", exc)
        return True
    seen.files.append(path)
    for pack, t in usage.last_used.items():
        k = (fpid, pack)
        seen.segments[k] = max(seen.segments.get(k, 0.0), t)
        if pack not in usage.blocks:
            seen.whole[k] = max(seen.whole.get(k, 0.0), t)
    for pack, offs in usage.blocks.items():
        mine = seen.blocks.setdefault((fpid, pack), {})
        for offset, t in offs.items():
            mine[offset] = max(mine.get(offset, 0.0), t)
    return True


@dataclass
class IndexScan:
    """What one pass over a store's index found: the valid packs and what was skipped."""

    manifests: list[PackManifest]
    invalid: int  # hostile or corrupt: a bad name, bad JSON or a field out of shape (never deleted through)
    unreadable: int  # could not be read (I/O errors after retries); left in place


def scan_index(layout: ObjectLayout, retry: RetryPolicy, what: str) -> IndexScan:
    """Read and validate every index file of the store; an invalid one is skipped, counted and logged."""
    listed, bad_names = retry.call(layout.list_index, "list index")
    scan = IndexScan([], len(bad_names), 0)
    for path in bad_names:
        log.warning("kv %s: %s is not a name the store makes: skipped, never deleted", what, _shown(path, 200))
    for fpid, pack in listed:
        path = layout.index_path(fpid, pack)
        try:
            raw = retry.call(lambda p=path: layout.get(p), f"read {path}")
            scan.manifests.append(PackManifest.from_json(raw, source=path, where=(fpid, pack)))
        except FileNotFoundError:
            continue  # removed between list and read
        except IndexInvalid as exc:
            scan.invalid += 1
            log.warning("kv %s: invalid index file skipped, never deleted through: %s", what, exc)
        except Exception as exc:
            scan.unreadable += 1
            log.warning("kv %s: unreadable index file %s left in place: %s", what, path, exc)
    return scan


def gc_objects(
    layout: ObjectLayout,
    ttl_s: float | None,
    max_bytes: int | None,
    *,
    now: float | None = None,
    orphan_grace_s: float = 3600.0,
    retry: RetryPolicy | None = None,
    unused_s: float | None = None,
    rewrite_below: float = DEFAULT_REWRITE_BELOW,
    rewrite_grace_s: float = DEFAULT_REWRITE_GRACE_S,
) -> dict[str, Any]:
    """Delete packs older than `ttl_s`, those unused for `unused_s`, then the oldest packs until at
    most `max_bytes` remain; with `unused_s`, rewrite the mostly-dead rest (kv_rewrite.py).

    TTL counts from the write; `unused_s` from the last use (a write, or a read a decode recorded),
    block by block. Each pack's index file goes first, then its object, so a fresh reader never
    meets a deleted object; a reader with a stale index gets an "object_deleted" miss. Objects
    without an index file (a writer died between the two writes) are removed once older than
    `orphan_grace_s`. A segment whose live blocks hold less than `rewrite_below` of its block
    bytes is copied into a new segment, and deleted once the copy is `rewrite_grace_s` old.

    Only paths the layout builds from validated names are deleted (`ObjectLayout.remove`): an
    index file that fails validation is counted in `invalid_index_files` and left alone, as is
    everything it names.
    """
    retry = retry or RetryPolicy()
    now = time.time() if now is None else now
    scan = scan_index(layout, retry, "gc")
    manifests = scan.manifests
    refused = 0

    def remove(p: str) -> bool:
        nonlocal refused
        if not layout.owns(p):  # e.g. a folder of the store that is a symlink leading out of it
            refused += 1
            log.warning("kv gc: refusing to delete %s: not a pack file inside the store", _shown(p, 200))
            return False
        try:
            retry.call(lambda: layout.remove(p), f"delete {p}")
        except FileNotFoundError:
            return False
        return True

    def delete(m: PackManifest) -> None:
        for p in (layout.index_path(m.fingerprint_id, m.pack), layout.object_path(m.fingerprint_id, m.pack)):
            remove(p)

    # Retention by last use: a segment's last use is the latest of its write and every recorded
    # read of its blocks; one used within `unused_s` is kept whatever its age.
    usage = read_usage(layout, retry) if unused_s is not None else UsageSeen()

    def last(m: PackManifest) -> float:
        return max(m.created_s, usage.segments.get((m.fingerprint_id, m.pack), 0.0))

    expired = [m for m in manifests if ttl_s is not None and now - m.created_s > ttl_s]
    unused = [m for m in manifests if unused_s is not None and m not in expired and now - last(m) > unused_s]
    expired += unused
    kept = sorted((m for m in manifests if m not in expired), key=lambda m: m.created_s)
    oversize: list[PackManifest] = []
    total = sum(m.object_bytes for m in kept)
    while max_bytes is not None and total > max_bytes and kept:
        m = kept.pop(0)
        oversize.append(m)
        total -= m.object_bytes
    for m in expired + oversize:
        delete(m)

    published = {(m.fingerprint_id, m.pack) for m in manifests}
    objects = retry.call(layout.list_objects, "list objects")
    # Index files whose object is gone serve only misses: remove them.
    present = set(objects)
    dangling = [m for m in kept if (m.fingerprint_id, m.pack) not in present]
    for m in dangling:
        delete(m)
        total -= m.object_bytes
    kept = [m for m in kept if m not in dangling]
    rw = _rewrite_mostly_dead(layout, retry, kept, usage, now, unused_s, rewrite_below, rewrite_grace_s, delete)
    gone, new = rw.pop("gone"), rw.pop("new")
    kept = [m for m in kept if (m.fingerprint_id, m.pack) not in gone] + new
    total = sum(m.object_bytes for m in kept)
    # Fold the usage files read into one per model (created first, then the old ones deleted: a gc
    # that dies in between leaves both, and the last use is the max either way).
    folded = 0
    if usage.files:
        _fold_usage(layout, retry, kept, usage, now)
        for path in usage.files:
            folded += remove(path)
    orphans = 0
    for fpid, pack in objects:
        created = _pack_created_s(pack)
        if (fpid, pack) in published or created is None or now - created <= orphan_grace_s:
            continue
        orphans += remove(layout.object_path(fpid, pack))
    return {
        "packs_expired": len(expired) - len(unused),
        "packs_unused": len(unused),
        "usage_files_folded": folded,
        "invalid_usage_files": usage.invalid,
        "packs_evicted_for_size": len(oversize),
        "blocks_deleted": sum(len(m.entries) for m in expired + oversize),
        "kv_bytes_deleted": sum(m.object_bytes for m in expired + oversize),
        "orphan_objects_deleted": orphans,
        "dangling_index_files_deleted": len(dangling),
        "unreadable_index_files": scan.unreadable,
        "invalid_index_files": scan.invalid,
        "deletes_refused": refused,
        **rw,
        "packs_kept": len(kept),
        "kv_bytes_kept": total,
    }


def _rewrite_mostly_dead(layout: ObjectLayout, retry: RetryPolicy, kept: list[PackManifest], usage: UsageSeen,
                         now: float, unused_s: float | None, below: float, grace_s: float,
                         delete: Callable[[PackManifest], None]) -> dict[str, Any]:
    """Rewrite the kept segments that are mostly dead, and delete the ones they replaced once the
    grace has passed (kv_rewrite.py: the order that keeps every live block readable)."""
    out: dict[str, Any] = {"segments_rewritten": 0, "blocks_rewritten": 0, "kv_bytes_rewritten": 0,
                           "segments_replaced_deleted": 0, "segments_awaiting_grace": 0,
                           "segments_rewrite_failed": 0, "kv_bytes_reclaimed": 0, "gone": set(), "new": []}
    if unused_s is None:
        return out  # liveness is by last use: without --unused-days every block counts as live
    plan = plan_rewrites(kept, usage.block_last, now, unused_s, below, grace_s)

    def drop(m: PackManifest) -> None:
        delete(m)
        out["gone"].add((m.fingerprint_id, m.pack))
        out["segments_replaced_deleted"] += 1
        out["kv_bytes_reclaimed"] += m.object_bytes

    for m, live in plan.rewrite:
        try:
            new = rewrite_segment(layout, retry, m, live, now)
        except Exception as exc:  # noqa: BLE001 - the old segment is untouched; the next gc tries again
            out["segments_rewrite_failed"] += 1
            log.warning("kv gc: cannot rewrite segment %s/%s (kept whole): %s", m.fingerprint_id, m.pack,
                        redact_text(str(exc)))
            continue
        out["segments_rewritten"] += 1
        out["blocks_rewritten"] += len(new.entries)
        out["kv_bytes_rewritten"] += new.object_bytes
        out["kv_bytes_reclaimed"] -= new.object_bytes
        out["new"].append(new)
        if grace_s <= 0:  # its copy is durable and published: nobody need read the old one
            drop(m)
        else:
            out["segments_awaiting_grace"] += 1
    for m in plan.delete:
        drop(m)
    out["segments_awaiting_grace"] += len(plan.waiting)
    return out


def _fold_usage(layout: ObjectLayout, retry: RetryPolicy, kept: list[PackManifest], usage: UsageSeen,
                now: float) -> None:
    """One usage file per model with the last use of every kept segment and of its blocks (a use of
    a whole segment by an older reader becomes a use of each of its blocks)."""
    by_fpid: dict[str, UsageFile] = {}
    for m in kept:
        k = (m.fingerprint_id, m.pack)
        if k not in usage.segments:
            continue
        f = by_fpid.setdefault(m.fingerprint_id, UsageFile({}, {}))
        f.last_used[m.pack] = usage.segments[k]
        whole, blocks = usage.whole.get(k, 0.0), usage.blocks.get(k, {})
        offs = {e.offset: max(whole, blocks.get(e.offset, 0.0)) for e in m.entries.values()}
        f.blocks[m.pack] = {o: t for o, t in offs.items() if t > 0}
    for fpid, f in by_fpid.items():
        path = layout.usage_path(fpid, f"{int(now * 1000):013d}-{uuid.uuid4().hex}")
        body = f.to_json()
        retry.call(lambda p=path, b=body: layout.put_new(p, b), f"write {path}")


def object_stats(layout: ObjectLayout, retry: RetryPolicy | None = None) -> dict[str, Any]:
    """Packs, blocks and bytes in an object store prefix, per fingerprint."""
    retry = retry or RetryPolicy()
    per_fp: dict[str, dict[str, Any]] = {}
    oldest, newest = None, None
    scan = scan_index(layout, retry, "stats")
    for m in scan.manifests:
        s = per_fp.setdefault(m.fingerprint, {"packs": 0, "blocks": 0, "kv_bytes": 0, "keys": set()})
        s["packs"] += 1
        s["blocks"] += len(m.entries)
        s["kv_bytes"] += m.object_bytes
        s["keys"].update(m.entries)
        oldest = m.created_s if oldest is None else min(oldest, m.created_s)
        newest = m.created_s if newest is None else max(newest, m.created_s)
    for s in per_fp.values():
        s["unique_blocks"] = len(s.pop("keys"))
    return {
        "packs": sum(s["packs"] for s in per_fp.values()),
        "blocks": sum(s["blocks"] for s in per_fp.values()),
        "unique_blocks": sum(s["unique_blocks"] for s in per_fp.values()),
        "kv_bytes": sum(s["kv_bytes"] for s in per_fp.values()),
        "oldest_created_s": oldest,
        "newest_created_s": newest,
        "unreadable_index_files": scan.unreadable,
        "invalid_index_files": scan.invalid,
        "fingerprints": per_fp,
    }
