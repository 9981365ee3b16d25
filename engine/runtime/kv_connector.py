"""The bridge between the paged KV cache and a content-addressed block store.

Who calls what, and when (the scheduler never touches tensors, the runner never sees keys):
- Scheduler, on admitting a sequence: ``match(seq, num_local_blocks)`` returns the keys of the
  prompt blocks after the local prefix-cache hit that the store holds *and* that are cheaper to
  fetch than to recompute. The scheduler allocates blocks for them and counts them as computed.
- LLM, before the step runs: ``load(keys, block_ids, kv_cache)`` fetches them and copies them
  into their blocks; it returns how many leading blocks arrived intact. A miss (missing,
  truncated, checksum, io_error...) makes the sequence recompute from that block on.
- LLM, before the step's forward pass: ``before_step(step)`` orders the compute stream after any
  save still copying out a block that the step is about to write.
- LLM, after the step: ``save(blocks, kv_cache)`` queues newly completed prompt blocks for the
  store; ``poll()`` (right after a step is launched) writes the saves whose copies have landed,
  ``drain()`` (when the engine runs out of work) all of them.
- Whoever ends a stage (a prefill shard): ``flush()`` makes what the store buffered durable;
  ``stats.to_json()`` flushes too, so the counts it gives (bytes written, object-store requests
  by kind) say what really reached the store.

Copies go through a staging pool (:mod:`kvbatch.engine.runtime.kv_staging`): pinned host buffers
allocated once, a side stream and events on CUDA, the same code with plain buffers and no-op
fences on the CPU. ``staging=False`` keeps the direct per-block copies, the readable reference.

The store is anything with ``contains``/``lookup``/``get_many``/``put_many``/``stats``
(``kvbatch.io``'s ``KVStore``): the engine does not import storage code.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from kvbatch.engine.runtime.block_hash import window_key
from kvbatch.engine.runtime.kv_staging import (
    DEFAULT_BUFFER_BYTES,
    DEFAULT_BUFFERS,
    CopyEngine,
    KVStaging,
    block_shape,
    copy_engine_for,
)
from kvbatch.engine.runtime.sequence import Sequence


class BlockStore(Protocol):
    def contains(self, keys: list[str]) -> list[bool]: ...

    def lookup(self, keys: list[str]) -> list[str]:
        """``contains`` with the reason of each "no" (``""`` for a key the store holds)."""
        ...

    def get_many(self, keys: list[str]) -> list[tuple[torch.Tensor | None, str]]: ...

    def put_many(self, blocks: list[tuple[str, torch.Tensor]]) -> int: ...

    def stats(self) -> dict[str, Any]: ...

    # Optional (KVStore has them): flush(), request_counts() -> {kind: n}, bytes_written_by_tier(),
    # expect_chain(keys) (a sequence's chain, to keep its pieces contiguous).


@dataclass
class ConnectorStats:
    blocks_loaded: int = 0
    blocks_written: int = 0
    blocks_skipped_existing: int = 0
    tokens_loaded_by_tier: Counter = field(default_factory=Counter)
    bytes_loaded_by_tier: Counter = field(default_factory=Counter)
    # Seconds and bytes of the loads served entirely by one tier ("mixed" when a call spanned
    # several): the source of the per-tier bandwidth, fetch + verify + copy into the cache.
    load_s_by_tier: Counter = field(default_factory=Counter)
    timed_bytes_by_tier: Counter = field(default_factory=Counter)
    misses_by_reason: Counter = field(default_factory=Counter)
    decisions: Counter = field(default_factory=Counter)  # "load" / "recompute" per request
    decisions_by_tier: Counter = field(default_factory=Counter)  # "<tier>:load" / "<tier>:recompute" per block
    tier_bytes_per_s: dict[str, float] = field(default_factory=dict)  # the bandwidths the decisions used
    est_load_s: float = 0.0
    est_recompute_s: float = 0.0
    bytes_written: int = 0
    write_s: float = 0.0
    # What the store itself counted since the connector was made (object-store requests by kind,
    # bytes written per tier), read when the stats are reported; {} for a store without counters.
    store_counts: Callable[[], dict[str, Any]] | None = None

    def to_json(self) -> dict[str, Any]:
        store = self.store_counts() if self.store_counts is not None else {}
        # Blocks the store accepted but could not write when it flushed them are not written.
        failed = min(int(store.get("blocks_failed", 0)), self.blocks_written)
        return {
            "object_requests": store.get("object_requests", dict.fromkeys(REQUEST_KINDS, 0)),
            "kv_bytes_written_by_tier": store.get("kv_bytes_written_by_tier", {}),
            "blocks_loaded": self.blocks_loaded,
            "blocks_written": self.blocks_written - failed,
            "blocks_skipped_existing": self.blocks_skipped_existing,
            "prompt_tokens_served_by_tier": dict(self.tokens_loaded_by_tier),
            "kv_bytes_read_by_tier": dict(self.bytes_loaded_by_tier),
            "load_bandwidth_bytes_per_s_by_tier": {
                t: round(self.timed_bytes_by_tier[t] / s, 1) for t, s in self.load_s_by_tier.items() if s > 0},
            "kv_bytes_written": self.bytes_written * (self.blocks_written - failed) // max(self.blocks_written, 1),
            "write_s": round(self.write_s, 4),
            "misses_by_reason": dict(self.misses_by_reason),
            "retain_or_recompute": {
                "decisions": dict(self.decisions),
                "blocks_by_tier": dict(self.decisions_by_tier),
                "bytes_per_s_by_tier": {t: round(v, 1) for t, v in self.tier_bytes_per_s.items()},
                "est_load_s": round(self.est_load_s, 6),
                "est_recompute_s": round(self.est_recompute_s, 6),
            },
        }


REQUEST_KINDS = ("GET", "PUT", "LIST", "HEAD", "DELETE")  # as kvbatch.io.kvstore.request_counts counts them
@dataclass
class TierCost:
    """What loading from one tier costs: its bandwidth (None: the connector's overall figure until
    a load from this tier is measured), the latency of one request, and its price in dollars."""

    bytes_per_s: float | None = None
    request_s: float = 0.0
    usd_per_request: float = 0.0


def default_tier_costs() -> dict[str, TierCost]:
    """Memory and disk: no request to speak of. An object store: a first byte takes ~20 ms, and a
    GET is billed (S3 standard: $0.0004 per 1,000)."""
    return {"memory": TierCost(), "disk": TierCost(), "object": TierCost(request_s=0.02, usd_per_request=4e-7)}


MISSING = "missing"  # the store's reason for a key no tier holds (kvbatch.io.kvstore.tiers says the same)


class KVConnector:
    """Loads and saves whole KV blocks (``kv_cache[:, :, block]``: ``[layers, 2, block_size,
    kv_heads, head_dim]`` for the Llama family, ``[layers, 1, block_size, 1, latent + rope]`` for
    MLA) by key. A stored block whose dtype is not the cache's is a miss ("dtype"); one whose
    shape (the layout: layers, K/V, block size, heads, head dim) is not, a miss ("shape").

    Retain-or-recompute, per tier: fetching the leading k stored blocks is estimated, tier by
    tier, at ``blocks * block_bytes / that tier's bandwidth`` plus one request's latency per tier
    read (and, with ``usd_per_device_s``, the request's price as the device-seconds it would buy);
    recomputing them at ``k * block_size / prefill_tokens_per_s``. The k that saves most is
    loaded (none if loading never beats recomputing), so the blocks of a fast tier load while
    those behind them on a slow tier are recomputed. Each tier's bandwidth and the prefill rate
    start from guesses and follow measurements (exponential moving averages) as the run goes.
    """

    def __init__(self, store: BlockStore, block_size: int, block_bytes: int, *, write: bool = True, window: int = 0,
                 load_bytes_per_s: float = 200e6, prefill_tokens_per_s: float = 500.0,
                 tier_costs: dict[str, TierCost] | None = None, usd_per_device_s: float = 0.0,
                 staging: bool = True, copy_engine: CopyEngine | None = None,
                 staging_buffers: int = DEFAULT_BUFFERS, staging_buffer_bytes: int | None = None) -> None:
        self.store = store
        # The staging pool is made at the first load or save, for the cache's device; the buffers
        # hold at most the whole cache (a tiny test cache does not get 4 x 8 MiB).
        self.staging = staging
        self._copy_engine = copy_engine
        self._staging_buffers = staging_buffers
        self._staging_buffer_bytes = staging_buffer_bytes
        self._staging: KVStaging | None = None
        self.block_size = block_size
        self.block_bytes = block_bytes
        self.write = write
        # A model whose sliding layers keep only their window (window_blocks.py): the store holds
        # those layers' part of a block apart (block_hash.window_key), for a prompt's last window
        # only, and a stored prefix is loaded only up to a point whose window the store holds.
        self.window = window
        self.load_bytes_per_s = load_bytes_per_s
        self.prefill_tokens_per_s = prefill_tokens_per_s
        self.tier_costs = tier_costs if tier_costs is not None else default_tier_costs()
        self.usd_per_device_s = usd_per_device_s
        self.stats = ConnectorStats()
        self._requests_base = self._requests()
        self._written_base = self._written()
        self._failed_base = self._failed()
        self.stats.store_counts = self._store_counts

    def _requests(self) -> dict[str, int]:
        fn = getattr(self.store, "request_counts", None)
        return dict(fn()) if fn is not None else {}

    def _failed(self) -> int:
        fn = getattr(self.store, "blocks_not_stored", None)
        return int(fn()) if fn is not None else 0

    def _written(self) -> dict[str, int]:
        fn = getattr(self.store, "bytes_written_by_tier", None)
        return dict(fn()) if fn is not None else {}

    def _store_counts(self) -> dict[str, Any]:
        self.flush()
        req, written = self._requests(), self._written()
        return {
            "object_requests": {k: req.get(k, 0) - self._requests_base.get(k, 0) for k in REQUEST_KINDS},
            "kv_bytes_written_by_tier": {t: n - self._written_base.get(t, 0) for t, n in written.items()},
            "blocks_failed": self._failed() - self._failed_base,
        }

    def flush(self) -> None:
        """Make the blocks the store buffered durable (the end of a prefill shard): queued saves
        are written first."""
        self.drain()
        fn = getattr(self.store, "flush", None)
        if fn is not None:
            fn()

    # -- scheduler side --------------------------------------------------------------------------
    def match(self, seq: Sequence, num_local_blocks: int, keys: list[str]) -> list[str]:
        """Keys of the stored blocks that continue the local hit, if fetching beats recomputing.
        ``keys`` are the sequence's full-block keys (the last token is never covered)."""
        todo = keys[num_local_blocks:]
        if not todo:
            return []
        expect = getattr(self.store, "expect_chain", None)
        if self.write and expect is not None:
            # The sequence's identity for the saves to come: a prompt prefilled in several chunks
            # is saved a piece per step, between other prompts'; the store keeps its chain whole.
            expect(keys[max(num_local_blocks - 1, 0):])
        locate = getattr(self.store, "locate", None)
        reasons, tiers = locate(todo) if locate is not None else (self.store.lookup(todo), None)
        # Blocks the store could not look up (a tier's breaker open, a failed index listing) are
        # misses like a failed load's: else an outage leaves misses_by_reason empty while every
        # block is recomputed. A block simply not stored is no miss here, as before.
        for reason in reasons:
            if reason and reason != MISSING:
                self.stats.misses_by_reason[reason] += 1
        n = 0
        while n < len(reasons) and not reasons[n]:
            n += 1
        if n == 0:
            return []
        k, est_load, est_recompute = self._best_prefix(tiers[:n] if tiers is not None else ["store"] * n)
        if k and self.window:
            k = self._with_window(num_local_blocks, keys, k)
            if k == 0:
                self.stats.misses_by_reason["window"] += 1
        self.stats.est_load_s += est_load
        self.stats.est_recompute_s += est_recompute
        for i, tier in enumerate(tiers[:n] if tiers is not None else ["store"] * n):
            self.stats.decisions_by_tier[f"{tier}:{'load' if i < k else 'recompute'}"] += 1
        if k == 0:
            self.stats.decisions["recompute"] += 1
            return []
        self.stats.decisions["load"] += 1
        return todo[:k]

    def window_start(self, hit_blocks: int) -> int:
        """The first block whose sliding-layer part a hit of ``hit_blocks`` blocks needs."""
        return max(0, hit_blocks * self.block_size - self.window + 1) // self.block_size

    def _with_window(self, local: int, keys: list[str], k: int) -> int:
        """The longest ``k' <= k`` stored blocks after the local hit whose window the store (or
        the local hit, before ``local``) holds; one lookup for every candidate."""
        lo = max(local, self.window_start(local + 1))
        held = [not reason for reason in self.store.lookup([window_key(keys[i]) for i in range(lo, local + k)])]
        for kk in range(k, 0, -1):
            start = max(local, self.window_start(local + kk))
            if all(held[start - lo:local + kk - lo]):
                return kk
        return 0

    def tier_bytes_per_s(self, tier: str) -> float:
        cost = self.tier_costs.get(tier)
        bw = cost.bytes_per_s if cost is not None and cost.bytes_per_s is not None else self.load_bytes_per_s
        self.stats.tier_bytes_per_s[tier] = bw
        return bw

    def _best_prefix(self, tiers: list[str]) -> tuple[int, float, float]:
        """(k, est. load seconds, est. recompute seconds) for the leading k blocks that save most.

        Each maximal run of blocks on one tier costs one request (a chain's run is one ranged
        read); k = 0 when no prefix loads faster than it recomputes. The estimates returned are
        for all the blocks when k = 0, else for the k chosen."""
        per_block_recompute = self.block_size / self.prefill_tokens_per_s
        best_k, best_saving = 0, 0.0
        load = recompute = 0.0
        best_load, best_recompute = 0.0, 0.0
        for i, tier in enumerate(tiers):
            cost = self.tier_costs.get(tier, TierCost())
            load += self.block_bytes / self.tier_bytes_per_s(tier)
            if i == 0 or tiers[i - 1] != tier:  # a new run: one more request
                load += cost.request_s
                if self.usd_per_device_s > 0:
                    load += cost.usd_per_request / self.usd_per_device_s
            recompute += per_block_recompute
            if recompute - load > best_saving:
                best_k, best_saving, best_load, best_recompute = i + 1, recompute - load, load, recompute
        if best_k == 0:
            return 0, load, recompute
        return best_k, best_load, best_recompute

    # -- worker side ---------------------------------------------------------------------------------
    def stager(self, kv_cache: torch.Tensor) -> KVStaging:
        """The staging pool, made once, for ``kv_cache``'s device."""
        if self._staging is None:
            engine = self._copy_engine or copy_engine_for(kv_cache.device)
            nbytes = self._staging_buffer_bytes or min(DEFAULT_BUFFER_BYTES, kv_cache.numel() * kv_cache.element_size())
            self._staging = KVStaging(engine, self._staging_buffers, nbytes)
        return self._staging

    def load(self, keys: list[str], block_ids: list[int], kv_cache: torch.Tensor, tokens: bool = True) -> int:
        """Copy the stored blocks into ``kv_cache``; returns how many leading ones arrived. With
        staging the copies are queued (on CUDA: a side stream) and the compute stream is ordered
        after them: the count is known on the host, nothing waits for the device. ``tokens``:
        count their tokens as loaded (not for a block's window part: its full part counted them)."""
        self.poll()
        started = time.perf_counter()
        got = self.store.get_many(keys)
        elapsed = time.perf_counter() - started
        n = 0
        nbytes_total = 0
        tiers = set()
        shape = block_shape(kv_cache)
        arrived: list[torch.Tensor] = []
        for tensor, where in got[:len(block_ids)]:
            if tensor is None or tensor.dtype != kv_cache.dtype or tuple(tensor.shape) != shape:
                reason = where if tensor is None else "dtype" if tensor.dtype != kv_cache.dtype else "shape"
                self.stats.misses_by_reason[reason] += 1
                break
            arrived.append(tensor)
            nbytes = tensor.numel() * tensor.element_size()
            nbytes_total += nbytes
            if tokens:
                self.stats.tokens_loaded_by_tier[where] += self.block_size
            self.stats.bytes_loaded_by_tier[where] += nbytes
            tiers.add(where)
            n += 1
        copy_started = time.perf_counter()
        if self.staging:
            self.stager(kv_cache).load(kv_cache, arrived, block_ids[:n])
        else:
            for tensor, bid in zip(arrived, block_ids):
                kv_cache[:, :, bid].copy_(tensor)
        elapsed += time.perf_counter() - copy_started
        self.stats.blocks_loaded += n
        if nbytes_total:
            tier = tiers.pop() if len(tiers) == 1 else "mixed"
            self.stats.load_s_by_tier[tier] += elapsed
            self.stats.timed_bytes_by_tier[tier] += nbytes_total
            if tier != "mixed" and elapsed > 0:  # this tier's own bandwidth, measured
                cost = self.tier_costs.setdefault(tier, TierCost())
                before = cost.bytes_per_s if cost.bytes_per_s is not None else self.load_bytes_per_s
                cost.bytes_per_s = 0.7 * before + 0.3 * (nbytes_total / elapsed)
        if nbytes_total and elapsed > 0:
            self.load_bytes_per_s = 0.7 * self.load_bytes_per_s + 0.3 * (nbytes_total / elapsed)
        return n

    def save(self, blocks: list[tuple[str, int]], kv_cache: torch.Tensor) -> None:
        """Write ``(key, block id)`` blocks of ``kv_cache`` to the store. With staging the copies
        out are queued after the step that wrote them and the store write follows their fence
        (at once on the CPU; on CUDA at the next ``poll``)."""
        if not self.write or not blocks:
            return
        if not self.staging:
            payload = [(key, kv_cache[:, :, bid].clone()) for key, bid in blocks]
            self._put(payload)
            return
        self.stager(kv_cache).save(kv_cache, [k for k, _ in blocks], [b for _, b in blocks])
        self.poll()

    def _put(self, payload: list[tuple[str, torch.Tensor]]) -> None:
        started = time.perf_counter()
        written = self.store.put_many(payload)
        self.stats.write_s += time.perf_counter() - started
        self.stats.blocks_written += written
        self.stats.blocks_skipped_existing += len(payload) - written
        if payload:  # one save's blocks are of one kind: whole blocks, or (sliding models) window parts
            self.stats.bytes_written += written * payload[0][1].numel() * payload[0][1].element_size()

    def _write_saved(self, wait: bool) -> None:
        if self._staging is None:
            return
        for keys, tensors in self._staging.collect(wait):
            self._put(list(zip(keys, tensors)))

    def poll(self) -> None:
        """Write the queued saves whose copies have landed (no wait)."""
        self._write_saved(wait=False)

    def drain(self) -> None:
        """Write every queued save, waiting for its copies on the host."""
        self._write_saved(wait=True)

    def pending_saves(self) -> int:
        return self._staging.pending_saves() if self._staging is not None else 0

    def before_step(self, step: list[Any]) -> None:
        """Order the compute stream after any save still copying out a block that ``step`` (the
        scheduler's entries) writes: a block freed after its save may be given to another
        sequence before its copy has landed."""
        if self._staging is None or not self._staging.copying_out():
            return
        bs = self.block_size
        written: list[int] = []
        for s in step:
            seq, start = s.seq, s.seq.num_computed_tokens
            written += seq.block_table[start // bs:(start + s.num_new_tokens - 1) // bs + 1]
            # window blocks are another cache's ids: guarding them too only waits more, never less
            written += seq.window_table[start // bs:(start + s.num_new_tokens - 1) // bs + 1]
        self._staging.guard(written)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        if tokens >= self.block_size and seconds > 0:
            self.prefill_tokens_per_s = 0.7 * self.prefill_tokens_per_s + 0.3 * (tokens / seconds)
