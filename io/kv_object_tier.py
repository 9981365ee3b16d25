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
import json
import logging
import os
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

import fsspec
import torch
from fsspec.implementations.local import LocalFileSystem

from kvbatch.io.kv_block_format import BlockCorrupt, BlockEntry, digest, pack_blocks, unpack_block
from kvbatch.io.kv_tiers import (
    IO_ERROR,
    MISSING,
    OBJECT_DELETED,
    Lookup,
    Tier,
    TierCounters,
    _nbytes,
    _unlink_quiet,
    check_key,
)

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


def is_transient(exc: BaseException) -> bool:
    """Whether an object store error may go away on retry: 5xx, throttling, timeouts, dropped connections."""
    if isinstance(exc, FileNotFoundError | PermissionError | IsADirectoryError | NotADirectoryError):
        return False
    if isinstance(exc, TimeoutError | ConnectionError):
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


@dataclass
class RetryPolicy:
    """Exponential backoff on transient errors, bounded both in attempts and in seconds."""

    attempts: int = 4
    backoff_s: float = 0.05
    max_backoff_s: float = 2.0
    budget_s: float = 10.0

    def call(self, fn: Callable[[], T], what: str, counters: TierCounters | None = None) -> T:
        start = time.monotonic()
        delay = self.backoff_s
        for attempt in range(1, self.attempts + 1):
            try:
                return fn()
            except Exception as exc:
                spent = time.monotonic() - start
                if not is_transient(exc) or attempt == self.attempts or spent + delay > self.budget_s:
                    raise
                log.info("kv object store: %s failed (%s), retry %d in %.2fs", what, exc, attempt, delay)
                if counters is not None:
                    counters.retries += 1
                time.sleep(delay)
                delay = min(delay * 2, self.max_backoff_s)
        raise AssertionError("unreachable")  # the loop returns or raises


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
    def from_json(cls, raw: bytes) -> "PackManifest":
        d = json.loads(raw)
        if d.get("format") != "kvbatch.kvpack-index":
            raise ValueError(f"not a kvbatch pack index (format {d.get('format')!r})")
        entries = {e["key"]: BlockEntry.from_json(e) for e in d["blocks"]}
        return cls(
            pack=str(d["pack"]),
            fingerprint=str(d["fingerprint"]),
            fingerprint_id=str(d["fingerprint_id"]),
            object_bytes=int(d["object_bytes"]),
            created_s=float(d["created_s"]),
            entries=entries,
        )


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
        return f"{self.root}/objects/{fpid}/{pack}.arrow"

    def index_path(self, fpid: str, pack: str) -> str:
        return f"{self.root}/index/{fpid}/{pack}.json"

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
        """(fpid, pack) of every published pack."""
        out = []
        for fpid in self.ls_names(f"{self.root}/index"):
            for name in self.ls_names(f"{self.root}/index/{fpid}"):
                if name.endswith(".json"):
                    out.append((fpid, name[: -len(".json")]))
        return out

    def list_objects(self) -> list[tuple[str, str]]:
        out = []
        for fpid in self.ls_names(f"{self.root}/objects"):
            for name in self.ls_names(f"{self.root}/objects/{fpid}"):
                if name.endswith(".arrow"):
                    out.append((fpid, name[: -len(".arrow")]))
        return out


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
    ) -> None:
        super().__init__()
        self.name = name
        self.url = url
        if fs is None:
            fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
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
        self._last_refresh = -float("inf")
        self.refresh()

    # -- index --

    def refresh(self) -> None:
        """Load index files published since the last refresh; forget packs no longer listed."""
        try:
            listed = set(self.retry.call(self.layout.list_manifests, "list index", self.counters))
        except Exception as exc:
            log.warning("kv %s tier: cannot list the index at %s: %s", self.name, self.url, exc)
            return
        with self._lock:
            known = set(self._manifests)
        new: dict[tuple[str, str], PackManifest] = {}
        with self._lock:
            dead = set(self._dead)
        for fpid, pack in sorted(listed - known - dead):
            path = self.layout.index_path(fpid, pack)
            try:
                raw = self.retry.call(lambda p=path: self.fs.cat_file(p), f"read {path}", self.counters)
                new[(fpid, pack)] = PackManifest.from_json(raw)
            except FileNotFoundError:
                continue  # removed by gc between list and read
            except Exception as exc:
                log.warning("kv %s tier: skipping unreadable index file %s: %s", self.name, path, exc)
        with self._lock:
            for k in known - listed:
                self._manifests.pop(k, None)
            self._manifests.update(new)
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
        self._maybe_refresh(keys)
        return [any(m.fingerprint == fingerprint for m, _ in self._locations(k)) for k in keys]

    # -- reads --

    def get_many(self, keys: list[str], fingerprint: str) -> list[Lookup]:
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
                if reason not in (IO_ERROR, OBJECT_DELETED):
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
        t0 = time.perf_counter()
        try:
            out: list[Any] = list(self.fs.cat_ranges(paths, starts, ends, on_error="return"))
        except Exception as exc:  # the whole batch failed; retry range by range below
            out = [exc] * len(spans)
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
            return self.retry.call(
                lambda: self.fs.cat_file(path, start=start, end=end), f"read {path}[{start}:{end}]", self.counters
            )
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
        if isinstance(exc, FileNotFoundError):
            self._drop_pack(m)  # gc (or someone) removed it; stop pointing readers at it
            return OBJECT_DELETED, f"{path} is gone"
        if is_transient(exc):
            return IO_ERROR, f"{path}: gave up after retries: {exc!r}"
        # A range past the end is refused by some stores: find out whether the object shrank.
        try:
            size = self.fs.size(path)
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
            self.retry.call(lambda: self.layout.write_whole(obj, data), f"write {obj}", self.counters)
            self.retry.call(lambda: self.layout.write_whole(idx, manifest.to_json()), f"write {idx}", self.counters)
        except Exception as exc:
            self.counters.write_errors += 1
            log.warning("kv %s tier: cannot publish pack %s (%d blocks): %s", self.name, obj, len(entries), exc)
            return 0
        self._add_manifest(manifest)
        self.counters.blocks_written += len(entries)
        self.counters.bytes_written += len(data)
        return len(entries)

    # -- size, retention --

    def resident(self) -> tuple[int, int]:
        with self._lock:
            return len(self._where), sum(m.object_bytes for m in self._manifests.values())

    def gc(self, now: float | None = None) -> dict[str, Any]:
        """Apply this tier's TTL and size policy to the whole store, then refresh the index."""
        out = gc_objects(self.layout, self.ttl_s, self.max_bytes, now=now, retry=self.retry)
        self.refresh()
        return out


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
    """
    retry = retry or RetryPolicy()
    now = time.time() if now is None else now
    fs = layout.fs
    manifests: list[PackManifest] = []
    unreadable = 0
    for fpid, pack in retry.call(layout.list_manifests, "list index"):
        path = layout.index_path(fpid, pack)
        try:
            manifests.append(PackManifest.from_json(retry.call(lambda p=path: fs.cat_file(p), f"read {path}")))
        except FileNotFoundError:
            continue
        except Exception as exc:
            unreadable += 1
            log.warning("kv gc: unreadable index file %s left in place: %s", path, exc)

    def delete(m: PackManifest) -> None:
        for p in (layout.index_path(m.fingerprint_id, m.pack), layout.object_path(m.fingerprint_id, m.pack)):
            try:
                retry.call(lambda p=p: fs.rm_file(p), f"delete {p}")
            except FileNotFoundError:
                pass

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
        p = layout.object_path(fpid, pack)
        try:
            retry.call(lambda: fs.rm_file(p), f"delete {p}")
            orphans += 1
        except FileNotFoundError:
            pass
    return {
        "packs_expired": len(expired),
        "packs_evicted_for_size": len(oversize),
        "blocks_deleted": sum(len(m.entries) for m in expired + oversize),
        "kv_bytes_deleted": sum(m.object_bytes for m in expired + oversize),
        "orphan_objects_deleted": orphans,
        "dangling_index_files_deleted": len(dangling),
        "unreadable_index_files": unreadable,
        "packs_kept": len(kept) - len(dangling),
        "kv_bytes_kept": total,
    }


def object_stats(layout: ObjectLayout, retry: RetryPolicy | None = None) -> dict[str, Any]:
    """Packs, blocks and bytes in an object store prefix, per fingerprint."""
    retry = retry or RetryPolicy()
    per_fp: dict[str, dict[str, Any]] = {}
    unreadable = 0
    oldest, newest = None, None
    for fpid, pack in retry.call(layout.list_manifests, "list index"):
        path = layout.index_path(fpid, pack)
        try:
            m = PackManifest.from_json(retry.call(lambda p=path: layout.fs.cat_file(p), f"read {path}"))
        except FileNotFoundError:
            continue
        except Exception:
            unreadable += 1
            continue
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
        "unreadable_index_files": unreadable,
        "fingerprints": per_fp,
    }

