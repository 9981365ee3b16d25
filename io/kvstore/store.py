"""The tiered, content-addressed KV block store: memory -> local disk -> object store.

Who calls what, and when:
- prefill calls `contains(keys)` to skip blocks some earlier run already stored, tells the store
  a prompt's chain (`expect_chain(keys)`: its pieces, saved over several steps, stay contiguous),
  then `put_many(blocks)` with the new ones (written through to every tier; the durable one buffers
  them into big segments), and `flush()` at the end of its shard (stats() flushes too);
- decode (the engine's KV connector) calls `lookup(keys)` (`contains` with the reason of each
  "no") to plan what to load, then `get_many(keys)`, and recomputes every block that is a miss;
- the CLI (`kvbatch kv stats`, `kvbatch kv gc`) calls `kv_stats(url)` and `kv_gc(url, ...)`.

A fault anywhere (a missing, truncated or corrupted block, an object deleted under a stale
index, a block from another model, an object store that keeps failing) is a miss with a reason,
counted and logged, never an exception and never wrong data: a block is either bit-exact or
recomputed.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from typing import Any, Self

import torch
from pydantic import BaseModel, ConfigDict, Field

from kvbatch.io.kvstore.compaction import compact_index
from kvbatch.io.kvstore.faults import CircuitBreaker, RetryPolicy, open_store
from kvbatch.io.kvstore.gc import gc_objects, object_stats
from kvbatch.io.kvstore.index import entry_location, parse_location
from kvbatch.io.kvstore.object_layout import ObjectLayout, StoreLayoutError, ensure_layout
from kvbatch.io.kvstore.object_tier import ObjectStoreTier
from kvbatch.io.kvstore.request_counts import REQUEST_KINDS
from kvbatch.io.kvstore.rewrite import DEFAULT_REWRITE_BELOW, DEFAULT_REWRITE_GRACE_S
from kvbatch.io.kvstore.tiers import IO_ERROR, MISSING, TIER_UNAVAILABLE, DiskTier, Lookup, MemoryTier, Tier, check_key
from kvbatch.io.urls import redact

__all__ = [
    "CircuitBreaker",
    "DiskTier",
    "KVStore",
    "KVStoreConfig",
    "MemoryTier",
    "ObjectStoreTier",
    "RetryPolicy",
    "StoreLayoutError",
    "Tier",
    "kv_compact",
    "kv_gc",
    "kv_stats",
]


class KVStoreConfig(BaseModel):
    """Where the KV store lives and how big each tier may grow.

    `url` is the durable tier: `s3://bucket/prefix`, `file:///path`, `memory://name` or a plain
    local path. `memory_bytes=0` or `disk_dir=None` leaves that tier out.
    """

    model_config = ConfigDict(extra="forbid")

    url: str
    memory_bytes: int = Field(default=2 * 2**30, ge=0)
    disk_dir: str | None = None
    disk_bytes: int = Field(default=20 * 2**30, ge=0)
    ttl_s: float | None = Field(default=None, gt=0)
    max_bytes: int | None = Field(default=None, ge=0)
    storage_options: dict[str, Any] = Field(default_factory=dict)
    # Segments: the durable tier buffers blocks and writes one object once `pack_bytes` are
    # pending, at flush() (the end of a prefill shard), or `flush_after_s` after the oldest one.
    pack_bytes: int = Field(default=64 * 2**20, gt=0)
    flush_after_s: float = Field(default=30.0, gt=0)
    index_refresh_s: float = Field(default=5.0, ge=0)
    retry_attempts: int = Field(default=4, ge=1)
    retry_budget_s: float = Field(default=10.0, gt=0)
    # Bounded time on an unreachable store: per-request timeouts, then a circuit breaker that
    # stops calling it for `breaker_cooldown_s` after `breaker_failures` calls in a row gave up.
    connect_timeout_s: float = Field(default=5.0, gt=0)
    read_timeout_s: float = Field(default=20.0, gt=0)
    breaker_failures: int = Field(default=3, ge=1)
    breaker_cooldown_s: float = Field(default=30.0, ge=0)


class KVStore:
    """KV blocks by content-addressed key, over tiers ordered fastest first.

    The last tier is the durable one (the object store); the tiers above it are caches that a
    hit in a lower tier fills ("promotion"). All blocks are checked against `fingerprint`.
    """

    def __init__(self, tiers: list[Tier], fingerprint: str) -> None:
        if not tiers:
            raise ValueError("KVStore needs at least one tier")
        if not fingerprint:
            raise ValueError("KVStore needs a non-empty model fingerprint")
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"KVStore tier names must be unique, got {names}")
        self.tiers = tiers
        self.fingerprint = fingerprint
        self._misses = Counter()
        self._hits = 0
        self._puts_skipped = 0
        # Writes fail when a segment is flushed, maybe long after put_many returned: counted from
        # the durable tier's own count, since this store was made.
        self._failed_base = tiers[-1].counters.blocks_failed

    @classmethod
    def from_config(cls, cfg: KVStoreConfig, fingerprint: str, *, clock: Callable[[], float] = time.time) -> KVStore:
        """The store `cfg` describes. `clock` is the wall clock the durable tier stamps segments and
        usage files with, and gc's default "now": a test hands in last week's clock to write last
        week's segments, instead of patching `time.time` for the whole process. It is not a field
        of the config, which travels to worker processes as JSON."""
        tiers: list[Tier] = []
        if cfg.memory_bytes > 0:
            tiers.append(MemoryTier(cfg.memory_bytes))
        if cfg.disk_dir:
            tiers.append(DiskTier(cfg.disk_dir, cfg.disk_bytes))
        tiers.append(
            ObjectStoreTier(
                cfg.url,
                cfg.storage_options,
                pack_bytes=cfg.pack_bytes,
                ttl_s=cfg.ttl_s,
                max_bytes=cfg.max_bytes,
                retry=RetryPolicy(attempts=cfg.retry_attempts, budget_s=cfg.retry_budget_s),
                index_refresh_s=cfg.index_refresh_s,
                flush_after_s=cfg.flush_after_s,
                connect_timeout_s=cfg.connect_timeout_s,
                read_timeout_s=cfg.read_timeout_s,
                breaker_failures=cfg.breaker_failures,
                breaker_cooldown_s=cfg.breaker_cooldown_s,
                clock=clock,
            )
        )
        return cls(tiers, fingerprint)

    @property
    def durable(self) -> Tier:
        return self.tiers[-1]

    def contains(self, keys: list[str]) -> list[bool]:
        """Whether each key is stored in some tier (index lookups only, no data read)."""
        return [not reason for reason in self.lookup(keys)]

    def lookup(self, keys: list[str]) -> list[str]:
        """:meth:`contains` with the reason of each "no": ``""`` when some tier holds the key,
        ``"missing"``; ``"tier_unavailable"`` when a tier that may hold it was not asked (its
        circuit breaker is open), ``"io_error"`` when asking it failed (its index could not be
        listed). Those two are counted as misses, here and in that tier's stats, as
        :meth:`get_many` counts its own: an outage that only ever meets lookups (decode plans no
        load of a block it cannot find) must still show where a user looks for misses."""
        return self.locate(keys)[0]

    def locate(self, keys: list[str]) -> tuple[list[str], list[str]]:
        """(reasons, tiers): :meth:`lookup`'s reasons, and the name of the fastest tier holding each
        key ("" where none does), for retain-or-recompute to price each block by its tier."""
        for k in keys:
            check_key(k)
        reasons = [MISSING] * len(keys)
        where = [""] * len(keys)
        for tier in self.tiers:
            todo = [i for i, r in enumerate(reasons) if r]
            if not todo:
                break
            # A tier counts each call its breaker refused and each call that gave up: a rise
            # during this one means its "no" is "could not look", not "not stored".
            skipped, failed = tier.counters.calls_skipped_open, tier.counters.failures
            hits = tier.contains([keys[i] for i in todo], self.fingerprint)
            why = TIER_UNAVAILABLE if tier.counters.calls_skipped_open > skipped else \
                IO_ERROR if tier.counters.failures > failed else MISSING
            for i, hit in zip(todo, hits):
                reasons[i] = "" if hit else why
                where[i] = tier.name if hit else ""
            if why != MISSING:
                tier.counters.misses[why] += sum(not hit for hit in hits)
        for r in reasons:
            if r not in ("", MISSING):
                self._misses[r] += 1
        return reasons, where

    def get_many(self, keys: list[str]) -> list[tuple[torch.Tensor | None, str]]:
        """(tensor, tier name) per key, or (None, miss reason). Hits fill the faster tiers.

        The reason of a miss is the most telling one over all tiers: a fault ("checksum",
        "truncated", "object_deleted", "io_error", "fingerprint") beats "missing".
        """
        for k in keys:
            check_key(k)
        results: list[tuple[torch.Tensor | None, str] | None] = [None] * len(keys)
        reasons: list[str] = [MISSING] * len(keys)
        for level, tier in enumerate(self.tiers):
            todo = [i for i, r in enumerate(results) if r is None]
            if not todo:
                break
            # A key asked twice is fetched once.
            uniq = list(dict.fromkeys(keys[i] for i in todo))
            looked: dict[str, Lookup] = dict(zip(uniq, tier.get_many(uniq, self.fingerprint)))
            promote: list[tuple[str, torch.Tensor]] = []
            for i in todo:
                lk = looked[keys[i]]
                if lk.tensor is not None:
                    results[i] = (lk.tensor, tier.name)
                elif lk.reason != MISSING:
                    reasons[i] = lk.reason
            for key, lk in looked.items():
                if lk.tensor is not None:
                    promote.append((key, lk.tensor))
            if promote:
                for upper in self.tiers[:level]:
                    upper.put_many(promote, self.fingerprint)
        out: list[tuple[torch.Tensor | None, str]] = []
        for i, r in enumerate(results):
            if r is None:
                self._misses[reasons[i]] += 1
                out.append((None, reasons[i]))
            else:
                self._hits += 1
                out.append(r)
        return out

    def put_many(self, blocks: list[tuple[str, torch.Tensor]]) -> int:
        """Store blocks in every tier; return how many the durable tier newly accepted.

        Keys the durable tier already holds are skipped there (they are content-addressed: same
        key, same content). The durable tier may hold accepted blocks in its write buffer until
        `flush()`; storage faults are logged and counted (`puts_failed`), never raised.
        """
        for k, t in blocks:
            check_key(k)
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"KV block {k} payload must be a torch.Tensor, got {type(t).__name__}")
        written = self.durable.put_many(blocks, self.fingerprint)
        self._puts_skipped += len({k for k, _ in blocks}) - written
        for tier in self.tiers[:-1]:
            tier.put_many(blocks, self.fingerprint)
        return written

    def expect_chain(self, keys: list[str]) -> None:
        """`keys` are one prompt's chain, in order, that later put_many calls will store piece by
        piece (a prefill in several chunks): the durable tier keeps it contiguous in one segment,
        so a reader fetches it in one byte range. Advisory; the connector calls it when it plans
        a sequence."""
        fn = getattr(self.durable, "expect_chain", None)
        if fn is not None:
            fn(keys)

    def locations(self, keys: list[str]) -> list[dict[str, Any] | None]:
        """Where the durable tier holds each key (segment, offset, length, checksums, dtype, shape),
        or None: prefill puts these in its manifests, after flush(), so decode needs no index."""
        fn = getattr(self.durable, "locations", None)
        if fn is None:
            return [None] * len(keys)
        return [None if loc is None else entry_location(*loc) for loc in fn(keys, self.fingerprint)]

    def add_locations(self, locations: list[dict[str, Any]], source: str = "manifest") -> None:
        """Tell the durable tier where blocks are (as :meth:`locations` gave them); IndexInvalid
        names the field of the first bad one, and none is added then."""
        fn = getattr(self.durable, "add_locations", None)
        if fn is not None:
            fn([parse_location(d, source, f"block_locations.{i}", self.fingerprint) for i, d in enumerate(locations)])

    def flush(self) -> int:
        """Write what the durable tier holds in its buffer; return how many blocks it wrote."""
        flush = getattr(self.durable, "flush", None)
        return flush() if flush is not None else 0

    def close(self) -> None:
        self.flush()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def request_counts(self) -> dict[str, int]:
        """Object-store requests made so far, by kind (GET, PUT, LIST, HEAD, DELETE), all tiers."""
        out = dict.fromkeys(REQUEST_KINDS, 0)
        for tier in self.tiers:
            layout = getattr(tier, "layout", None)
            if layout is not None:
                for k, v in layout.requests.snapshot().items():
                    out[k] += v
        return out

    def blocks_not_stored(self) -> int:
        """Blocks accepted by put_many that the durable tier then failed to write (see puts_failed)."""
        return self.durable.counters.blocks_failed - self._failed_base

    def bytes_written_by_tier(self) -> dict[str, int]:
        return {t.name: t.counters.bytes_written for t in self.tiers}

    def stats(self) -> dict[str, Any]:
        """Hits and misses (by reason) overall and per tier, blocks/bytes held, bytes moved, read bandwidth.

        Flushes the write buffer first, so the counts say what is durable."""
        self.flush()
        return {
            "fingerprint": self.fingerprint,
            "hits": self._hits,
            "misses": sum(self._misses.values()),
            "misses_by_reason": dict(self._misses),
            "puts_skipped": self._puts_skipped,
            "puts_failed": self.blocks_not_stored(),  # blocks the durable tier could not store (faults)
            "object_requests": self.request_counts(),
            "tiers": {t.name: t.stats() for t in self.tiers},
        }

    def gc(self, now: float | None = None) -> dict[str, Any]:
        """Apply the durable tier's TTL and size policy (see gc.gc_objects)."""
        tier = self.durable
        if not isinstance(tier, ObjectStoreTier):
            return {}
        return tier.gc(now=now)


def _layout(url: str, storage_options: dict[str, Any] | None) -> ObjectLayout:
    # Bounded timeouts here too: `kv stats` on an unreachable store fails in seconds.
    fs, root = open_store(url, storage_options)
    return ObjectLayout(fs, root)


def kv_stats(url: str, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """What the durable store at `url` holds: packs, blocks and bytes, per fingerprint.

    Raises StoreLayoutError for a store in another layout."""
    layout = _layout(url, storage_options)
    ensure_layout(layout, RetryPolicy(), create=False)
    out = object_stats(layout)
    out["url"] = redact(url)
    return out


def kv_compact(url: str, storage_options: dict[str, Any] | None = None, *, grace_s: float = 3600.0,
               now: float | None = None) -> dict[str, Any]:
    """Fold the store's per-writer index files into a new partitioned generation
    (compaction.compact_index); safe to kill, and to run twice at once."""
    if grace_s < 0:
        raise ValueError(f"kv_compact grace_s must be >= 0, got {grace_s}")
    t0 = time.monotonic()
    layout = _layout(url, storage_options)
    ensure_layout(layout, RetryPolicy(), create=False)
    out = compact_index(layout, RetryPolicy(), now=now, grace_s=grace_s)
    out["url"] = redact(url)
    out["compact_s"] = time.monotonic() - t0
    return out


def kv_gc(
    url: str,
    ttl_s: float | None,
    max_bytes: int | None,
    storage_options: dict[str, Any] | None = None,
    now: float | None = None,
    unused_s: float | None = None,
    rewrite_below: float = DEFAULT_REWRITE_BELOW,
    rewrite_grace_s: float = DEFAULT_REWRITE_GRACE_S,
) -> dict[str, Any]:
    """Delete packs older than `ttl_s` seconds, those not used (read or written) for `unused_s`
    seconds, then the oldest until at most `max_bytes` remain. With `unused_s`, a segment whose
    live blocks hold less than `rewrite_below` of its bytes is rewritten, and the old one deleted
    once the copy is `rewrite_grace_s` old (rewrite.py)."""
    if not 0 <= rewrite_below <= 1:
        raise ValueError(f"kv_gc rewrite_below must be in [0, 1], got {rewrite_below}")
    if rewrite_grace_s < 0:
        raise ValueError(f"kv_gc rewrite_grace_s must be >= 0, got {rewrite_grace_s}")
    if ttl_s is not None and ttl_s <= 0:
        raise ValueError(f"kv_gc ttl_s must be positive, got {ttl_s}")
    if unused_s is not None and unused_s <= 0:
        raise ValueError(f"kv_gc unused_s must be positive, got {unused_s}")
    if max_bytes is not None and max_bytes < 0:
        raise ValueError(f"kv_gc max_bytes must be >= 0, got {max_bytes}")
    t0 = time.monotonic()
    layout = _layout(url, storage_options)
    ensure_layout(layout, RetryPolicy(), create=False)
    out = gc_objects(layout, ttl_s, max_bytes, now=now, unused_s=unused_s, rewrite_below=rewrite_below,
                     rewrite_grace_s=rewrite_grace_s)
    # The index is compacted after the deletes, so its newest generation names no deleted segment.
    out["compaction"] = compact_index(layout, RetryPolicy(), now=now)
    out["url"] = redact(url)
    out["gc_s"] = time.monotonic() - t0
    return out
