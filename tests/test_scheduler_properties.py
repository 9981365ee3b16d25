"""Property tests: the scheduler and block manager never leak a block, never share one wrongly,
and never let a sequence read KV that is not its own tokens', whatever the arrival order,
lengths, preemptions and prefix hits.

The model is replaced by a fake KV cache that records, per slot, the (token id, position)
written there; every step checks every scheduled sequence's context against its own tokens. With a
sliding window the same holds for the window pool (window_blocks.py): every key a sliding layer's
query attends is in the sequence's window blocks, and a sequence holds no more than its window.
"""

from __future__ import annotations

import random

from hypothesis import event, given, settings
from hypothesis import strategies as st

from kvbatch.engine.runtime.block_manager import BlockManager
from kvbatch.engine.runtime.sampling_params import SamplingParams
from kvbatch.engine.runtime.scheduler import Scheduler
from kvbatch.engine.runtime.sequence import Sequence
from kvbatch.engine.runtime.window_blocks import NULL_BLOCK, WindowPool, window_pool_blocks

PREFIXES = [[7] * 9, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], []]


@st.composite
def workloads(draw):
    n = draw(st.integers(1, 12))
    reqs = []
    for _ in range(n):
        prefix = PREFIXES[draw(st.integers(0, len(PREFIXES) - 1))]
        tail = draw(st.lists(st.integers(0, 5), min_size=1, max_size=20))
        arrive = draw(st.integers(0, 6))  # step at which it arrives
        reqs.append((arrive, prefix + tail, draw(st.integers(1, 12))))
    return {
        "reqs": reqs,
        "block_size": draw(st.sampled_from([1, 2, 4])),
        "num_blocks": draw(st.integers(14, 40)),
        "budget": draw(st.integers(1, 24)),
        "max_seqs": draw(st.integers(1, 6)),
        "caching": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**16)),
        "window": draw(st.sampled_from([0, 1, 3, 6, 9])),  # 0: no sliding layers
    }


@settings(max_examples=300, deadline=None)
@given(workloads())
def test_no_leak_no_wrong_sharing(w):
    rng = random.Random(w["seed"])
    bs = w["block_size"]
    window = w["window"]
    # sized as the engine sizes it (llm.py): never more than the full pool plus the null block
    pool = (WindowPool(min(window_pool_blocks(window, bs, w["max_seqs"], w["budget"]), w["num_blocks"] + 1),
                       bs, window, w["caching"]) if window else None)
    bm = BlockManager(w["num_blocks"], bs, "00" * 32, enable_prefix_caching=w["caching"], window=pool)
    sched = Scheduler(bm, w["max_seqs"], w["budget"])
    cache: dict[int, tuple[int, int]] = {}  # slot -> (token id, position) written there
    window_cache: dict[int, tuple[int, int]] = {}  # the same for the sliding layers' pool
    pending = sorted(enumerate(w["reqs"]), key=lambda x: x[1][0])
    live: list[Sequence] = []
    max_len = 40 + 12
    step_no = 0
    done = 0
    # Requests that cannot fit even alone are skipped: the scheduler raises for them (tested below).
    pending = [p for p in pending if bm.blocks_needed(len(p[1][1]) + p[1][2]) <= w["num_blocks"]]
    total = len(pending)
    while done < total:
        while pending and pending[0][1][0] <= step_no:
            i, (_, prompt, max_tokens) = pending.pop(0)
            seq = Sequence(i, f"r{i}", list(prompt), SamplingParams(max_tokens=max_tokens, temperature=0))
            sched.add(seq)
            live.append(seq)
        step = sched.schedule()
        step_no += 1
        assert step_no < 5000, "no progress"
        for s in step:
            seq = s.seq
            assert s.num_new_tokens >= 1
            # Everything already computed must be this sequence's own tokens.
            for p in range(seq.num_computed_tokens):
                slot = seq.block_table[p // bs] * bs + p % bs
                assert cache.get(slot) == (seq.token_ids[p], p), f"seq {seq.seq_id} reads wrong KV at {p}"
            for p in range(seq.num_computed_tokens, seq.num_computed_tokens + s.num_new_tokens):
                slot = seq.block_table[p // bs] * bs + p % bs
                owner = bm.blocks[seq.block_table[p // bs]]
                assert owner.ref_count == 1, "writing into a shared block"
                cache[slot] = (seq.token_ids[p], p)
            if pool is not None:
                start, end = seq.num_computed_tokens, seq.num_computed_tokens + s.num_new_tokens
                for p in range(max(0, start - window + 1), start):  # what the first query sees
                    bid = seq.window_table[p // bs]
                    assert bid != NULL_BLOCK, f"seq {seq.seq_id}: window key {p} was given back"
                    assert window_cache.get(bid * bs + p % bs) == (seq.token_ids[p], p), f"wrong window KV at {p}"
                for p in range(start, end):
                    bid = seq.window_table[p // bs]
                    assert bid != NULL_BLOCK and pool.ref_count[bid] == 1, "writing into a shared window block"
                    window_cache[bid * bs + p % bs] = (seq.token_ids[p], p)
        for s in step:
            samples = s.samples
            s.seq.num_computed_tokens += s.num_new_tokens
            bm.commit(s.seq)
            if samples:
                s.seq.token_ids.append(rng.randint(0, 5))
                if s.seq.num_output_tokens >= s.seq.sampling.max_tokens or s.seq.num_tokens >= max_len:
                    sched.finish(s.seq, "length")
                    done += 1
        running = [q for q in live if not q.is_finished and q.block_table]
        bm.check_invariants(running)
        if pool is not None:  # a sequence keeps its window: at most ceil((window - 1) / bs) + 3 blocks after a step
            for q in running:
                assert pool.held(q) <= -(-(window - 1) // bs) + 3 + (bm.blocks_needed(q.num_tokens + 1)
                                                                      - bm.blocks_needed(q.num_computed_tokens)), q.seq_id
    assert not sched.has_work()
    event(f"preempted={sched.num_preemptions > 0}")
    event(f"prefix hits={bm.hits_tokens > 0}")
    assert bm.num_free_blocks == w["num_blocks"], "blocks leaked"
    assert all(b.ref_count == 0 for b in bm.blocks)
    if pool is not None:
        assert pool.num_free_blocks == pool.num_blocks - 1, "window blocks leaked"


def test_prefix_hit_reuses_blocks_and_rechecks_tokens():
    bm = BlockManager(16, 4, "ab" * 32)
    sched = Scheduler(bm, 4, 64)
    a = Sequence(0, "a", list(range(10)), SamplingParams(max_tokens=1, temperature=0))
    sched.add(a)
    step = sched.schedule()
    a.num_computed_tokens += step[0].num_new_tokens
    bm.commit(a)
    b = Sequence(1, "b", list(range(9)) + [99], SamplingParams(max_tokens=1, temperature=0))
    assert bm.cached_prefix(b) == a.block_table[:2]
    # A forged collision: same key, other tokens -> not served.
    bm.blocks[a.block_table[0]].token_ids = (5, 5, 5, 5)
    assert bm.cached_prefix(b) == []


def test_oversized_request_is_reported():
    bm = BlockManager(2, 4, "cd" * 32)
    sched = Scheduler(bm, 4, 64)
    sched.add(Sequence(0, "big", list(range(20)), SamplingParams(max_tokens=1, temperature=0)))
    try:
        sched.schedule()
    except RuntimeError as e:
        assert "big" in str(e) and "KV blocks" in str(e)
    else:
        raise AssertionError("expected an error")


def test_shared_prefix_admitted_together_is_computed_once():
    """Requests that arrive together and share a system prompt: the first computes it, the rest
    wait one step and hit the cache instead of computing the same blocks in parallel."""
    bm = BlockManager(64, 4, "ef" * 32)
    sched = Scheduler(bm, 8, 256)
    shared = list(range(100, 112))  # three full blocks
    seqs = [Sequence(i, f"r{i}", shared + [i, i + 1], SamplingParams(max_tokens=1, temperature=0)) for i in range(4)]
    for s in seqs:
        sched.add(s)
    step = sched.schedule()
    assert [s.seq.request_id for s in step] == ["r0"]
    for s in step:
        s.seq.num_computed_tokens += s.num_new_tokens
        bm.commit(s.seq)
        s.seq.token_ids.append(7)  # the sampled token
    step = sched.schedule()
    admitted = {s.seq.request_id: s for s in step if s.seq.request_id != "r0"}
    assert set(admitted) == {"r1", "r2", "r3"}
    assert all(s.seq.num_cached_tokens == 12 and s.num_new_tokens == 2 for s in admitted.values())


class _StoreHolds:
    """A KV connector whose store holds every block of the prompts (``match`` is all the scheduler asks)."""

    def match(self, seq: Sequence, num_local_blocks: int, keys: list[str]) -> list[str]:
        return keys[num_local_blocks:]


def test_stored_prefix_admitted_together_is_loaded_once():
    """Requests over one stored prompt (a row's n choices): the first loads its blocks from the KV
    store, the rest wait one step and hit the prefix cache instead of loading the same blocks again."""
    bm = BlockManager(64, 4, "ab" * 32)
    sched = Scheduler(bm, 8, 256, connector=_StoreHolds())  # type: ignore[arg-type]
    prompt = list(range(200, 214))  # three full blocks and a partial one
    seqs = [Sequence(i, f"c{i}", list(prompt), SamplingParams(max_tokens=1, temperature=0)) for i in range(3)]
    for s in seqs:
        sched.add(s)
    step = sched.schedule()
    assert [s.seq.request_id for s in step] == ["c0"]
    assert len(seqs[0].pending_loads) == 3 and step[0].num_new_tokens == 2  # loads 12, computes the tail
    for s in step:
        s.seq.pending_loads = []  # the engine's load, done before the step's forward
        s.seq.num_computed_tokens += s.num_new_tokens
        bm.commit(s.seq)
        s.seq.token_ids.append(7)
    step = sched.schedule()
    admitted = {s.seq.request_id: s for s in step if s.seq.request_id != "c0"}
    assert set(admitted) == {"c1", "c2"}
    assert all(not s.seq.pending_loads and s.seq.num_cached_tokens == 12 and s.num_new_tokens == 2
               for s in admitted.values())
