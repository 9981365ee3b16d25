"""The durable tier: packed KV objects on any fsspec URL, with an index, retries and retention.

`ObjectStoreTier` buffers writes into big segments and publishes each with its index file
(object first, index second), and reads byte ranges back, verified block by block. Where its
files live is `object_layout.py`; its retries and breaker `faults.py`; gc and stats `gc.py`.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import math
import threading
import time
import uuid
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, TypeVar

import fsspec
import torch

from kvbatch.io.kvstore.block_format import BlockCorrupt, BlockEntry, digest, pack_blocks, unpack_block
from kvbatch.io.kvstore.faults import (
    CircuitBreaker,
    RetryPolicy,
    TierUnavailable,
    is_timeout,
    is_transient,
    open_store,
    store_endpoint,
)
from kvbatch.io.kvstore.gc import UsageFile, gc_objects
from kvbatch.io.kvstore.index import IndexReader
from kvbatch.io.kvstore.index_files import IndexInvalid, PackManifest, fingerprint_id
from kvbatch.io.kvstore.object_layout import ObjectLayout, StoreLayoutError, coalesce_ranges, ensure_layout
from kvbatch.io.kvstore.tiers import (
    IO_ERROR,
    MISSING,
    OBJECT_DELETED,
    TIER_UNAVAILABLE,
    Lookup,
    Tier,
    _nbytes,
    check_key,
)
from kvbatch.io.urls import redact_text

log = logging.getLogger(__name__)

T = TypeVar("T")


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
        clock: Callable[[], float] = time.time,
    ) -> None:
        super().__init__()
        self.name = name
        self.url = url
        # The wall clock that stamps segments (their names and `created_s`) and usage files, and
        # is gc's "now": a test passes another one to write last week's segments (store.py).
        self.clock = clock
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
        # rewrites a segment whose used blocks are few (rewrite.py).
        self._used: dict[tuple[str, str], set[int]] = {}
        # Nothing is listed here: a reader loads the index partitions its keys need when it first
        # asks for them (index.py), and decode, given each block's location by prefill's
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
        `index_refresh_s` (index.IndexReader); never the whole store."""
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
        """Where blocks are, as prefill's manifests say (index.parse_location): decode reads them
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
        now = self.clock() if now is None else now
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
        created_s = self.clock()
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
        out = gc_objects(self.layout, self.ttl_s, self.max_bytes, now=self.clock() if now is None else now,
                         retry=self.retry)
        self.refresh()
        return out
