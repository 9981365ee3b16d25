"""KV block format and tiered KV store: round trips, corruption, tiers, concurrency, S3 faults, gc."""

from __future__ import annotations

import hashlib
import os
import threading
import time
import uuid

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbatch.io.kvstore.block_format import BlockCorrupt, pack_blocks, read_pack, unpack_block
from kvbatch.io.kvstore.store import (
    DiskTier,
    KVStore,
    KVStoreConfig,
    MemoryTier,
    ObjectStoreTier,
    RetryPolicy,
    kv_gc,
    kv_stats,
)

FP = "smollm2-135m|bfloat16|bs16|layout1"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def key(i: int | str, fp: str = FP) -> str:
    return hashlib.sha256(f"{fp}/{i}".encode()).hexdigest()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact equality (NaN payloads and -0.0 included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def random_bits(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """A tensor of arbitrary bit patterns: NaNs with payloads, infinities, subnormals, -0.0."""
    n = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    if n == 0:
        return torch.empty(shape, dtype=dtype)
    raw = np.random.default_rng(seed).integers(0, 256, size=n, dtype=np.uint8)
    return torch.from_numpy(raw).view(dtype).reshape(shape)


def kv_block(i: int, dtype: torch.dtype = torch.bfloat16, shape=(2, 2, 4, 2, 8)) -> torch.Tensor:
    g = torch.Generator().manual_seed(i)
    return torch.randn(shape, generator=g).to(dtype)


blocks_strategy = st.lists(
    st.tuples(
        st.lists(st.integers(0, 5), min_size=1, max_size=5).map(tuple),
        st.sampled_from(DTYPES),
        st.integers(0, 2**32 - 1),
    ),
    min_size=1,
    max_size=4,
)


def _build(spec) -> list[tuple[str, torch.Tensor]]:
    return [(key(f"h{i}-{seed}"), random_bits(shape, dt, seed)) for i, (shape, dt, seed) in enumerate(spec)]


# ---------------------------------------------------------------------------------------------
# Block format


@settings(max_examples=60, deadline=None)
@given(blocks_strategy)
def test_any_block_round_trips_bit_exactly(spec):
    blocks = _build(spec)
    data, entries = pack_blocks(FP, blocks)
    for k, t in blocks:
        e = entries[k]
        assert e.dtype == str(t.dtype).removeprefix("torch.") and e.shape == tuple(t.shape)
        assert same_bits(unpack_block(data[e.offset : e.offset + e.length], e, FP), t)
    whole = read_pack(data, FP)
    assert all(same_bits(whole[k], t) for k, t in blocks)


def test_nan_payloads_and_signed_zero_survive():
    bits = torch.tensor([0x7FC1, 0x7F81, 0xFFC3, 0x8000, 0x0001, 0x7F80], dtype=torch.int32).to(torch.int16)
    bf = bits.view(torch.bfloat16).reshape(1, 2, 3)
    f32 = torch.tensor([0x7FC00001, 0x7F800001, -0x7FFFFFFF - 1], dtype=torch.int32).view(torch.float32)
    data, entries = pack_blocks(FP, [(key("bf"), bf), (key("f32"), f32)])
    for k, t in [(key("bf"), bf), (key("f32"), f32)]:
        e = entries[k]
        assert same_bits(unpack_block(data[e.offset : e.offset + e.length], e, FP), t)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(blocks_strategy, st.floats(0, 1, exclude_max=True), st.integers(1, 255))
def test_any_single_byte_corruption_is_detected(spec, where, flip):
    blocks = _build(spec)
    data, entries = pack_blocks(FP, blocks)
    pos = int(where * len(data))
    bad = bytearray(data)
    bad[pos] ^= flip
    for k, t in blocks:
        e = entries[k]
        inside = e.offset <= pos < e.offset + e.length
        try:
            got = unpack_block(bytes(bad[e.offset : e.offset + e.length]), e, FP)
        except BlockCorrupt:
            continue
        assert not inside, "a corrupted block was served"
        assert same_bits(got, t)


@settings(max_examples=60, deadline=None)
@given(blocks_strategy, st.floats(0, 1, exclude_max=True))
def test_any_truncation_is_detected(spec, where):
    blocks = _build(spec)
    data, entries = pack_blocks(FP, blocks)
    cut = data[: int(where * len(data))]
    for k, t in blocks:
        e = entries[k]
        raw = cut[e.offset : e.offset + e.length]
        if e.offset + e.length > len(cut):
            with pytest.raises(BlockCorrupt) as info:
                unpack_block(raw, e, FP)
            assert info.value.reason == "truncated"
        else:
            assert same_bits(unpack_block(raw, e, FP), t)


def test_wrong_fingerprint_and_wrong_entry_are_refused():
    t = kv_block(1)
    data, entries = pack_blocks(FP, [(key(1), t), (key(2), kv_block(2))])
    e1, e2 = entries[key(1)], entries[key(2)]
    raw1 = data[e1.offset : e1.offset + e1.length]
    with pytest.raises(BlockCorrupt) as info:
        unpack_block(raw1, e1, "another-model")
    assert info.value.reason == "fingerprint"
    with pytest.raises(BlockCorrupt):  # index entry of another block
        unpack_block(raw1, e2, FP)
    with pytest.raises(ValueError, match="not supported"):
        pack_blocks(FP, [(key(3), torch.zeros(2, dtype=torch.complex64))])


# ---------------------------------------------------------------------------------------------
# Tiers


def test_memory_tier_evicts_least_recently_used():
    one = kv_block(0).numel() * 2
    mem = MemoryTier(byte_budget=3 * one)
    mem.put_many([(key(i), kv_block(i)) for i in range(3)], FP)
    mem.get_many([key(0)], FP)  # 0 is now the most recent
    mem.put_many([(key(3), kv_block(3))], FP)  # evicts 1
    assert mem.contains([key(i) for i in range(4)], FP) == [True, False, True, True]
    assert mem.resident() == (3, 3 * one)
    assert mem.stats()["evictions"] == 1
    # the stored copy is private: changing the caller's tensor or the result changes nothing
    src = kv_block(9)
    mem.put_many([(key(9), src)], FP)
    src.zero_()
    got = mem.get_many([key(9)], FP)[0].tensor
    assert same_bits(got, kv_block(9))
    got.zero_()
    assert same_bits(mem.get_many([key(9)], FP)[0].tensor, kv_block(9))


def test_disk_tier_lru_by_access_time_survives_restart(tmp_path):
    probe = DiskTier(str(tmp_path / "probe"), 2**30)
    probe.put_many([(key(0), kv_block(0))], FP)
    one = probe.resident()[1]
    disk = DiskTier(str(tmp_path / "d"), byte_budget=3 * one)
    for i in range(3):
        disk.put_many([(key(i), kv_block(i))], FP)
    assert disk.get_many([key(0)], FP)[0].tensor is not None
    disk.put_many([(key(3), kv_block(3))], FP)
    assert disk.contains([key(i) for i in range(4)], FP) == [True, False, True, True]
    assert not list((tmp_path / "d").glob(f"*/{key(1)}.*"))
    # a new process sees the same files and the same access order
    again = DiskTier(str(tmp_path / "d"), byte_budget=3 * one)
    assert list(again._files) == list(disk._files)
    assert same_bits(again.get_many([key(2)], FP)[0].tensor, kv_block(2))
    assert not [p for p in (tmp_path / "d").rglob("*") if p.name.startswith(".tmp-")]


def test_disk_tier_corrupt_file_is_a_miss_and_removed(tmp_path):
    disk = DiskTier(str(tmp_path), 2**30)
    disk.put_many([(key(0), kv_block(0)), (key(1), kv_block(1))], FP)
    (path,) = (tmp_path).glob(f"*/{key(0)}.*")
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    path.write_bytes(bytes(raw))
    (path1,) = (tmp_path).glob(f"*/{key(1)}.*")
    path1.write_bytes(path1.read_bytes()[:-7])
    l0, l1 = disk.get_many([key(0), key(1)], FP)
    assert (l0.tensor, l0.reason) == (None, "checksum")
    assert (l1.tensor, l1.reason) == (None, "truncated")
    assert not path.exists() and disk.contains([key(0)], FP) == [False]
    assert disk.get_many([key(1)], "another-model")[0].reason == "missing"


def make_store(url: str, tmp_path=None, fp: str = FP, memory: int = 2**24, **kw) -> KVStore:
    cfg = KVStoreConfig(
        url=url,
        memory_bytes=memory,
        disk_dir=str(tmp_path / f"disk-{uuid.uuid4().hex[:6]}") if tmp_path is not None else None,
        index_refresh_s=0,
        **kw,
    )
    return KVStore.from_config(cfg, fp)


def test_put_get_promotes_and_skips_existing(tmp_path):
    url = f"file://{tmp_path}/objects"
    writer = make_store(url)
    blocks = [(key(i), kv_block(i)) for i in range(6)]
    assert writer.put_many(blocks) == 6
    assert writer.put_many(blocks[:4] + [(key(6), kv_block(6))]) == 1
    assert writer.stats()["puts_skipped"] == 4

    reader = make_store(url, tmp_path)
    keys = [k for k, _ in blocks] + [key("never")]
    assert reader.contains(keys) == [True] * 6 + [False]
    first = reader.get_many(keys)
    assert [tier for _, tier in first] == ["object"] * 6 + ["missing"]
    assert all(same_bits(t, b) for (t, _), (_, b) in zip(first, blocks))
    assert [tier for _, tier in reader.get_many(keys[:2])] == ["memory", "memory"]
    assert reader.tiers[1].contains(keys[:6], FP) == [True] * 6  # promoted to disk as well
    s = reader.stats()
    assert s["hits"] == 8 and s["misses_by_reason"] == {"missing": 1}
    assert s["tiers"]["object"]["kv_bytes_read"] > 0 and s["tiers"]["object"]["read_bytes_per_s"] > 0
    assert s["tiers"]["memory"]["hits"] == 2 and s["tiers"]["disk"]["blocks"] == 6


def test_plain_path_and_memory_urls(tmp_path):
    for url in (str(tmp_path / "plain"), f"memory://kv-{uuid.uuid4().hex}"):
        s = make_store(url, memory=0)
        assert s.put_many([(key(1), kv_block(1))]) == 1
        s.flush()
        assert same_bits(make_store(url, memory=0).get_many([key(1)])[0][0], kv_block(1))


def test_concurrent_writers_end_consistent(tmp_path):
    url = f"file://{tmp_path}/objects"
    a, b = make_store(url, memory=0), make_store(url, memory=0)
    barrier = threading.Barrier(2)

    def write(store: KVStore, ids: range) -> None:
        barrier.wait()
        for i in ids:  # small puts so the two writers interleave
            store.put_many([(key(i), kv_block(i)), (key(i + 1), kv_block(i + 1))])

    ta = threading.Thread(target=write, args=(a, range(0, 30, 2)))
    tb = threading.Thread(target=write, args=(b, range(10, 40, 2)))
    ta.start(), tb.start()
    ta.join(30), tb.join(30)
    a.flush(), b.flush()
    reader = make_store(url, memory=0)
    got = reader.get_many([key(i) for i in range(40)])
    assert all(same_bits(t, kv_block(i)) for i, (t, _) in enumerate(got))
    stats = kv_stats(url)
    assert stats["unique_blocks"] == 40 and stats["unreadable_index_files"] == 0
    assert not [p for p in (tmp_path / "objects").rglob("*") if p.name.startswith(".tmp-")]


def test_concurrent_writer_processes(tmp_path):
    import multiprocessing as mp

    url = f"file://{tmp_path}/objects"
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_write_proc, args=(url, start)) for start in (0, 5)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    got = make_store(url, memory=0).get_many([key(i) for i in range(15)])
    assert all(same_bits(t, kv_block(i)) for i, (t, _) in enumerate(got))


def _write_proc(url: str, start: int) -> None:
    store = make_store(url, memory=0)
    store.put_many([(key(i), kv_block(i)) for i in range(start, start + 10)])
    store.flush()


def test_block_from_another_model_is_never_seen(tmp_path):
    # A reader asks only its own model's index (index/<fingerprint id>/...): a block another model
    # stored under the same key is simply not there for it, and no request reads that model's index.
    url = f"file://{tmp_path}/objects"
    other = make_store(url, fp="another-model")
    other.put_many([(key(1), kv_block(1))])  # same key, written by a different model
    other.flush()
    mine = make_store(url, memory=0)
    assert mine.contains([key(1)]) == [False]
    assert mine.get_many([key(1)]) == [(None, "missing")]
    assert mine.request_counts()["GET"] == 1  # the layout marker only


def test_gc_ttl_and_size_on_local(tmp_path):
    url = f"file://{tmp_path}/objects"
    s = make_store(url, memory=0, ttl_s=100, pack_bytes=1)  # one block per pack
    s.put_many([(key(i), kv_block(i)) for i in range(5)])
    s.flush()
    size = kv_stats(url)["kv_bytes"]
    out = kv_gc(url, ttl_s=None, max_bytes=size - 1)
    assert out["packs_evicted_for_size"] == 1 and out["packs_kept"] == 4
    assert s.gc(now=time.time() + 50)["packs_expired"] == 0
    out = s.gc(now=time.time() + 101)
    assert out["packs_expired"] == 4 and kv_stats(url)["packs"] == 0
    assert [r for _, r in s.get_many([key(i) for i in range(5)])] == ["missing"] * 5
    with pytest.raises(ValueError, match="ttl_s"):
        kv_gc(url, ttl_s=0, max_bytes=None)


def test_bad_input_is_an_error_naming_it(tmp_path):
    s = make_store(f"file://{tmp_path}/o", memory=0)
    with pytest.raises(ValueError, match="../etc"):
        s.get_many(["../etc/passwd"])
    with pytest.raises(TypeError, match="torch.Tensor"):
        s.put_many([(key(1), [1, 2])])
    with pytest.raises(Exception, match="url"):
        KVStoreConfig()


# ---------------------------------------------------------------------------------------------
# S3 on loopback (moto)


def s3_store(s3, memory: int = 0, **kw) -> KVStore:
    url, opts, _ = s3
    retry = kw.pop("retry", RetryPolicy(attempts=4, backoff_s=0.01, budget_s=2.0))
    tier = ObjectStoreTier(url, opts, index_refresh_s=0, retry=retry, **kw)
    tiers = ([MemoryTier(memory)] if memory else []) + [tier]
    return KVStore(tiers, FP)


def only_object(fs, url: str) -> str:
    (obj,) = [p for p in fs.find(url.removeprefix("s3://") + "/objects") if p.endswith(".arrow")]
    return obj


def test_s3_round_trip_and_stats(s3):
    url, opts, _ = s3
    w = s3_store(s3)
    blocks = [(key(i), kv_block(i, dt)) for i, dt in enumerate(DTYPES * 2)]
    assert w.put_many(blocks) == 6 and w.put_many(blocks) == 0
    w.flush()
    r = KVStore.from_config(KVStoreConfig(url=url, storage_options=opts, memory_bytes=0, index_refresh_s=0), FP)
    got = r.get_many([k for k, _ in blocks])
    assert all(same_bits(t, b) and tier == "object" for (t, tier), (_, b) in zip(got, blocks))
    s = kv_stats(url, opts)
    assert s["packs"] == 1 and s["blocks"] == 6 and s["fingerprints"][FP]["unique_blocks"] == 6


def test_s3_faults_are_misses_with_reasons(s3):
    url, _, fs = s3
    w = s3_store(s3)
    blocks = [(key(i), kv_block(i)) for i in range(4)]
    w.put_many(blocks)
    w.flush()
    obj = only_object(fs, url)
    reader = s3_store(s3)
    assert all(reader.contains([key(i) for i in range(4)]))  # indexes the pack before the damage
    entries = reader.tiers[-1]._where
    e1 = entries[key(1)][0][1]
    e3 = entries[key(3)][0][1]
    original = fs.cat_file(obj)

    # one flipped byte inside block 1, and the object cut inside block 3
    bad = bytearray(original)
    bad[e1.offset + e1.length // 2] ^= 0x01
    fs.pipe_file(obj, bytes(bad[: e3.offset + e3.length // 2]))
    got = reader.get_many([key(i) for i in range(4)] + [key("absent")])
    assert [r for t, r in got] == ["object", "checksum", "object", "truncated", "missing"]
    assert same_bits(got[0][0], blocks[0][1]) and same_bits(got[2][0], blocks[2][1])

    # the damaged copies are no longer offered: contains says no, and a put rewrites them
    assert reader.contains([key(i) for i in range(4)]) == [True, False, True, False]
    assert reader.put_many(blocks) == 2
    reader.flush()
    assert [r for _, r in reader.get_many([key(1), key(3)])] == ["object", "object"]

    # the object cut before a block starts: S3 refuses the range (416); still "truncated"
    fs.pipe_file(obj, original[: e1.offset])
    got = s3_store(s3).get_many([key(0), key(2)])
    assert [r for _, r in got] == ["object", "truncated"]

    # the object deleted under a reader whose index still points at it
    fs.rm_file(obj)
    assert [r for _, r in reader.get_many([key(0)])] == ["object_deleted"]
    misses = reader.stats()["misses_by_reason"]
    assert misses == {"checksum": 1, "truncated": 1, "missing": 1, "object_deleted": 1}
    # ... and after that the index forgets the pack: a clean miss, and put rewrites the blocks
    assert reader.contains([key(0)]) == [False]
    assert reader.put_many(blocks) == 2  # keys 1 and 3 already live in the rewrite pack
    assert all(same_bits(t, b) for (t, _), (_, b) in zip(reader.get_many([k for k, _ in blocks]), blocks))


def _slow_down_error() -> Exception:
    from botocore.exceptions import ClientError
    from s3fs.errors import translate_boto_error

    err = ClientError(
        {"Error": {"Code": "SlowDown", "Message": "Please reduce your request rate."},
         "ResponseMetadata": {"HTTPStatusCode": 503}},
        "GetObject",
    )
    return translate_boto_error(err)


class Flaky:
    """Makes an fs's reads fail with S3's 503 SlowDown (as s3fs raises it) `failures` times."""

    def __init__(self, fs, failures: int, exc_factory=_slow_down_error) -> None:
        self.fs, self.failures, self.calls, self.exc_factory = fs, failures, 0, exc_factory
        self.cat_file_orig, self.cat_ranges_orig = fs.cat_file, fs.cat_ranges

    def _fail(self) -> bool:
        self.calls += 1
        if self.failures > 0:
            self.failures -= 1
            return True
        return False

    def cat_file(self, path, start=None, end=None, **kw):
        if self._fail():
            raise self.exc_factory()
        return self.cat_file_orig(path, start=start, end=end, **kw)

    def cat_ranges(self, paths, starts, ends, **kw):
        if self._fail():
            raise self.exc_factory()
        return self.cat_ranges_orig(paths, starts, ends, **kw)


def test_s3_transient_errors_are_retried_then_given_up(s3, monkeypatch):
    w = s3_store(s3)
    blocks = [(key(i), kv_block(i)) for i in range(3)]
    w.put_many(blocks)
    w.flush()
    reader = s3_store(s3)
    tier = reader.tiers[-1]

    flaky = Flaky(tier.fs, failures=3)  # the batch read plus two single retries fail
    monkeypatch.setattr(tier.fs, "cat_ranges", flaky.cat_ranges)
    monkeypatch.setattr(tier.fs, "cat_file", flaky.cat_file)
    got = reader.get_many([k for k, _ in blocks])
    assert all(same_bits(t, b) for (t, _), (_, b) in zip(got, blocks))
    assert tier.stats()["retries"] >= 3

    flaky.failures, flaky.calls = 10**6, 0  # an outage: bounded retries, then a miss, in bounded time
    retries = tier.stats()["retries"]
    got = reader.get_many([key(0)])
    assert got == [(None, "io_error")]
    # Bounded by counts, not a clock: the batched read, then `attempts` single reads (each retry
    # after a backoff the policy caps at max_backoff_s), then it gave up.
    assert flaky.calls == 1 + 4 and tier.stats()["retries"] - retries == 4

    flaky.failures, flaky.exc_factory = 1, lambda: TimeoutError("read timed out")
    assert same_bits(reader.get_many([key(1)])[0][0], blocks[1][1])


def test_s3_write_errors_are_counted_not_raised(s3, monkeypatch):
    store = s3_store(s3)
    tier = store.tiers[-1]

    def broken(*a, **kw):
        raise PermissionError("AccessDenied")

    monkeypatch.setattr(tier.fs, "pipe_file", broken)
    assert store.put_many([(key(1), kv_block(1))]) == 1  # accepted into the write buffer
    assert store.flush() == 0  # the segment could not be written: counted, not raised
    assert tier.stats()["write_errors"] == 1 and store.stats()["puts_failed"] == 1


def test_s3_gc_removes_expired_objects(s3):
    url, opts, fs = s3
    store = s3_store(s3, ttl_s=60)
    store.put_many([(key(i), kv_block(i)) for i in range(3)])
    store.flush()
    stale_reader = s3_store(s3)
    assert stale_reader.contains([key(0)]) == [True]  # it knows where the block is, then gc runs
    assert kv_gc(url, ttl_s=60, max_bytes=None, storage_options=opts)["packs_expired"] == 0
    out = kv_gc(url, ttl_s=60, max_bytes=None, storage_options=opts, now=time.time() + 61)
    assert out["packs_expired"] == 1 and out["blocks_deleted"] == 3
    # Nothing of the segment is left; the index's newest generation (gc compacts it) is empty (the
    # one before it stays for the grace period, for readers that hold it).
    assert not [p for p in fs.find(url.removeprefix("s3://")) if p.endswith((".arrow", ".json"))
                and "/generations/" not in p and "/partitions/" not in p]
    assert out["compaction"]["generations_written"] == 1 and out["compaction"]["blocks_indexed"] == 0
    assert [r for _, r in stale_reader.get_many([key(0)])] == ["object_deleted"]
    assert [r for _, r in s3_store(s3).get_many([key(1)])] == ["missing"]


def test_s3_orphan_objects_are_collected(s3):
    url, opts, fs = s3
    store = s3_store(s3)
    tier = store.tiers[-1]
    store.put_many([(key(1), kv_block(1))])
    store.flush()
    # a writer that died between writing its object and publishing the index
    orphan = tier.layout.object_path("0" * 32, f"{int((time.time() - 7200) * 1000):013d}-{'a' * 32}")
    fs.pipe_file(orphan, b"partial")
    out = kv_gc(url, ttl_s=None, max_bytes=None, storage_options=opts)
    assert out["orphan_objects_deleted"] == 1 and out["packs_kept"] == 1
    assert not fs.exists(orphan)
    assert os.path.basename(orphan).endswith(".arrow")
