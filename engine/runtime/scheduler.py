"""Continuous batching: which sequences compute how many tokens in the next step.

First come, first served. Each step has a token budget. Running sequences go first (a decode
costs one token, an unfinished prefill continues with a chunk), then waiting ones are admitted
while budget, sequence slots and blocks last. When blocks run out, the most recently admitted
running sequence is preempted: its blocks are freed and it is recomputed later (its prefix
is likely still cached, so recompute is usually cheap). The scheduler deals in ids and counts;
it never touches a tensor.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from kvbatch.engine.runtime.block_hash import window_key
from kvbatch.engine.runtime.block_manager import BlockManager
from kvbatch.engine.runtime.kv_connector import KVConnector
from kvbatch.engine.runtime.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int
    # Of ``num_new_tokens``, slots after the sequence's real tokens reserved for drafted tokens
    # (speculative decoding); the drafter fills ``seq.spec_token_ids`` and may shrink this.
    num_spec: int = 0

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the end of the sequence, so a token is sampled after it."""
        return self.seq.num_computed_tokens + self.num_new_tokens - self.num_spec == self.seq.num_tokens


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 connector: KVConnector | None = None):
        if max_num_batched_tokens < 1 or max_num_seqs < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        self.block_manager = block_manager
        self.connector = connector
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _chunk(self, computed: int, pending: int, budget: int) -> int:
        """Tokens to compute after ``computed`` ones, of ``pending``, within ``budget``. A prefill
        cut by the budget ends on a block boundary, so a prompt's blocks are computed from the
        same chunks every time."""
        n = min(pending, budget)
        if n < pending:
            bs = self.block_manager.block_size
            aligned = (computed + n) // bs * bs - computed
            if aligned > 0:
                n = aligned
        return n

    def schedule(self) -> list[ScheduledSeq]:
        bm = self.block_manager
        budget = self.max_num_batched_tokens
        out: list[ScheduledSeq] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            pending = seq.num_pending_tokens
            if pending == 1 and seq.num_lookahead:
                # A decode step with room for drafted tokens, cut by the budget if need be.
                n = min(1 + seq.num_lookahead, budget)
            else:
                n = self._chunk(seq.num_computed_tokens, pending, budget)
            assert n > 0, f"running sequence {seq.request_id!r} has nothing to compute"
            while not bm.can_append(seq, n):
                if n > pending:  # drop the draft slots before preempting anyone for them
                    n = pending
                    continue
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break
            bm.append_slots(seq, n)
            out.append(ScheduledSeq(seq, n, max(0, n - pending)))
            budget -= n
            i += 1
        bs = bm.block_size
        # Blocks that this step computes or loads from the KV store. A waiting request whose next
        # uncached block is among them waits one step and then hits the cache, instead of
        # computing (or loading) the same shared prefix (a system prompt) again in parallel.
        in_flight: set[str] = set()
        if bm.enable_prefix_caching:
            for s in out:
                if s.seq.num_computed_tokens < s.seq.num_prompt_tokens:
                    keys = bm.prefix_keys(s.seq)
                    in_flight.update(keys[s.seq.num_computed_tokens // bs:(s.seq.num_computed_tokens + s.num_new_tokens) // bs])
        deferred: list[Sequence] = []
        # Admitting new work in a step that had to preempt would only thrash.
        while self.waiting and not preempted and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            keys = bm.prefix_keys(seq)
            cached = bm.cached_prefix(seq, keys)
            if len(cached) < len(keys) and keys[len(cached)] in in_flight:
                deferred.append(self.waiting.popleft())
                continue
            # Blocks after the local hit that the external store holds: they are loaded, not computed.
            external = (self.connector.match(seq, len(cached), keys)
                        if self.connector and not seq.store_failed else [])
            hit = (len(cached) + len(external)) * bs
            n = self._chunk(hit, seq.num_tokens - hit, budget)
            if not bm.can_allocate(seq, len(external) * bs + n, cached, len(external)):
                if not self.running and not out:
                    raise RuntimeError(
                        f"request {seq.request_id!r} needs more KV blocks than the cache holds "
                        f"({bm.blocks_needed(seq.num_tokens)} > {len(bm.blocks)}); raise kv_cache_bytes"
                    )
                break
            self.waiting.popleft()
            bm.allocate(seq, len(external) * bs + n, cached, len(external))
            if external:
                first = len(cached)
                seq.pending_loads = list(zip(external, seq.block_table[first:first + len(external)]))
                if bm.window is not None:  # and the window before the hit, where the local hit has not got it
                    start = max(first, bm.window.first_needed(hit))
                    seq.pending_window_loads = [(window_key(keys[i]), seq.window_table[i])
                                                for i in range(start, first + len(external))]
                seq.num_computed_tokens += len(external) * bs
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.append(ScheduledSeq(seq, n))
            budget -= n
            if bm.enable_prefix_caching:
                # The blocks it loads from the store count too: the other choices of a row (or
                # rows sharing a stored prefix) wait a step and find them in the prefix cache,
                # so each stored block is read once, not once per request.
                in_flight.update(keys[len(cached):(hit + n) // bs])
        self.waiting.extendleft(reversed(deferred))
        return out

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        self.running.remove(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def recompute(self, seq: Sequence) -> None:
        """Put a running sequence back in the queue to be computed without the KV store (its
        stored prefix failed to load), as a preemption does."""
        seq.store_failed = True
        self._preempt(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.block_manager.free(seq)
        self.running.remove(seq)
