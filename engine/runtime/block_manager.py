"""The block pool: which cache blocks each sequence holds, and which full blocks are reusable.

Protocol (paired verbs, called by the scheduler only; no tensors here):
- ``can_allocate(seq, n)`` / ``allocate(seq, n)`` on first admission: reuse the longest cached
  prefix (re-checking token ids on every hit) and reserve blocks for ``n`` more tokens.
- ``can_append(seq, n)`` / ``append_slots(seq, n)`` before each later step.
- ``commit(seq)`` after a step: hash the blocks that became full so others can reuse them.
- ``trim(seq)`` after speculative verification: give back the slots of rejected drafts.
- ``free(seq)`` when a sequence finishes or is preempted.

A free block keeps its content and hash until it is reused (LRU), so a prefix survives the
requests that computed it. Blocks without a hash are reused first.

A model with sliding-window layers beside full ones passes a :class:`WindowPool`: every verb
then also keeps each sequence's window blocks (window_blocks.py), and a prefix hit is as long
as both pools allow.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from kvbatch.engine.runtime.block_hash import chain_keys
from kvbatch.engine.runtime.sequence import Sequence
from kvbatch.engine.runtime.window_blocks import WindowPool


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    key: str | None = None
    token_ids: tuple[int, ...] = ()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, root_key: str, enable_prefix_caching: bool = True,
                 window: WindowPool | None = None):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.block_size = block_size
        self.root_key = root_key
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_blocks: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.key_to_block: dict[str, int] = {}
        self.hits_tokens = 0
        self.queried_tokens = 0
        self.window = window
        self._window_hit: tuple[int, list[int]] | None = None  # (seq_id, window blocks) of the last hit

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix lookup ----------------------------------------------------------------------
    def prefix_keys(self, seq: Sequence) -> list[str]:
        """Keys of the full blocks that a hit may cover (all but the last token's block when
        the sequence is block-aligned: the last token must be computed to give logits)."""
        usable = (seq.num_tokens - 1) // self.block_size
        return chain_keys(self.root_key, seq.token_ids[: usable * self.block_size], self.block_size)

    def cached_prefix(self, seq: Sequence, keys: list[str] | None = None) -> list[int]:
        """Ids of the cached blocks that hold a prefix of ``seq``. At least one token is always
        left to compute, since the last one must produce logits. ``keys``: ``prefix_keys(seq)``
        when the caller has them already."""
        if not self.enable_prefix_caching:
            return []
        if keys is None:
            keys = self.prefix_keys(seq)
        hit: list[int] = []
        for i, key in enumerate(keys):
            bid = self.key_to_block.get(key)
            if bid is None:
                break
            tokens = tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
            if self.blocks[bid].token_ids != tokens:  # a hash collision must never serve wrong KV
                break
            hit.append(bid)
        if self.window is not None:
            n, ids = self.window.hit(seq, keys, len(hit))
            hit = hit[:n]
            self._window_hit = (seq.seq_id, ids)
        return hit

    def _window_cached(self, seq: Sequence, cached: list[int]) -> list[int]:
        """The window blocks of the hit ``cached`` (found by ``cached_prefix`` just before)."""
        assert self.window is not None
        if self._window_hit is not None and self._window_hit[0] == seq.seq_id:
            return self._window_hit[1]
        n, ids = self.window.hit(seq, self.prefix_keys(seq), len(cached))
        assert n == len(cached), "a hit without its window blocks"
        return ids

    # -- admission ----------------------------------------------------------------------------
    def can_allocate(self, seq: Sequence, num_new_tokens: int, cached: list[int], loaded: int = 0) -> bool:
        """``loaded``: of ``num_new_tokens``, the blocks after the hit that come from the KV store."""
        reusable_free = sum(1 for b in cached if self.blocks[b].ref_count == 0)
        total = len(cached) * self.block_size + num_new_tokens
        fresh = self.blocks_needed(total) - len(cached)
        if fresh + reusable_free > self.num_free_blocks:
            return False
        return self.window is None or self.window.can_allocate(
            self._window_cached(seq, cached), len(cached), len(cached) + loaded, self.blocks_needed(total))

    def allocate(self, seq: Sequence, num_new_tokens: int, cached: list[int], loaded: int = 0) -> None:
        assert not seq.block_table, "allocate() is for a sequence holding no blocks"
        for bid in cached:
            block = self.blocks[bid]
            if block.ref_count == 0:
                del self.free_blocks[bid]
            block.ref_count += 1
            seq.block_table.append(bid)
        seq.block_hashes = [self.blocks[b].key for b in cached]  # type: ignore[misc]
        seq.num_computed_tokens = len(cached) * self.block_size
        if seq.num_preemptions == 0:
            seq.num_cached_tokens = seq.num_computed_tokens
        self.queried_tokens += seq.num_tokens
        self.hits_tokens += seq.num_computed_tokens
        if self.window is not None:
            window_cached = self._window_cached(seq, cached)
            self._window_hit = None
            total = self.blocks_needed(seq.num_computed_tokens + num_new_tokens)
            self.window.allocate(seq, window_cached, len(cached), len(cached) + loaded, total)
        self.append_slots(seq, num_new_tokens)

    # -- growth -----------------------------------------------------------------------------
    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        total = self.blocks_needed(seq.num_computed_tokens + num_new_tokens)
        if total - len(seq.block_table) > self.num_free_blocks:
            return False
        return self.window is None or self.window.can_append(seq, total)

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> None:
        total = self.blocks_needed(seq.num_computed_tokens + num_new_tokens)
        for _ in range(total - len(seq.block_table)):
            seq.block_table.append(self._take_free_block())
        if self.window is not None:
            self.window.append(seq, total)

    def _take_free_block(self) -> int:
        bid, _ = self.free_blocks.popitem(last=False)
        block = self.blocks[bid]
        if block.key is not None and self.key_to_block.get(block.key) == bid:
            del self.key_to_block[block.key]
        block.key, block.token_ids, block.ref_count = None, (), 1
        return bid

    # -- after a step ---------------------------------------------------------------------------
    def commit(self, seq: Sequence) -> list[tuple[str, int]]:
        """Register the blocks that became full; returns ``(key, block_id)`` of each new one."""
        full = seq.num_computed_tokens // self.block_size
        done = len(seq.block_hashes)
        if full <= done:
            if self.window is not None:
                self.window.release(seq)
            return []
        parent = seq.block_hashes[-1] if done else None
        keys = chain_keys(self.root_key, seq.token_ids[: full * self.block_size], self.block_size,
                          start_key=parent, start_block=done)
        new = []
        for i, key in enumerate(keys, start=done):
            seq.block_hashes.append(key)
            bid = seq.block_table[i]
            block = self.blocks[bid]
            if self.enable_prefix_caching and key not in self.key_to_block:
                block.key = key
                block.token_ids = tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
                self.key_to_block[key] = bid
            new.append((key, bid))
        if self.window is not None:
            self.window.commit(seq)
        return new

    def trim(self, seq: Sequence) -> None:
        """Roll back slots reserved past ``seq.num_computed_tokens`` (drafted tokens the verifier
        rejected): blocks holding only such slots go back to the pool. They were never
        committed, so no hash can point at their stale content."""
        keep = self.blocks_needed(seq.num_computed_tokens)
        while len(seq.block_table) > keep:
            bid = seq.block_table.pop()
            block = self.blocks[bid]
            assert block.key is None and block.ref_count == 1, f"block {bid} is shared or committed"
            block.ref_count = 0
            self.free_blocks[bid] = None
            self.free_blocks.move_to_end(bid, last=False)
        if self.window is not None:
            self.window.trim(seq, keep)

    def free(self, seq: Sequence) -> None:
        # Tail blocks first, so a prefix's head outlives its tail in the LRU order.
        for bid in reversed(seq.block_table):
            block = self.blocks[bid]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {bid} freed more often than taken"
            if block.ref_count == 0:
                self.free_blocks[bid] = None
                if block.key is None:
                    self.free_blocks.move_to_end(bid, last=False)
        seq.block_table = []
        seq.block_hashes = []
        if self.window is not None:
            self.window.free(seq)

    # -- invariants (tests) -------------------------------------------------------------------------
    def check_invariants(self, live: list[Sequence]) -> None:
        refs = [0] * len(self.blocks)
        for seq in live:
            assert len(set(seq.block_table)) == len(seq.block_table), "a sequence holds a block twice"
            for bid in seq.block_table:
                refs[bid] += 1
        for block in self.blocks:
            assert block.ref_count == refs[block.block_id], f"block {block.block_id}: ref {block.ref_count} != {refs[block.block_id]}"
            assert (block.ref_count == 0) == (block.block_id in self.free_blocks), f"block {block.block_id} free-list mismatch"
            if block.ref_count > 1:
                assert block.key is not None, f"unhashed block {block.block_id} is shared"
        for key, bid in self.key_to_block.items():
            assert self.blocks[bid].key == key
        if self.window is not None:
            self.window.check_invariants(live)
