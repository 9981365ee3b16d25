"""The sliding layers' block pool: a sliding-window layer keeps only the blocks of its window.

A model that mixes sliding-window layers with full-attention ones (Gemma 3: five of six layers
slide; gpt-oss: every other one) keeps two caches. The full layers' cache holds every block of
every sequence (the :class:`~kvbatch.engine.runtime.block_manager.BlockManager`'s pool); the
sliding layers' cache is this pool, and a sequence holds only the blocks its next token and a
prefix hit at its last block boundary can still attend. One 4,096-token sequence of Gemma-3-12B
(bf16, blocks of 16) then holds 591 MiB instead of 1,536 MiB: 8 of 48 layers for the whole
context, 40 for the 1,024-token window and three blocks (``docs/models.md``).

A sequence's ``window_table`` has one entry per logical block, like its ``block_table``: the same
positions, the same slot arithmetic, so every attention kernel takes it unchanged. Entries before
the window hold :data:`NULL_BLOCK` (block 0, reserved, never written): the kernels read from the
window's first block, the batch-invariant mode reads the null block and masks it.

Prefix caching works as in the full pool: a block that leaves a window keeps its content and
its key in the LRU free list until reused. A prefix hit of ``n`` blocks needs the full layers'
``n`` blocks *and* the window's blocks before position ``n * block_size``; :meth:`WindowPool.hit`
finds the longest ``n`` that has both.
"""

from __future__ import annotations

from collections import OrderedDict

from kvbatch.engine.runtime.sequence import Sequence

NULL_BLOCK = 0


def window_pool_blocks(window: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int) -> int:
    """Blocks that ``max_num_seqs`` sequences' windows can hold at once, the null block included:
    after a step a sequence keeps the window before its last block boundary and its partly
    filled blocks (``ceil((window - 1) / bs) + 3`` blocks at most); a step adds the blocks of its
    tokens (``ceil(max_num_batched_tokens / bs)``, shared by every sequence it runs)."""
    per_seq = -(-(window - 1) // block_size) + 3
    return 1 + max_num_seqs * per_seq + -(-max_num_batched_tokens // block_size)


class WindowPool:
    """Blocks of the sliding layers' cache: which ones each sequence holds, and which full ones
    are reusable. Called by the :class:`BlockManager`, in its own verbs; no tensors here."""

    def __init__(self, num_blocks: int, block_size: int, window: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"a window pool needs the null block and one more, got {num_blocks} blocks")
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.block_size = block_size
        self.window = window
        self.enable_prefix_caching = enable_prefix_caching
        self.num_blocks = num_blocks
        self.ref_count = [0] * num_blocks
        self.key: list[str | None] = [None] * num_blocks
        self.token_ids: list[tuple[int, ...]] = [()] * num_blocks
        self.ref_count[NULL_BLOCK] = 1  # held forever: never handed out, never written
        self.free_blocks: OrderedDict[int, None] = OrderedDict((i, None) for i in range(1, num_blocks))
        self.key_to_block: dict[str, int] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    # -- which blocks a position needs -------------------------------------------------------
    def first_needed(self, position: int) -> int:
        """The first logical block a query at ``position`` attends (keys ``position - window + 1 ..``)."""
        return max(0, position - self.window + 1) // self.block_size

    def first_kept(self, num_computed: int) -> int:
        """The first block a sequence keeps with ``num_computed`` tokens computed: what its next
        query attends and what a prefix hit at its last block boundary before that needs (the
        boundary a decode stage's hit on this prompt stops at: the last token is recomputed)."""
        if num_computed <= 0:
            return 0
        return self.first_needed((num_computed - 1) // self.block_size * self.block_size)

    # -- prefix hits ----------------------------------------------------------------------------
    def hit(self, seq: Sequence, keys: list[str], full_hit: int) -> tuple[int, list[int]]:
        """The longest ``n <= full_hit`` whose window blocks (before position ``n * block_size``)
        are all cached under ``keys``, with their ids (from block ``first_needed(n * bs)`` on)."""
        if not self.enable_prefix_caching or full_hit == 0:
            return 0, []
        bs = self.block_size
        found: list[int | None] = []
        for i in range(full_hit):
            bid = self.key_to_block.get(keys[i])
            ok = bid is not None and self.token_ids[bid] == tuple(seq.token_ids[i * bs:(i + 1) * bs])
            found.append(bid if ok else None)
        for n in range(full_hit, 0, -1):
            ids = found[self.first_needed(n * bs):n]
            if all(b is not None for b in ids):
                return n, ids  # type: ignore[return-value]
        return 0, []

    # -- admission and growth ---------------------------------------------------------------------
    def fresh_on_admission(self, local: int, hit: int, total_blocks: int) -> int:
        """Fresh blocks a sequence takes on admission: from the first block after its local hit
        that its window after ``hit`` blocks (local plus loaded) needs, to ``total_blocks``."""
        return total_blocks - max(local, self.first_needed(hit * self.block_size))

    def can_allocate(self, cached: list[int], local: int, hit: int, total_blocks: int) -> bool:
        reusable_free = sum(1 for b in cached if self.ref_count[b] == 0)
        return self.fresh_on_admission(local, hit, total_blocks) + reusable_free <= self.num_free_blocks

    def allocate(self, seq: Sequence, cached: list[int], local: int, hit: int, total_blocks: int) -> None:
        """``cached``: the window blocks of the local hit (:meth:`hit`); blocks ``local .. hit - 1``
        come from the KV store, and only those the window after ``hit`` needs get a block."""
        assert not seq.window_table, "allocate() is for a sequence holding no window blocks"
        for bid in cached:
            if self.ref_count[bid] == 0:
                del self.free_blocks[bid]
            self.ref_count[bid] += 1
        start = self.first_needed(hit * self.block_size)
        table = [NULL_BLOCK] * (local - len(cached)) + list(cached)
        table += [NULL_BLOCK] * max(0, start - local)
        seq.window_table = table
        seq.window_released = local - len(cached)
        self.append(seq, total_blocks)

    def can_append(self, seq: Sequence, total_blocks: int) -> bool:
        return total_blocks - len(seq.window_table) <= self.num_free_blocks

    def append(self, seq: Sequence, total_blocks: int) -> None:
        while len(seq.window_table) < total_blocks:
            seq.window_table.append(self._take_free_block())

    def _take_free_block(self) -> int:
        bid, _ = self.free_blocks.popitem(last=False)
        key = self.key[bid]
        if key is not None and self.key_to_block.get(key) == bid:
            del self.key_to_block[key]
        self.key[bid], self.token_ids[bid], self.ref_count[bid] = None, (), 1
        return bid

    # -- after a step ---------------------------------------------------------------------------
    def commit(self, seq: Sequence) -> None:
        """Key the window blocks that became full (their keys are the full pool's, in
        ``seq.block_hashes``), then give back those the sequence no longer attends."""
        bs = self.block_size
        if self.enable_prefix_caching:
            for i in range(seq.window_released, min(len(seq.block_hashes), len(seq.window_table))):
                bid, key = seq.window_table[i], seq.block_hashes[i]
                if bid != NULL_BLOCK and self.key[bid] is None and key not in self.key_to_block:
                    self.key[bid] = key
                    self.token_ids[bid] = tuple(seq.token_ids[i * bs:(i + 1) * bs])
                    self.key_to_block[key] = bid
        self.release(seq)

    def release(self, seq: Sequence) -> None:
        """Give back the blocks before ``first_kept``: the oldest go to the LRU end that is
        reused last only when keyed (a keyed block may serve a later prefix hit)."""
        end = min(self.first_kept(seq.num_computed_tokens), len(seq.window_table))
        for i in range(seq.window_released, end):
            bid = seq.window_table[i]
            if bid != NULL_BLOCK:
                seq.window_table[i] = NULL_BLOCK
                self._unref(bid)
        seq.window_released = max(seq.window_released, end)

    def _unref(self, bid: int) -> None:
        self.ref_count[bid] -= 1
        assert self.ref_count[bid] >= 0, f"window block {bid} freed more often than taken"
        if self.ref_count[bid] == 0:
            self.free_blocks[bid] = None
            if self.key[bid] is None:
                self.free_blocks.move_to_end(bid, last=False)

    def trim(self, seq: Sequence, keep: int) -> None:
        """Give back the blocks past the first ``keep`` (rejected drafts' slots: never keyed)."""
        while len(seq.window_table) > keep:
            bid = seq.window_table.pop()
            if bid == NULL_BLOCK:
                continue
            assert self.key[bid] is None and self.ref_count[bid] == 1, f"window block {bid} is shared or keyed"
            self.ref_count[bid] = 0
            self.free_blocks[bid] = None
            self.free_blocks.move_to_end(bid, last=False)

    def free(self, seq: Sequence) -> None:
        for bid in reversed(seq.window_table):
            if bid != NULL_BLOCK:
                self._unref(bid)
        seq.window_table = []
        seq.window_released = 0

    def held(self, seq: Sequence) -> int:
        """Window blocks ``seq`` holds (the null block not counted)."""
        return sum(1 for b in seq.window_table if b != NULL_BLOCK)

    def check_invariants(self, live: list[Sequence]) -> None:
        refs = [0] * self.num_blocks
        refs[NULL_BLOCK] = 1
        for seq in live:
            held = [b for b in seq.window_table if b != NULL_BLOCK]
            assert len(set(held)) == len(held), "a sequence holds a window block twice"
            assert all(b == NULL_BLOCK for b in seq.window_table[:seq.window_released])
            for b in held:
                refs[b] += 1
        for bid in range(self.num_blocks):
            assert self.ref_count[bid] == refs[bid], f"window block {bid}: ref {self.ref_count[bid]} != {refs[bid]}"
            assert (refs[bid] == 0) == (bid in self.free_blocks), f"window block {bid} free-list mismatch"
            if refs[bid] > 1 and bid != NULL_BLOCK:
                assert self.key[bid] is not None, f"unkeyed window block {bid} is shared"
        for key, bid in self.key_to_block.items():
            assert self.key[bid] == key
