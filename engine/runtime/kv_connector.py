"""The bridge between the paged KV cache and a content-addressed block store.

Who calls what, and when (the scheduler never touches tensors, the runner never sees keys):
- Scheduler, on admitting a sequence: ``match(seq, num_local_blocks)`` returns the keys of the
  prompt blocks after the local prefix-cache hit that the store holds *and* that are cheaper to
  fetch than to recompute. The scheduler allocates blocks for them and counts them as computed.
- LLM, before the step runs: ``load(keys, block_ids, kv_cache)`` fetches them and copies them
  into their blocks; it returns how many leading blocks arrived intact. A miss (missing,
  truncated, checksum, io_error...) makes the sequence recompute from that block on.
- LLM, after the step: ``save(blocks, kv_cache)`` writes newly completed prompt blocks through.

The store is anything with ``contains``/``lookup``/``get_many``/``put_many``/``stats``
(``kvbatch.io``'s ``KVStore``): the engine does not import storage code.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from kvbatch.engine.runtime.sequence import Sequence


class BlockStore(Protocol):
    def contains(self, keys: list[str]) -> list[bool]: ...

    def lookup(self, keys: list[str]) -> list[str]:
        """``contains`` with the reason of each "no" (``""`` for a key the store holds)."""
        ...

    def get_many(self, keys: list[str]) -> list[tuple[torch.Tensor | None, str]]: ...

    def put_many(self, blocks: list[tuple[str, torch.Tensor]]) -> int: ...

    def stats(self) -> dict[str, Any]: ...


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
    est_load_s: float = 0.0
    est_recompute_s: float = 0.0
    bytes_written: int = 0
    write_s: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "blocks_loaded": self.blocks_loaded,
            "blocks_written": self.blocks_written,
            "blocks_skipped_existing": self.blocks_skipped_existing,
            "prompt_tokens_served_by_tier": dict(self.tokens_loaded_by_tier),
            "kv_bytes_read_by_tier": dict(self.bytes_loaded_by_tier),
            "load_bandwidth_bytes_per_s_by_tier": {
                t: round(self.timed_bytes_by_tier[t] / s, 1) for t, s in self.load_s_by_tier.items() if s > 0},
            "kv_bytes_written": self.bytes_written,
            "write_s": round(self.write_s, 4),
            "misses_by_reason": dict(self.misses_by_reason),
            "retain_or_recompute": {
                "decisions": dict(self.decisions),
                "est_load_s": round(self.est_load_s, 6),
                "est_recompute_s": round(self.est_recompute_s, 6),
            },
        }


MISSING = "missing"  # the store's reason for a key no tier holds (kvbatch.io.kv_tiers says the same)


class KVConnector:
    """Loads and saves whole KV blocks (``kv_cache[:, :, block]``: ``[layers, 2, block_size,
    kv_heads, head_dim]`` for the Llama family, ``[layers, 1, block_size, 1, latent + rope]`` for
    MLA) by key. A stored block whose shape or dtype is not the cache's is a miss ("shape").

    Retain-or-recompute: fetching n blocks is estimated at ``n * block_bytes / load_bandwidth``,
    recomputing them at ``n * block_size / prefill_tokens_per_s``; both rates start from the
    given guesses and follow measurements (exponential moving averages) as the run goes.
    """

    def __init__(self, store: BlockStore, block_size: int, block_bytes: int, *, write: bool = True,
                 load_bytes_per_s: float = 200e6, prefill_tokens_per_s: float = 500.0) -> None:
        self.store = store
        self.block_size = block_size
        self.block_bytes = block_bytes
        self.write = write
        self.load_bytes_per_s = load_bytes_per_s
        self.prefill_tokens_per_s = prefill_tokens_per_s
        self.stats = ConnectorStats()

    # -- scheduler side --------------------------------------------------------------------------
    def match(self, seq: Sequence, num_local_blocks: int, keys: list[str]) -> list[str]:
        """Keys of the stored blocks that continue the local hit, if fetching beats recomputing.
        ``keys`` are the sequence's full-block keys (the last token is never covered)."""
        todo = keys[num_local_blocks:]
        if not todo:
            return []
        reasons = self.store.lookup(todo)
        # Blocks the store could not look up (a tier's breaker open, a failed index listing) are
        # misses like a failed load's: else an outage leaves misses_by_reason empty while every
        # block is recomputed. A block simply not stored is no miss here, as before.
        for reason in reasons:
            if reason and reason != MISSING:
                self.stats.misses_by_reason[reason] += 1
        present = [not reason for reason in reasons]
        n = 0
        while n < len(present) and present[n]:
            n += 1
        if n == 0:
            return []
        est_load = n * self.block_bytes / self.load_bytes_per_s
        est_recompute = n * self.block_size / self.prefill_tokens_per_s
        self.stats.est_load_s += est_load
        self.stats.est_recompute_s += est_recompute
        if est_load > est_recompute:
            self.stats.decisions["recompute"] += 1
            return []
        self.stats.decisions["load"] += 1
        return todo[:n]

    # -- worker side ---------------------------------------------------------------------------------
    def load(self, keys: list[str], block_ids: list[int], kv_cache: torch.Tensor) -> int:
        """Copy the stored blocks into ``kv_cache``; returns how many leading ones arrived."""
        started = time.perf_counter()
        got = self.store.get_many(keys)
        elapsed = time.perf_counter() - started
        n = 0
        nbytes_total = 0
        tiers = set()
        for (tensor, where), bid in zip(got, block_ids):
            expected = kv_cache[:, :, bid]
            if tensor is None or tuple(tensor.shape) != tuple(expected.shape) or tensor.dtype != expected.dtype:
                reason = where if tensor is None else "shape"
                self.stats.misses_by_reason[reason] += 1
                break
            expected.copy_(tensor)
            nbytes = tensor.numel() * tensor.element_size()
            nbytes_total += nbytes
            self.stats.tokens_loaded_by_tier[where] += self.block_size
            self.stats.bytes_loaded_by_tier[where] += nbytes
            tiers.add(where)
            n += 1
        self.stats.blocks_loaded += n
        if nbytes_total:
            tier = tiers.pop() if len(tiers) == 1 else "mixed"
            self.stats.load_s_by_tier[tier] += elapsed
            self.stats.timed_bytes_by_tier[tier] += nbytes_total
        if nbytes_total and elapsed > 0:
            self.load_bytes_per_s = 0.7 * self.load_bytes_per_s + 0.3 * (nbytes_total / elapsed)
        return n

    def save(self, blocks: list[tuple[str, int]], kv_cache: torch.Tensor) -> None:
        if not self.write or not blocks:
            return
        started = time.perf_counter()
        payload = [(key, kv_cache[:, :, bid].clone()) for key, bid in blocks]
        written = self.store.put_many(payload)
        self.stats.write_s += time.perf_counter() - started
        self.stats.blocks_written += written
        self.stats.blocks_skipped_existing += len(blocks) - written
        self.stats.bytes_written += written * self.block_bytes

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        if tokens >= self.block_size and seconds > 0:
            self.prefill_tokens_per_s = 0.7 * self.prefill_tokens_per_s + 0.3 * (tokens / seconds)
