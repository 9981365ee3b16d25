"""Storage tiers of the KV store: the protocol, process memory and local disk.

The durable object store tier is in object_tier.py.

Protocol (KVStore is the only caller; it calls top-down and holds no tier's lock):
- `contains(keys, fingerprint)`: index lookups only, no data read.
- `get_many(keys, fingerprint)`: one `Lookup` per key, in order. A fault never raises: it is a
  miss with a reason, counted in the tier's stats and logged.
- `put_many(blocks, fingerprint)`: stores blocks the tier lacks; returns how many it stored.
  Never raises on storage faults (they are counted as write errors and logged).
- `stats()`: counters and sizes.

Every tier is thread-safe for concurrent calls from one process. Several processes may share a
disk folder or an object store prefix: writes are whole files or whole objects published by a
rename or a single PUT, so a reader never sees half a block, and two writers writing the same
block only waste space.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
import uuid
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch

from kvbatch.io.kvstore.block_format import BlockCorrupt, digest, pack_blocks, read_pack

log = logging.getLogger(__name__)

# Miss reasons, beyond the BlockCorrupt reasons (truncated, checksum, fingerprint, ...).
MISSING = "missing"
OBJECT_DELETED = "object_deleted"
IO_ERROR = "io_error"
TIER_UNAVAILABLE = "tier_unavailable"  # the tier's circuit breaker is open: not asked at all


@dataclass
class Lookup:
    """The answer for one key: a tensor, or None and the reason it is a miss."""

    tensor: torch.Tensor | None
    reason: str = ""  # "" on a hit


@dataclass
class TierCounters:
    """What a tier did since it was created; read by KVStore.stats()."""

    hits: int = 0
    misses: Counter = field(default_factory=Counter)
    bytes_read: int = 0
    read_s: float = 0.0
    blocks_written: int = 0
    bytes_written: int = 0
    write_errors: int = 0
    evictions: int = 0
    retries: int = 0
    # Outages (the object store tier): calls that gave up, attempts that timed out, blocks whose
    # pack could not be published, breaker openings, calls not made while it was open, and the
    # seconds lost to faults (failed attempts plus the backoff between them).
    failures: int = 0
    timeouts: int = 0
    blocks_failed: int = 0
    breaker_opens: int = 0
    calls_skipped_open: int = 0
    fault_wait_s: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "hits": self.hits,
            "misses": sum(self.misses.values()),
            "misses_by_reason": dict(self.misses),
            "kv_bytes_read": self.bytes_read,
            "read_s": self.read_s,
            "read_bytes_per_s": (self.bytes_read / self.read_s) if self.read_s > 0 else None,
            "blocks_written": self.blocks_written,
            "kv_bytes_written": self.bytes_written,
            "write_errors": self.write_errors,
            "evictions": self.evictions,
            "retries": self.retries,
            "failures": self.failures,
            "timeouts": self.timeouts,
            "blocks_failed": self.blocks_failed,
            "breaker_opens": self.breaker_opens,
            "calls_skipped_open": self.calls_skipped_open,
            "fault_wait_s": round(self.fault_wait_s, 4),
        }


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Tier:
    """Base of the storage tiers; see the module docstring for the call protocol."""

    name: str = "tier"
    durable: bool = False

    def __init__(self) -> None:
        self.counters = TierCounters()
        self._lock = threading.RLock()

    def contains(self, keys: list[str], fingerprint: str) -> list[bool]:
        raise NotImplementedError

    def get_many(self, keys: list[str], fingerprint: str) -> list[Lookup]:
        raise NotImplementedError

    def put_many(self, blocks: list[tuple[str, torch.Tensor]], fingerprint: str) -> int:
        raise NotImplementedError

    def resident(self) -> tuple[int, int]:
        """(blocks, bytes) the tier holds now, as far as it knows."""
        raise NotImplementedError

    def stats(self) -> dict[str, Any]:
        blocks, nbytes = self.resident()
        return {"name": self.name, "kind": type(self).__name__, "blocks": blocks, "kv_bytes": nbytes,
                **self.counters.as_dict()}

    def _miss(self, key: str, reason: str, detail: str = "") -> Lookup:
        self.counters.misses[reason] += 1
        # An open breaker said so once already; a line per block would bury it.
        if reason not in (MISSING, TIER_UNAVAILABLE):
            log.warning("kv %s tier: block %s is a miss (%s) %s", self.name, key[:16], reason, detail)
        return Lookup(None, reason)


# --------------------------------------------------------------------------------------------
# Memory


class MemoryTier(Tier):
    """Blocks kept in process memory, least recently used evicted past `byte_budget`.

    Tensors are cloned on put (the engine may hand over views of its paged cache, which it will
    overwrite) and on get (so a caller writing into the result cannot alter the cache).
    """

    def __init__(self, byte_budget: int, name: str = "memory") -> None:
        super().__init__()
        if byte_budget < 0:
            raise ValueError(f"MemoryTier byte_budget must be >= 0, got {byte_budget}")
        self.name = name
        self.byte_budget = byte_budget
        self._blocks: OrderedDict[str, tuple[str, torch.Tensor]] = OrderedDict()
        self._bytes = 0

    def contains(self, keys: list[str], fingerprint: str) -> list[bool]:
        with self._lock:
            return [k in self._blocks and self._blocks[k][0] == fingerprint for k in keys]

    def get_many(self, keys: list[str], fingerprint: str) -> list[Lookup]:
        out = []
        for key in keys:
            t0 = time.perf_counter()
            with self._lock:
                item = self._blocks.get(key)
                if item is not None:
                    self._blocks.move_to_end(key)
            if item is None:
                out.append(self._miss(key, MISSING))
                continue
            fp, tensor = item
            if fp != fingerprint:
                out.append(self._miss(key, "fingerprint", f"stored under {fp!r}"))
                continue
            result = tensor.clone()
            self.counters.hits += 1
            self.counters.bytes_read += _nbytes(result)
            self.counters.read_s += time.perf_counter() - t0
            out.append(Lookup(result))
        return out

    def put_many(self, blocks: list[tuple[str, torch.Tensor]], fingerprint: str) -> int:
        written = 0
        for key, tensor in blocks:
            size = _nbytes(tensor)
            if size > self.byte_budget:
                continue  # would evict everything and still not fit
            with self._lock:
                if key in self._blocks:
                    self._blocks.move_to_end(key)
                    continue
                self._blocks[key] = (fingerprint, tensor.detach().to("cpu").clone())
                self._bytes += size
                written += 1
                self.counters.blocks_written += 1
                self.counters.bytes_written += size
                while self._bytes > self.byte_budget:
                    _, (_, old) = self._blocks.popitem(last=False)
                    self._bytes -= _nbytes(old)
                    self.counters.evictions += 1
        return written

    def resident(self) -> tuple[int, int]:
        with self._lock:
            return len(self._blocks), self._bytes


# --------------------------------------------------------------------------------------------
# Local disk

# Matched with fullmatch: `$` would also accept a name ending in a newline.
_DISK_NAME = re.compile(r"(?P<key>[0-9A-Za-z_\-]{1,256})\.(?P<digest>[0-9a-f]{32})\.kvb")
_KEY_OK = re.compile(r"[0-9A-Za-z_\-]{1,256}")


def check_key(key: str) -> str:
    """Keys become file and object names: only [0-9A-Za-z_-] (the engine's keys are hex sha256)."""
    if not isinstance(key, str) or not _KEY_OK.fullmatch(key):
        raise ValueError(f"KV block key {key!r} is not a hex/ASCII-word string of 1-256 characters")
    return key


@dataclass
class _DiskFile:
    path: str
    nbytes: int


class DiskTier(Tier):
    """One file per block under `folder`, least recently accessed evicted past `byte_budget`.

    A file is a one-block pack named `<key>.<digest of the file>.kvb`, written to a temporary
    name and renamed, so it is whole or absent and any changed byte fails the digest. Access
    order is kept in memory and mirrored in the files' atime (set explicitly on each read, as
    many filesystems mount noatime), so a restarted process resumes the LRU order. Other
    processes' writes to the same folder become visible after `rescan()`.
    """

    durable = False

    def __init__(self, folder: str, byte_budget: int, name: str = "disk") -> None:
        super().__init__()
        if byte_budget < 0:
            raise ValueError(f"DiskTier byte_budget must be >= 0, got {byte_budget}")
        self.name = name
        self.folder = os.path.abspath(os.path.expanduser(folder))
        self.byte_budget = byte_budget
        self._files: OrderedDict[str, _DiskFile] = OrderedDict()  # key -> file, oldest access first
        self._bytes = 0
        self._clock_ns = 0
        os.makedirs(self.folder, exist_ok=True)
        self.rescan()

    def rescan(self) -> None:
        """Rebuild the index from the folder, ordered by access time; drop stale temp files."""
        found: list[tuple[float, str, _DiskFile]] = []
        now = time.time()
        for sub in os.scandir(self.folder):
            # Never through a symlink: eviction and the temp-file sweep delete what this scan
            # finds, and must not reach outside the folder.
            if not sub.is_dir(follow_symlinks=False):
                continue
            for ent in os.scandir(sub.path):
                if not ent.is_file(follow_symlinks=False):
                    continue
                try:
                    st = ent.stat()
                except FileNotFoundError:
                    continue
                if ent.name.startswith(".tmp-"):
                    if now - st.st_mtime > 3600:  # a writer died mid-write long ago
                        _unlink_quiet(ent.path)
                    continue
                m = _DISK_NAME.fullmatch(ent.name)
                if m and m["key"][:2] == sub.name:
                    found.append((st.st_atime, m["key"], _DiskFile(ent.path, st.st_size)))
        found.sort(key=lambda x: x[0])
        with self._lock:
            self._files = OrderedDict((k, f) for _, k, f in found)
            self._bytes = sum(f.nbytes for f in self._files.values())

    def _touch(self, path: str) -> None:
        """Record an access in the file's atime, strictly increasing so ties cannot reorder LRU."""
        with self._lock:
            self._clock_ns = max(time.time_ns(), self._clock_ns + 1000)
            stamp = self._clock_ns
        try:
            os.utime(path, ns=(stamp, os.stat(path).st_mtime_ns))
        except OSError:
            pass

    def _dir(self, key: str) -> str:
        return os.path.join(self.folder, key[:2])

    def contains(self, keys: list[str], fingerprint: str) -> list[bool]:
        # The fingerprint is checked on read: file names carry only the key, which the engine
        # already chains over the fingerprint.
        with self._lock:
            return [k in self._files for k in keys]

    def get_many(self, keys: list[str], fingerprint: str) -> list[Lookup]:
        return [self._get(key, fingerprint) for key in keys]

    def _forget(self, key: str) -> None:
        with self._lock:
            f = self._files.pop(key, None)
            if f is not None:
                self._bytes -= f.nbytes

    def _get(self, key: str, fingerprint: str) -> Lookup:
        with self._lock:
            f = self._files.get(key)
            if f is not None:
                self._files.move_to_end(key)
        if f is None:
            return self._miss(key, MISSING)
        t0 = time.perf_counter()
        try:
            with open(f.path, "rb") as fh:
                data = fh.read()
        except FileNotFoundError:  # evicted by another process sharing the folder
            self._forget(key)
            return self._miss(key, MISSING, "file vanished")
        except OSError as exc:
            return self._miss(key, IO_ERROR, str(exc))
        m = _DISK_NAME.fullmatch(os.path.basename(f.path))
        assert m is not None
        try:
            if len(data) != f.nbytes:
                raise BlockCorrupt("truncated", f"{len(data)} bytes, expected {f.nbytes}")
            if digest(data) != m["digest"]:
                raise BlockCorrupt("checksum", "file bytes do not match the digest in its name")
            blocks = read_pack(data, fingerprint)
            if key not in blocks:
                raise BlockCorrupt("key", f"{f.path} does not hold block {key}")
        except BlockCorrupt as exc:
            # A bad file is never going to get better: remove it so the block can be rewritten.
            if exc.reason != "fingerprint":
                self._forget(key)
                _unlink_quiet(f.path)
            return self._miss(key, exc.reason, exc.detail)
        self._touch(f.path)
        self.counters.hits += 1
        self.counters.bytes_read += len(data)
        self.counters.read_s += time.perf_counter() - t0
        return Lookup(blocks[key])

    def put_many(self, blocks: list[tuple[str, torch.Tensor]], fingerprint: str) -> int:
        written = 0
        for key, tensor in blocks:
            check_key(key)
            with self._lock:
                if key in self._files:
                    continue
            data, _ = pack_blocks(fingerprint, [(key, tensor)])
            if len(data) > self.byte_budget:
                continue
            d = self._dir(key)
            path = os.path.join(d, f"{key}.{digest(data)}.kvb")
            tmp = os.path.join(d, f".tmp-{uuid.uuid4().hex}")
            try:
                os.makedirs(d, exist_ok=True)
                with open(tmp, "wb") as fh:
                    fh.write(data)
                os.replace(tmp, path)
                self._touch(path)
            except OSError as exc:
                _unlink_quiet(tmp)
                self.counters.write_errors += 1
                log.warning("kv %s tier: cannot write block %s: %s", self.name, key[:16], exc)
                continue
            with self._lock:
                self._files[key] = _DiskFile(path, len(data))
                self._bytes += len(data)
                written += 1
                self.counters.blocks_written += 1
                self.counters.bytes_written += len(data)
                victims = []
                while self._bytes > self.byte_budget and self._files:
                    _, old = self._files.popitem(last=False)
                    self._bytes -= old.nbytes
                    victims.append(old.path)
                    self.counters.evictions += 1
            for p in victims:
                _unlink_quiet(p)
        return written

    def resident(self) -> tuple[int, int]:
        with self._lock:
            return len(self._files), self._bytes


def _unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
