"""The KV staging pool (engine/runtime/kv_staging.py) and the connector's loads and saves through it.

The CUDA path cannot run here, so its order is proven with a fake copy engine whose two streams
run *late*: a copy queued on the "side stream" runs only when a fence after it is waited on (by the
host, or by the compute stream), and a step a test queues on the "compute stream" runs only when
the host waits for it or a copy ordered after it runs. Any buffer reused too early, any step that
reads a loaded block before its copy, any copy that runs before the step it must follow, any save
taken out of its buffer before its copy or any block overwritten before its save's copy, then
gives wrong bytes: the tests below see them.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbatch.engine.models.weights import load_checkpoint
from kvbatch.engine.runtime.engine_config import EngineConfig
from kvbatch.engine.runtime.kv_connector import KVConnector
from kvbatch.engine.runtime.kv_staging import (
    HostCopyEngine,
    KVStaging,
    StagingPool,
    block_shape,
    copy_engine_for,
    split_run,
)
from kvbatch.engine.runtime.llm import LLM, GenerationRequest
from kvbatch.engine.runtime.sampling_params import SamplingParams
from kvbatch.engine.spec import EngineSpec
from kvbatch.io.kvstore.block_format import tensor_bytes
from kvbatch.io.kvstore.store import KVStore, KVStoreConfig
from kvbatch.io.kvstore.tiers import MemoryTier
from tests.tiny_models import VOCAB, build_tiny


class LateFence:
    def __init__(self, engine: LateCopyEngine, upto: int) -> None:
        self.engine, self.upto = engine, upto

    def query(self) -> bool:
        return self.engine.done >= self.upto

    def synchronize(self) -> None:
        self.engine.run_until(self.upto)


class LateCopyEngine:
    """A side stream whose copies run only when a fence after them is waited on, and a compute
    stream whose queued steps (:meth:`step`) run only when the host waits for them
    (:meth:`finish_compute`) or when a copy ordered after them (``side_after_compute``) runs.

    The engine tests queue no step: there the model computes on the host, so its work is done when
    issued, and ``compute_after`` waits on the host (the GPU's wait, made stronger, not weaker)."""

    def __init__(self) -> None:
        self.ops: list = []  # the side stream: (steps that must run first, the copy)
        self.done = 0
        self.steps: list = []  # the compute stream
        self.steps_done = 0
        self.allocations = 0
        self.compute_waits = 0
        self._after = 0  # the compute steps the next copies are ordered after

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        self.allocations += 1
        return torch.full((nbytes,), 0xAB, dtype=torch.uint8)  # garbage: a read before a write shows

    def side_after_compute(self) -> None:
        self._after = len(self.steps)  # a real wait: the copies queued from now on run after these steps

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.ops.append((self._after, lambda: dst.copy_(src)))

    def record(self) -> LateFence:
        return LateFence(self, len(self.ops))

    def compute_after(self, fence: LateFence) -> None:
        self.compute_waits += 1
        self.run_until(fence.upto)

    def step(self, fn) -> None:
        """Queue work on the compute stream (a forward pass reading or writing the cache)."""
        self.steps.append(fn)

    def finish_compute(self) -> None:
        """The host waits for the compute stream."""
        self._run_steps(len(self.steps))

    def _run_steps(self, n: int) -> None:
        while self.steps_done < n:
            self.steps[self.steps_done]()
            self.steps_done += 1

    def run_until(self, n: int) -> None:
        while self.done < n:
            after, op = self.ops[self.done]
            self._run_steps(after)
            op()
            self.done += 1


def _bits(t: torch.Tensor) -> bytes:
    return tensor_bytes(t)


def _cache(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype)


# -- geometry -----------------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(blocks=st.integers(1, 5), rows=st.integers(1, 6), elems=st.integers(1, 10), elem_bytes=st.sampled_from([1, 2, 4]),
       capacity=st.integers(1, 600))
def test_split_run_covers_every_element_once_within_a_buffer(blocks, rows, elems, elem_bytes, capacity):
    if capacity < elem_bytes:
        with pytest.raises(ValueError, match="cannot hold one"):
            split_run(blocks, rows, elems, elem_bytes, capacity)
        return
    seen = torch.zeros(blocks, rows, elems, dtype=torch.int32)
    for p in split_run(blocks, rows, elems, elem_bytes, capacity):
        assert math.prod(p.shape) * elem_bytes <= capacity
        seen[p.block:p.block + p.blocks, p.row0:p.row1, p.elem0:p.elem1] += 1
    assert bool((seen == 1).all())


# -- the pool and the staged copies --------------------------------------------------------------------

CACHE_SHAPES = st.sampled_from([(2, 2, 9, 4, 2, 3), (3, 1, 7, 2, 1, 5), (1, 2, 6, 3, 4)])


@settings(max_examples=60, deadline=None)
@given(shape=CACHE_SHAPES, dtype=st.sampled_from([torch.float32, torch.bfloat16]), data=st.data(),
       buffers=st.integers(1, 3), capacity=st.integers(4, 700))
def test_staged_loads_and_saves_equal_direct_copies(shape, dtype, data, buffers, capacity):
    """Any block ids (runs and gaps), blocks larger or smaller than a buffer, one to three
    buffers, copies that run late: the cache after a load and the tensors a save hands over are
    bit-identical to direct per-block copies."""
    num_blocks = shape[2]
    ids = data.draw(st.lists(st.integers(0, num_blocks - 1), min_size=1, max_size=num_blocks, unique=True))
    if data.draw(st.booleans()):
        ids = sorted(ids)  # long runs
    engine = LateCopyEngine()
    staging = KVStaging(engine, buffers, capacity)
    tensors = [_cache(block_shape(torch.empty(shape)), dtype, seed=100 + i) for i in range(len(ids))]
    cache = _cache(shape, dtype, seed=1)
    want = cache.clone()
    for t, b in zip(tensors, ids):
        want[:, :, b].copy_(t)
    staging.load(cache, tensors, ids)
    assert _bits(cache) == _bits(want)

    staging.save(cache, [f"k{i}" for i in range(len(ids))], ids)
    done = staging.collect(wait=True)
    assert len(done) == 1 and done[0][0] == [f"k{i}" for i in range(len(ids))]
    assert [_bits(t) for t in done[0][1]] == [_bits(cache[:, :, b]) for b in ids]
    assert engine.allocations == buffers


def test_the_pool_allocates_its_buffers_once_across_many_loads_and_saves():
    engine = LateCopyEngine()
    staging = KVStaging(engine, 2, 96)  # one block of (2, 2, *, 2, 3) fp32 is 48 bytes: runs split
    pool_ptrs = [b.data_ptr() for b in staging.pool.buffers]
    cache = _cache((2, 2, 16, 2, 3), torch.float32, seed=0)
    for step in range(200):
        ids = [(step * 3 + j) % 16 for j in range(1 + step % 5)]
        staging.load(cache, [_cache(block_shape(cache), torch.float32, step * 10 + j) for j in range(len(ids))], ids)
        staging.save(cache, [f"s{step}.{j}" for j in range(len(ids))], ids)
        staging.collect()
    staging.collect(wait=True)
    assert engine.allocations == 2
    assert [b.data_ptr() for b in staging.pool.buffers] == pool_ptrs
    assert staging.copies > 400 and staging.pool.waits > 0  # buffers really were waited for


def test_a_buffer_is_not_reused_before_its_copy_has_run(monkeypatch):
    """One buffer, a run three buffers long: each piece must wait for the previous copy. A pool
    that handed the buffer out again at once would copy the last piece's bytes three times."""
    cache = torch.zeros(1, 1, 3, 4)
    tensors = [torch.full((1, 1, 4), float(i + 1)) for i in range(3)]
    staging = KVStaging(LateCopyEngine(), 1, 16)
    staging.load(cache, tensors, [0, 1, 2])
    assert cache[0, 0, :, 0].tolist() == [1.0, 2.0, 3.0]
    assert staging.pool.waits == 2

    def hasty(self, settle_owner):  # the same pool without its wait
        i = self._next
        self._next = (i + 1) % len(self.buffers)
        return i

    monkeypatch.setattr(StagingPool, "acquire", hasty)
    cache.zero_()
    KVStaging(LateCopyEngine(), 1, 16).load(cache, tensors, [0, 1, 2])
    assert cache[0, 0, :, 0].tolist() == [3.0, 3.0, 3.0]


def test_the_compute_stream_waits_for_a_load_before_the_step_reads_it():
    engine = LateCopyEngine()
    cache = torch.zeros(2, 2, 4, 3)
    tensors = [torch.ones(2, 2, 3), torch.full((2, 2, 3), 2.0)]
    KVStaging(engine, 4, 1024).load(cache, tensors, [1, 2])
    # The copies were queued on the side stream; only the compute stream's wait ran them.
    assert engine.compute_waits == 1 and engine.done == len(engine.ops) == 1  # one run: one copy
    assert torch.equal(cache[:, :, 1], tensors[0]) and torch.equal(cache[:, :, 2], tensors[1])


def test_a_save_is_handed_over_only_after_its_copy_and_a_reused_block_waits_for_it():
    engine = LateCopyEngine()
    staging = KVStaging(engine, 4, 1024)
    cache = _cache((2, 2, 4, 3), torch.float32, seed=3)
    before = cache[:, :, 2].clone()
    staging.save(cache, ["a"], [2])
    assert staging.collect() == [] and staging.copying_out()  # its copy has not run: nothing to hand over
    staging.guard([0, 1])  # a step writing other blocks does not wait
    assert engine.compute_waits == 0
    staging.guard([2, 3])  # block 2 is about to be overwritten: the compute stream waits for the copy
    assert engine.compute_waits == 1
    cache[:, :, 2] = -1.0
    (keys, tensors), = staging.collect()
    assert keys == ["a"] and _bits(tensors[0]) == _bits(before)
    assert not staging.copying_out()

    # Without the guard the overwrite reaches the store: the hazard the guard prevents is real.
    late = KVStaging(LateCopyEngine(), 4, 1024)
    cache = _cache((2, 2, 4, 3), torch.float32, seed=3)
    late.save(cache, ["a"], [2])
    cache[:, :, 2] = -1.0
    (_, tensors), = late.collect(wait=True)
    assert _bits(tensors[0]) != _bits(before)


def test_a_save_copies_what_the_step_before_it_wrote_not_what_was_there():
    """The step that computed a block is still queued on the compute stream when its save is
    issued: the save's copy must run after it (``side_after_compute``), or it copies stale bytes."""
    engine = LateCopyEngine()
    staging = KVStaging(engine, 4, 1024)
    cache = _cache((2, 2, 4, 3), torch.float32, seed=4)
    computed = _cache((2, 2, 3), torch.float32, seed=5)
    engine.step(lambda: cache[:, :, 2].copy_(computed))  # the forward pass writing block 2
    staging.save(cache, ["a"], [2])
    assert engine.steps_done == 0  # nothing ran yet: the host did not wait
    (keys, tensors), = staging.collect(wait=True)
    assert keys == ["a"] and _bits(tensors[0]) == _bits(computed)


def test_a_load_lands_after_the_step_in_flight_read_the_blocks_last_owner():
    """A block just given to a sequence may still be read by a queued step for its last owner:
    the load's copy must wait for that step (``side_after_compute``), or the step reads the new
    sequence's bytes."""
    engine = LateCopyEngine()
    staging = KVStaging(engine, 1, 48)  # one buffer, two pieces: the pool waits on the first copy
    cache = _cache((2, 2, 4, 3), torch.float32, seed=6)
    old = cache[:, :, 1:3].clone()
    seen: list[torch.Tensor] = []
    engine.step(lambda: seen.append(cache[:, :, 1:3].clone()))  # the last owner's step, still queued
    staging.load(cache, [torch.ones(2, 2, 3), torch.full((2, 2, 3), 2.0)], [1, 2])
    engine.finish_compute()
    assert _bits(seen[0]) == _bits(old)
    assert torch.equal(cache[:, :, 1], torch.ones(2, 2, 3)) and torch.equal(cache[:, :, 2], torch.full((2, 2, 3), 2.0))


def test_the_cpu_engine_uses_plain_buffers():
    engine = copy_engine_for(torch.device("cpu"))
    assert isinstance(engine, HostCopyEngine)
    assert not engine.host_buffer(64).is_pinned()
    assert engine.record().query()


# -- the connector: refusals and writes after the fence ---------------------------------------------


class CountingStore:
    """A dict store that keeps the bytes it was given (what any tier would serialize)."""

    def __init__(self) -> None:
        self.blocks: dict[str, torch.Tensor] = {}
        self.puts = 0

    def contains(self, keys):
        return [k in self.blocks for k in keys]

    def lookup(self, keys):
        return ["" if k in self.blocks else "missing" for k in keys]

    def get_many(self, keys):
        return [(self.blocks[k].clone(), "memory") if k in self.blocks else (None, "missing") for k in keys]

    def put_many(self, blocks):
        self.puts += 1
        new = [(k, t) for k, t in blocks if k not in self.blocks]
        self.blocks.update(new)
        return len(new)

    def stats(self):
        return {}


def test_the_store_write_follows_the_copy_and_flush_drains_it():
    store, engine = CountingStore(), LateCopyEngine()
    conn = KVConnector(store, 4, 0, copy_engine=engine)
    cache = _cache((2, 2, 6, 4, 1, 3), torch.float32, seed=5)
    conn.save([("a", 1), ("b", 2), ("c", 4)], cache)
    conn.poll()
    assert store.puts == 0 and conn.pending_saves() == 1 and conn.stats.blocks_written == 0
    conn.flush()
    assert conn.pending_saves() == 0 and conn.stats.blocks_written == 3
    assert {k: _bits(t) for k, t in store.blocks.items()} == {
        k: _bits(cache[:, :, b]) for k, b in [("a", 1), ("b", 2), ("c", 4)]}
    assert all(t.is_contiguous() and t.shape == (2, 2, 4, 1, 3) for t in store.blocks.values())


def test_the_default_pool_on_the_cpu_four_buffers_at_most_the_cache_and_saves_written_at_once():
    store = CountingStore()
    small = torch.zeros(2, 2, 8, 4, 1, 3)  # 1,536 bytes: the buffers hold at most the cache
    conn = KVConnector(store, 4, 0)
    conn.save([("a", 3)], small)
    pool = conn.stager(small).pool
    assert isinstance(conn.stager(small).engine, HostCopyEngine)
    assert len(pool.buffers) == 4 and {b.numel() for b in pool.buffers} == {small.numel() * 4}
    assert store.puts == 1 and conn.pending_saves() == 0  # no poll, no flush: at once on the CPU
    big = torch.zeros(2, 2, 1024, 16, 2, 16)  # 16 MiB: 8 MiB buffers
    assert {b.numel() for b in KVConnector(store, 16, 0).stager(big).pool.buffers} == {8 << 20}


@pytest.mark.parametrize("staging", [True, False])
def test_a_block_of_another_dtype_or_layout_is_refused(staging):
    store = CountingStore()
    cache = torch.zeros(2, 2, 4, 4, 1, 3)
    good = torch.ones(2, 2, 4, 1, 3)
    store.blocks.update({"good": good, "bf16": good.to(torch.bfloat16), "heads": torch.ones(2, 2, 4, 3, 1),
                         "mla": torch.ones(2, 1, 4, 1, 3)})
    for bad, reason in [("bf16", "dtype"), ("heads", "shape"), ("mla", "shape")]:
        conn = KVConnector(store, 4, 0, staging=staging)
        assert conn.load(["good", bad, "good"], [0, 1, 2], cache) == 1
        assert conn.stats.misses_by_reason == {reason: 1}
        assert torch.equal(cache[:, :, 0], good) and not cache[:, :, 1:].any()  # nothing after the miss
        cache.zero_()


# -- the engine end to end -------------------------------------------------------------------------------

BS = 4


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_llama")
    build_tiny("llama", folder)
    return load_checkpoint(str(folder))


def _prompts() -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(7)
    system = torch.randint(3, VOCAB, (10,), generator=g).tolist()
    return {f"q{i}": system + torch.randint(3, VOCAB, (n,), generator=g).tolist() for i, n in enumerate([7, 3, 12])}


def _requests(prompts, logprobs: bool = False, **kw) -> list[GenerationRequest]:
    out = []
    lp = 2 if logprobs else None
    for i, (rid, p) in enumerate(prompts.items()):
        sampling = (SamplingParams(max_tokens=6, temperature=0.9, seed=11, ignore_eos=True, logprobs=lp) if i == 1
                    else SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=lp))
        out.append(GenerationRequest(rid, sampling, prompt_token_ids=p, **kw))
    return out


def _engine(ckpt, store=None, *, staging=True, num_blocks=64, max_num_seqs=4, **conn) -> LLM:
    llm = LLM(ckpt, engine_config=EngineConfig(block_size=BS, num_blocks=num_blocks, max_num_seqs=max_num_seqs),
              kv_store=store)
    if store is not None:  # the same connector the engine makes, with the staging under test
        llm.connector = llm.scheduler.connector = KVConnector(store, BS, llm.block_bytes, staging=staging, **conn)
    return llm


def _late(buffers: int, buffer_bytes: int) -> dict:
    """Connector arguments: staging through the late-copy engine, with these buffers."""
    return {"copy_engine": LateCopyEngine(), "staging_buffers": buffers, "staging_buffer_bytes": buffer_bytes}


def _store(ckpt, url: str) -> KVStore:
    return KVStore.from_config(KVStoreConfig(url=url, memory_bytes=0), EngineSpec(dtype="fp32", block_size=BS).kv_fingerprint(ckpt.fingerprint))


def _tokens(results) -> dict[str, list[int]]:
    return {r.request_id: r.output_token_ids for r in results}


def _stored(store, keys) -> list[bytes]:
    got = store.get_many(keys)
    assert all(t is not None for t, _ in got), [why for t, why in got if t is None]
    return [_bits(t) for t, _ in got]


def test_decode_from_stored_kv_through_staging_equals_generate_and_the_bytes_equal_the_direct_path(ckpt, tmp_path):
    """Prefill writes through the staging pool (late copies, buffers smaller than a block: every
    block split in rows) and through the direct copies into two stores: the same bytes for every
    block. Decoding from either store, staged or direct, gives in-process generate's tokens."""
    prompts = _prompts()
    reference = _tokens(_engine(ckpt).generate(_requests(prompts)))
    block = _engine(ckpt).block_bytes
    stores = {}
    for name, kw in [("staged", {"staging": True, **_late(2, block // 3)}), ("direct", {"staging": False})]:
        url = (tmp_path / name).as_uri()
        prefill = _engine(ckpt, _store(ckpt, url), **kw)
        prefill.generate(_requests(prompts, prefill_only=True))
        prefill.connector.flush()
        assert prefill.connector.stats.blocks_written == 2 + (4 - 2) + (3 - 2) + (5 - 2)  # the system's 2 once
        stores[name] = url
    keys = [k for p in prompts.values() for k in _engine(ckpt).prompt_block_keys(p)]
    assert _stored(_store(ckpt, stores["staged"]), keys) == _stored(_store(ckpt, stores["direct"]), keys)

    for source in ("staged", "direct"):
        logprobs = {}
        for staging in (True, False):
            kw = _late(2, block // 3) if staging else {}
            decoder = _engine(ckpt, _store(ckpt, stores[source]), staging=staging, **kw)
            results = decoder.generate(_requests(prompts, logprobs=True))
            assert _tokens(results) == reference, (source, staging)
            logprobs[staging] = [r.logprobs for r in results]
            # Each stored block is loaded at most once (a prompt waits for the shared blocks another
            # is loading, then hits the prefix cache); the connector may compute a lone short block
            # rather than fetch it. What was neither loaded nor a cache hit was computed.
            served = [r.num_loaded_tokens + r.num_cached_tokens for r in results]
            assert 0 < decoder.connector.stats.blocks_loaded <= 8
            assert decoder.connector.stats.blocks_loaded * BS == sum(r.num_loaded_tokens for r in results)
            assert decoder.stats["computed_prompt_tokens"] == sum(len(p) for p in prompts.values()) - sum(served)
        # The same cache contents, the same steps: the staged decode's log-probabilities are the
        # direct decode's bit for bit (a block landing late would change them).
        assert logprobs[True] == logprobs[False]


def test_blocks_reused_while_their_save_is_copying_are_saved_as_computed(ckpt, monkeypatch):
    """A cache of five blocks, one sequence at a time: the next prompt's prefill takes the blocks
    the last one just saved while their copies are still queued. The engine's guard makes it wait:
    the stored bytes equal the direct path's. Without the guard they would not."""
    g = torch.Generator().manual_seed(3)
    prompts = {f"p{i}": torch.randint(3, VOCAB, (4 * BS,), generator=g).tolist() for i in range(3)}

    def prefill(staging: bool) -> list[bytes]:
        store = KVStore([MemoryTier(1 << 24)], "fp")
        kw = _late(4, 2 * _engine(ckpt).block_bytes) if staging else {}
        llm = _engine(ckpt, store, staging=staging, num_blocks=5, max_num_seqs=1, **kw)
        llm.generate(_requests(prompts, prefill_only=True))
        return _stored(store, [k for p in prompts.values() for k in llm.prompt_block_keys(p)])

    direct = prefill(False)
    assert prefill(True) == direct
    monkeypatch.setattr(KVConnector, "before_step", lambda self, step: None)
    assert prefill(True) != direct
