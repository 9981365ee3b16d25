"""The durable tier: packed KV objects on any fsspec URL, with an index, retries and retention.

Layout under the store's root (one folder per model fingerprint, so a reader lists only its own
model's packs and gc/stats can still walk them all):

    objects/<fingerprint id>/<created ms>-<digest>.arrow   a pack: many blocks, one Arrow IPC file
    index/<fingerprint id>/<created ms>-<digest>.json      its index: key -> offset, length, checksums

Writes go object first, index second; the index file is what publishes a pack (Mooncake's
PutStart/PutEnd in two PUTs). Objects are immutable and never appended to.
"""

from __future__ import annotations

import errno
import itertools
import json
import logging
import math
import os
import re
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

import fsspec
import torch
from fsspec.implementations.local import LocalFileSystem

from kvbatch.io.kv_block_format import DTYPES, BlockCorrupt, BlockEntry, digest, pack_blocks, unpack_block
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


# -- names and ranges read from the store ------------------------------------------------------
#
# Everything an index file (or a listing) says later becomes a path (pack, fingerprint id) or a
# byte range (offset, length). Anyone who can write one file into a shared store writes these,
# so each is checked against the one shape kvbatch itself produces before it is used, and the
# layout builds paths from checked names only.

_PACK_NAME = re.compile(r"[0-9]{13,20}-[0-9a-f]{32}")  # f"{created ms:013d}-{digest(object)}", see _write_pack
_FPID_NAME = re.compile(r"[0-9a-f]{32}")  # fingerprint_id(): a blake2b-128 hex digest
_DIGEST = re.compile(r"[0-9a-f]{32}")  # kv_block_format.digest()
_MAX_DIMS = 8  # a KV block is [layers, 2, heads, block, dim] or fewer; more is not ours
_MAX_FINGERPRINT_CHARS = 4096


class IndexInvalid(ValueError):
    """An index file (or a name in the store) that fails validation: hostile or corrupt.

    It is skipped and counted (`invalid_index_files`), never used to find data, and nothing is
    ever deleted through it. The message names the file and the field.
    """

    def __init__(self, source: str, field: str, reason: str) -> None:
        self.source, self.field, self.reason = source, field, reason
        super().__init__(f"{source}: {field}: {reason}")


def _shown(value: Any, limit: int = 60) -> str:
    s = repr(value)  # repr, not str: a NUL, a backslash or a newline shows as itself
    return s if len(s) <= limit else s[: limit - 3] + "..."


def _checked_name(value: Any, pattern: re.Pattern[str], source: str, field: str, shape: str) -> str:
    if not isinstance(value, str) or not pattern.fullmatch(value):
        raise IndexInvalid(source, field, f"{_shown(value)} is not {shape}")
    return value


def _checked_int(value: Any, source: str, field: str, lo: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):  # JSON true is not a number here
        raise IndexInvalid(source, field, f"must be an integer, got {_shown(value)}")
    if value < lo:
        raise IndexInvalid(source, field, f"must be >= {lo}, got {value}")
    return value


def _checked_entry(b: Any, source: str, field: str, object_bytes: int) -> BlockEntry:
    if not isinstance(b, dict):
        raise IndexInvalid(source, field, f"must be an object, got {_shown(b)}")
    try:
        key = check_key(b.get("key"))
    except ValueError as exc:
        raise IndexInvalid(source, f"{field}.key", str(exc)) from None
    offset = _checked_int(b.get("offset"), source, f"{field}.offset", 0)
    length = _checked_int(b.get("length"), source, f"{field}.length", 1)
    if offset + length > object_bytes:
        raise IndexInvalid(source, f"{field}.length", f"block [{offset}, {offset + length}) ends past the "
                           f"{object_bytes} bytes the index gives its object")
    checksum = _checked_name(b.get("checksum"), _DIGEST, source, f"{field}.checksum", "a 32-hex digest")
    range_checksum = _checked_name(b.get("range_checksum"), _DIGEST, source, f"{field}.range_checksum",
                                   "a 32-hex digest")
    dtype = b.get("dtype")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise IndexInvalid(source, f"{field}.dtype", f"{_shown(dtype)} is not one of {sorted(DTYPES)}")
    shape = b.get("shape")
    if not isinstance(shape, list) or len(shape) > _MAX_DIMS:
        raise IndexInvalid(source, f"{field}.shape", f"must be a list of at most {_MAX_DIMS} sizes, got {_shown(shape)}")
    dims = tuple(_checked_int(s, source, f"{field}.shape.{i}", 0) for i, s in enumerate(shape))
    # The range holds the tensor's raw bytes plus their IPC framing: a shape whose bytes cannot fit
    # is a lie, refused here rather than by an allocation later.
    nbytes = math.prod(dims) * torch.empty((), dtype=DTYPES[dtype]).element_size()
    if nbytes > length:
        raise IndexInvalid(source, f"{field}.shape", f"{dtype}{list(dims)} needs {nbytes} bytes, more than the "
                           f"block's {length}-byte range")
    return BlockEntry(key, offset, length, checksum, range_checksum, dtype, dims)


@dataclass
class PackManifest:
    """The index file of one packed object: published after the object is whole."""

    pack: str  # "<created_ms>-<digest>"
    fingerprint: str
    fingerprint_id: str
    object_bytes: int
    created_s: float
    entries: dict[str, BlockEntry]

    def to_json(self) -> bytes:
        return json.dumps(
            {
                "format": "kvbatch.kvpack-index",
                "version": 1,
                "pack": self.pack,
                "fingerprint": self.fingerprint,
                "fingerprint_id": self.fingerprint_id,
                "object_bytes": self.object_bytes,
                "created_s": self.created_s,
                "blocks": [e.to_json() for e in self.entries.values()],
            },
            separators=(",", ":"),
        ).encode()

    @classmethod
    def from_json(cls, raw: bytes, source: str = "index file", where: tuple[str, str] | None = None) -> "PackManifest":
        """Parse and validate an index file; raise IndexInvalid naming `source` and the field.

        `where` is (fingerprint id, pack) as the file's own path names them: an index file may
        describe only the pack it is named for, so it can never point gc at another pack.
        """
        try:
            d = json.loads(raw)
        except (ValueError, RecursionError) as exc:  # bad JSON, bad UTF-8, nested too deeply
            raise IndexInvalid(source, "$", f"not JSON ({_shown(str(exc), 120)})") from None
        if not isinstance(d, dict):
            raise IndexInvalid(source, "$", f"must be a JSON object, got {type(d).__name__}")
        if d.get("format") != "kvbatch.kvpack-index":
            raise IndexInvalid(source, "format", f"not a kvbatch pack index (format {_shown(d.get('format'))})")
        if type(d.get("version")) is not int or d["version"] != 1:
            raise IndexInvalid(source, "version", f"version {_shown(d.get('version'))}, this reader knows 1")
        pack = _checked_name(d.get("pack"), _PACK_NAME, source, "pack", "a pack name (<created ms>-<32 hex>)")
        fingerprint = d.get("fingerprint")
        if not isinstance(fingerprint, str) or not 0 < len(fingerprint) <= _MAX_FINGERPRINT_CHARS:
            raise IndexInvalid(source, "fingerprint", f"must be a non-empty string, got {_shown(fingerprint)}")
        fpid = _checked_name(d.get("fingerprint_id"), _FPID_NAME, source, "fingerprint_id", "32 hex digits")
        if fpid != fingerprint_id(fingerprint):
            raise IndexInvalid(source, "fingerprint_id", f"{fpid} is not the id of fingerprint {_shown(fingerprint)}")
        if where is not None and (fpid, pack) != where:
            raise IndexInvalid(source, "pack", f"describes pack {fpid}/{pack}, but the file is the index of "
                               f"{where[0]}/{where[1]}")
        object_bytes = _checked_int(d.get("object_bytes"), source, "object_bytes", 1)
        created_s = d.get("created_s")
        if isinstance(created_s, bool) or not isinstance(created_s, int | float) or not math.isfinite(created_s) \
                or not 0 <= created_s <= 1e15:
            raise IndexInvalid(source, "created_s", f"must be a time in seconds, got {_shown(created_s)}")
        # The pack's name carries its write time: retention must not be steered by a second clock.
        if abs(int(created_s * 1000) - int(pack.split("-", 1)[0])) > 1:
            raise IndexInvalid(source, "created_s", f"{created_s} disagrees with the time in pack name {pack}")
        blocks = d.get("blocks")
        if not isinstance(blocks, list) or not blocks:
            raise IndexInvalid(source, "blocks", f"must be a non-empty list, got {_shown(blocks)}")
        entries: dict[str, BlockEntry] = {}
        for i, b in enumerate(blocks):
            e = _checked_entry(b, source, f"blocks.{i}", object_bytes)
            if e.key in entries:
                raise IndexInvalid(source, f"blocks.{i}.key", f"block {e.key} is listed twice")
            entries[e.key] = e
        # pack_blocks writes each block as its own IPC message, one after the other: ranges never overlap.
        ordered = sorted(entries.values(), key=lambda e: e.offset)
        for a, b in itertools.pairwise(ordered):
            if b.offset < a.offset + a.length:
                raise IndexInvalid(source, "blocks", f"the ranges of blocks {a.key[:16]} and {b.key[:16]} overlap")
        return cls(pack=pack, fingerprint=fingerprint, fingerprint_id=fpid, object_bytes=object_bytes,
                   created_s=float(created_s), entries=entries)


def fingerprint_id(fingerprint: str) -> str:
    """A short, path-safe name for a fingerprint: each model's packs live in their own folder."""
    return digest(fingerprint.encode())


def _pack_created_s(pack: str) -> float | None:
    head = pack.split("-", 1)[0]
    return int(head) / 1000 if head.isdigit() else None


class ObjectLayout:
    """Paths under the store's root. Objects: objects/<fpid>/<pack>.arrow; index: index/<fpid>/<pack>.json."""

    def __init__(self, fs: fsspec.AbstractFileSystem, root: str) -> None:
        self.fs = fs
        self.root = root.rstrip("/")
        self.local = isinstance(fs, LocalFileSystem)

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
        ext = {"objects": ".arrow", "index": ".json"}.get(parts[0]) if len(parts) == 3 else None
        if ext is None or not parts[2].endswith(ext):
            return False
        if not (_FPID_NAME.fullmatch(parts[1]) and _PACK_NAME.fullmatch(parts[2][: -len(ext)])):
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
        self.fs.rm_file(path)

    def write_whole(self, path: str, data: bytes) -> None:
        """Write an object whole: a single PUT on object stores, temp file + rename on local disk."""
        if self.local:
            parent = path.rsplit("/", 1)[0]
            self.fs.makedirs(parent, exist_ok=True)
            tmp = f"{parent}/.tmp-{uuid.uuid4().hex}"
            try:
                self.fs.pipe_file(tmp, data)
                os.replace(tmp, path)
            finally:
                if os.path.exists(tmp):
                    _unlink_quiet(tmp)
        else:
            self.fs.pipe_file(path, data)

    def ls_names(self, folder: str) -> list[str]:
        """Base names in a folder (fresh listing, temp files left out); [] if it does not exist."""
        self.fs.invalidate_cache(folder)
        try:
            items = self.fs.ls(folder, detail=False)
        except FileNotFoundError:
            return []
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
        self.refresh()

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
            known = set(self._manifests)
        new: dict[tuple[str, str], PackManifest] = {}
        with self._lock:
            dead = set(self._dead)
            # Index files are create-only: one found invalid stays so, and is not read again.
            invalid = set(self._invalid)
        for fpid, pack in sorted(listed - known - dead - invalid):
            path = self.layout.index_path(fpid, pack)
            try:
                raw = self._call(lambda p=path: self.fs.cat_file(p), f"read {path}")
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

    def _maybe_refresh(self, keys: list[str]) -> None:
        with self._lock:
            unknown = any(k not in self._where for k in keys)
            stale = time.monotonic() - self._last_refresh >= self.index_refresh_s
        if unknown and stale:
            self.refresh()

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
        self._maybe_refresh(keys)
        return [any(m.fingerprint == fingerprint for m, _ in self._locations(k)) for k in keys]

    # -- reads --

    def get_many(self, keys: list[str], fingerprint: str) -> list[Lookup]:
        if self.breaker.blocked():
            self.breaker.skip()
            return [self._miss(key, TIER_UNAVAILABLE) for key in keys]
        self._maybe_refresh(keys)
        plans: list[list[tuple[PackManifest, BlockEntry]]] = []
        foreign: list[str] = []  # fingerprint of a copy stored by another model, if that is all there is
        for key in keys:
            locs = self._locations(key)
            plans.append([(m, e) for m, e in locs if m.fingerprint == fingerprint])
            foreign.append(locs[0][0].fingerprint if locs and not plans[-1] else "")
        # First attempt for every key in one batched range fetch (concurrent on async stores).
        fetched = iter(self._fetch_ranges([p[0] for p in plans if p]))
        results: list[Lookup] = []
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
                results.append(Lookup(tensor))
            else:
                results.append(self._miss(key, reason, detail))
        return results

    def _fetch_ranges(self, spans: list[tuple[PackManifest, BlockEntry]]) -> list[bytes | Exception]:
        """Fetch byte ranges; each result is the bytes or the exception left after retries."""
        if not spans:
            return []
        paths = [self.layout.object_path(m.fingerprint_id, m.pack) for m, _ in spans]
        starts = [e.offset for _, e in spans]
        ends = [e.offset + e.length for _, e in spans]
        if not self.breaker.allow():
            return [TierUnavailable(f"the kv {self.name} tier is unavailable")] * len(spans)
        t0 = time.perf_counter()
        try:
            out: list[Any] = list(self.fs.cat_ranges(paths, starts, ends, on_error="return"))
        except Exception as exc:  # the whole batch failed; retry range by range below
            out = [exc] * len(spans)
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
            return self._call(lambda: self.fs.cat_file(path, start=start, end=end), f"read {path}[{start}:{end}]")
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
            size = self._call(lambda: self.fs.size(path), f"size {path}")
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
        for key, _ in blocks:
            check_key(key)
        present = self.contains([k for k, _ in blocks], fingerprint)
        todo: dict[str, torch.Tensor] = {}
        for (key, tensor), have in zip(blocks, present):
            if not have and key not in todo:
                todo[key] = tensor
        written = 0
        group: list[tuple[str, torch.Tensor]] = []
        size = 0
        for key, tensor in todo.items():
            group.append((key, tensor))
            size += _nbytes(tensor)
            if size >= self.pack_bytes:
                written += self._write_pack(group, fingerprint)
                group, size = [], 0
        if group:
            written += self._write_pack(group, fingerprint)
        return written

    def _write_pack(self, group: list[tuple[str, torch.Tensor]], fingerprint: str) -> int:
        data, entries = pack_blocks(fingerprint, group)
        created_s = time.time()
        pack = f"{int(created_s * 1000):013d}-{digest(data)}"
        fpid = fingerprint_id(fingerprint)
        manifest = PackManifest(pack, fingerprint, fpid, len(data), created_s, entries)
        obj, idx = self.layout.object_path(fpid, pack), self.layout.index_path(fpid, pack)
        try:
            self._call(lambda: self.layout.write_whole(obj, data), f"write {obj}")
            self._call(lambda: self.layout.write_whole(idx, manifest.to_json()), f"write {idx}")
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
            invalid = len(self._invalid) + self._invalid_names
        return {**super().stats(), "invalid_index_files": invalid}

    def gc(self, now: float | None = None) -> dict[str, Any]:
        """Apply this tier's TTL and size policy to the whole store, then refresh the index."""
        out = gc_objects(self.layout, self.ttl_s, self.max_bytes, now=now, retry=self.retry)
        self.refresh()
        return out


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
            raw = retry.call(lambda p=path: layout.fs.cat_file(p), f"read {path}")
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
) -> dict[str, Any]:
    """Delete packs older than `ttl_s`, then the oldest packs until at most `max_bytes` remain.

    TTL counts from the write: object stores do not record reads cheaply, and an expired block
    that is still wanted is simply recomputed and written again. Each pack's index file goes
    first, then its object, so a fresh reader never meets a deleted object; a reader with a stale
    index gets an "object_deleted" miss. Objects without an index file (a writer died between
    the two writes) are removed once older than `orphan_grace_s`.

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

    expired = [m for m in manifests if ttl_s is not None and now - m.created_s > ttl_s]
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
    orphans = 0
    for fpid, pack in objects:
        created = _pack_created_s(pack)
        if (fpid, pack) in published or created is None or now - created <= orphan_grace_s:
            continue
        orphans += remove(layout.object_path(fpid, pack))
    return {
        "packs_expired": len(expired),
        "packs_evicted_for_size": len(oversize),
        "blocks_deleted": sum(len(m.entries) for m in expired + oversize),
        "kv_bytes_deleted": sum(m.object_bytes for m in expired + oversize),
        "orphan_objects_deleted": orphans,
        "dangling_index_files_deleted": len(dangling),
        "unreadable_index_files": scan.unreadable,
        "invalid_index_files": scan.invalid,
        "deletes_refused": refused,
        "packs_kept": len(kept) - len(dangling),
        "kv_bytes_kept": total,
    }


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
