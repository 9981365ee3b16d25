"""The tiered, content-addressed KV block store: memory -> local disk -> object store.

Who calls what, and when:
- prefill calls `contains(keys)` to skip blocks some earlier run already stored, then
  `put_many(blocks)` with the new ones (written through to every tier, packed on the durable one);
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
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field

from kvbatch.io.kv_object_tier import (
    CircuitBreaker,
    ObjectLayout,
    ObjectStoreTier,
    RetryPolicy,
    gc_objects,
    object_stats,
    open_store,
)
from kvbatch.io.kv_tiers import IO_ERROR, MISSING, TIER_UNAVAILABLE, DiskTier, Lookup, MemoryTier, Tier, check_key
from kvbatch.io.urls import redact

__all__ = [
    "KVStore",
    "KVStoreConfig",
    "kv_gc",
    "kv_stats",
    "MemoryTier",
    "DiskTier",
    "ObjectStoreTier",
    "Tier",
    "RetryPolicy",
    "CircuitBreaker",
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
    pack_bytes: int = Field(default=64 * 2**20, gt=0)
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
        self._puts_failed = 0

    @classmethod
    def from_config(cls, cfg: KVStoreConfig, fingerprint: str) -> "KVStore":
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
                connect_timeout_s=cfg.connect_timeout_s,
                read_timeout_s=cfg.read_timeout_s,
                breaker_failures=cfg.breaker_failures,
                breaker_cooldown_s=cfg.breaker_cooldown_s,
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
        for k in keys:
            check_key(k)
        reasons = [MISSING] * len(keys)
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
            if why != MISSING:
                tier.counters.misses[why] += sum(not hit for hit in hits)
        for r in reasons:
            if r not in ("", MISSING):
                self._misses[r] += 1
        return reasons

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
        """Store blocks in every tier; return how many the durable tier newly stored.

        Keys the durable tier already holds are skipped there (they are content-addressed: same
        key, same content); storage faults are logged and counted, never raised.
        """
        for k, t in blocks:
            check_key(k)
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"KV block {k} payload must be a torch.Tensor, got {type(t).__name__}")
        failed_before = self.durable.counters.blocks_failed
        written = self.durable.put_many(blocks, self.fingerprint)
        failed = self.durable.counters.blocks_failed - failed_before
        self._puts_failed += failed
        self._puts_skipped += len({k for k, _ in blocks}) - written - failed
        for tier in self.tiers[:-1]:
            tier.put_many(blocks, self.fingerprint)
        return written

    def stats(self) -> dict[str, Any]:
        """Hits and misses (by reason) overall and per tier, blocks/bytes held, bytes moved, read bandwidth."""
        return {
            "fingerprint": self.fingerprint,
            "hits": self._hits,
            "misses": sum(self._misses.values()),
            "misses_by_reason": dict(self._misses),
            "puts_skipped": self._puts_skipped,
            "puts_failed": self._puts_failed,  # blocks the durable tier could not store (faults)
            "tiers": {t.name: t.stats() for t in self.tiers},
        }

    def gc(self, now: float | None = None) -> dict[str, Any]:
        """Apply the durable tier's TTL and size policy (see kv_object_tier.gc_objects)."""
        tier = self.durable
        if not isinstance(tier, ObjectStoreTier):
            return {}
        return tier.gc(now=now)


def _layout(url: str, storage_options: dict[str, Any] | None) -> ObjectLayout:
    # Bounded timeouts here too: `kv stats` on an unreachable store fails in seconds.
    fs, root = open_store(url, storage_options)
    return ObjectLayout(fs, root)


def kv_stats(url: str, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """What the durable store at `url` holds: packs, blocks and bytes, per fingerprint."""
    out = object_stats(_layout(url, storage_options))
    out["url"] = redact(url)
    return out


def kv_gc(
    url: str,
    ttl_s: float | None,
    max_bytes: int | None,
    storage_options: dict[str, Any] | None = None,
    now: float | None = None,
) -> dict[str, Any]:
    """Delete packs older than `ttl_s` seconds, then the oldest until at most `max_bytes` remain."""
    if ttl_s is not None and ttl_s <= 0:
        raise ValueError(f"kv_gc ttl_s must be positive, got {ttl_s}")
    if max_bytes is not None and max_bytes < 0:
        raise ValueError(f"kv_gc max_bytes must be >= 0, got {max_bytes}")
    t0 = time.monotonic()
    out = gc_objects(_layout(url, storage_options), ttl_s, max_bytes, now=now)
    out["url"] = redact(url)
    out["gc_s"] = time.monotonic() - t0
    return out
