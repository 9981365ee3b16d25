"""Layout 2 of the KV store (issue 14): blocks buffered across calls into big segments, flushed by
size, on flush() and after a time limit; one ranged GET per chain; every object-store request
counted by kind; create-only writes (two writers of one block are harmless); a store in the old
layout refused with a message saying so."""

from __future__ import annotations

import hashlib
import itertools
import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbatch.cli.main import main
from kvbatch.io.kvstore.block_format import LAYOUT_VERSION
from kvbatch.io.kvstore.faults import RetryPolicy
from kvbatch.io.kvstore.object_layout import LAYOUT_MARKER, StoreLayoutError, coalesce_ranges
from kvbatch.io.kvstore.object_tier import ObjectStoreTier
from kvbatch.io.kvstore.request_counts import REQUEST_KINDS, RequestCounter
from kvbatch.io.kvstore.store import KVStore, KVStoreConfig, kv_stats
from kvbatch.io.kvstore.tiers import MemoryTier

FP = "segments-test-fp"
BLOCK = (2, 2, 4, 2, 8)  # float32: 1 KiB per block


def key(i: int | str) -> str:
    return hashlib.sha256(f"{FP}/{i}".encode()).hexdigest()


def block(i: int) -> torch.Tensor:
    return torch.randn(BLOCK, generator=torch.Generator().manual_seed(i))


def chain(c: int, n: int = 4) -> list[tuple[str, torch.Tensor]]:
    """A prompt's chain of n blocks (keys distinct per chain)."""
    return [(key(f"c{c}-{i}"), block(c * 100 + i)) for i in range(n)]


def store(url: str, opts: dict | None = None, memory: int = 0, clock: Callable[[], float] = time.time,
          **kw) -> KVStore:
    cfg = KVStoreConfig(url=url, storage_options=opts or {}, memory_bytes=memory, index_refresh_s=0, **kw)
    return KVStore.from_config(cfg, FP, clock=clock)


def arrows(root: Path) -> list[Path]:
    return sorted((root / "objects").rglob("*.arrow")) if (root / "objects").exists() else []


def same(got, blocks) -> bool:
    return all(t is not None and torch.equal(t, b) for (t, _), (_, b) in zip(got, blocks, strict=True))


# ------------------------------------------------------------------------------ big segments


def test_blocks_of_many_calls_become_one_segment_at_flush(tmp_path):
    root = tmp_path / "kv"
    w = store(str(root))
    chains = [chain(c) for c in range(5)]
    for c in chains:  # one call per sequence, as the engine saves them
        assert w.put_many(c) == 4
    assert arrows(root) == [] and w.durable.pending() == (20, 20 * 1024)
    assert same(w.get_many([k for k, _ in chains[2]]), chains[2])  # served from the buffer meanwhile
    assert w.flush() == 20
    assert len(arrows(root)) == 1 and len(list((root / "index").rglob("*.json"))) == 1
    assert w.durable.pending() == (0, 0)
    r = store(str(root))
    assert same(r.get_many([k for c in chains for k in [kk for kk, _ in c]]), [b for c in chains for b in c])


def test_a_segment_goes_out_once_pack_bytes_are_pending(tmp_path):
    root = tmp_path / "kv"
    w = store(str(root), pack_bytes=3 * 1024)  # three blocks per segment
    for i in range(7):
        w.put_many([(key(i), block(i))])
    assert len(arrows(root)) == 2 and w.durable.pending() == (1, 1024)
    w.flush()
    assert len(arrows(root)) == 3 and w.durable.pending() == (0, 0)


def test_pending_blocks_are_flushed_after_the_time_limit(tmp_path):
    root = tmp_path / "kv"
    w = store(str(root), flush_after_s=0.05)
    w.put_many(chain(0))
    deadline = time.monotonic() + 30  # a wait for the timer, not a timed assertion
    while w.durable.pending()[0] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert w.durable.pending() == (0, 0) and len(arrows(root)) == 1


def test_a_process_that_never_flushes_loses_nothing_at_exit(tmp_path):
    root = tmp_path / "kv"
    code = (f"import torch; from kvbatch.io.kvstore.store import KVStore, KVStoreConfig; "
            f"s = KVStore.from_config(KVStoreConfig(url={str(root)!r}, memory_bytes=0), {FP!r}); "
            f"s.put_many([(k, torch.full({BLOCK}, float(i))) for i, k in enumerate({[k for k, _ in chain(7)]!r})])")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parent.parent, timeout=120)
    expected = [(k, torch.full(BLOCK, float(i))) for i, (k, _) in enumerate(chain(7))]
    assert same(store(str(root)).get_many([k for k, _ in expected]), expected)


def test_stats_flush_first_so_their_counts_say_what_is_durable(tmp_path):
    w = store(str(tmp_path / "kv"))
    w.put_many(chain(0))
    s = w.stats()
    assert s["tiers"]["object"]["blocks_written"] == 4 and s["tiers"]["object"]["blocks_pending"] == 0


# ------------------------------------------------------------------------------ ranged reads


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("ab"), st.integers(0, 40), st.integers(1, 8)), min_size=1, max_size=12))
def test_coalesced_ranges_cover_every_range_once_and_never_touch(spec):
    ranges = [(p, s, s + n) for p, s, n in spec]
    paths, starts, ends, members = coalesce_ranges(ranges)
    assert sorted(i for m in members for i in m) == list(range(len(ranges)))
    for path, lo, hi, m in zip(paths, starts, ends, members):
        assert all(ranges[i][0] == path and lo <= ranges[i][1] and ranges[i][2] <= hi for i in m)
        assert lo == min(ranges[i][1] for i in m) and hi == max(ranges[i][2] for i in m)
    spans = sorted(zip(paths, starts, ends))
    for (p1, _, e1), (p2, s2, _) in itertools.pairwise(spans):
        assert p1 != p2 or s2 > e1  # merged ranges of one object neither overlap nor touch


def test_a_chain_is_read_with_one_get_on_s3(s3):
    url, opts, _ = s3
    w = store(url, opts)
    chains = [chain(c) for c in range(3)]
    for c in chains:
        w.put_many(c)
    w.flush()
    r = store(url, opts)
    assert all(r.contains([k for c in chains for k, _ in c]))  # finds them in the index first
    before = r.request_counts()
    got = r.get_many([k for k, _ in chains[1]])
    assert same(got, chains[1])
    assert r.durable.layout.requests.since(before) == {"GET": 1, "PUT": 0, "LIST": 0, "HEAD": 0, "DELETE": 0}
    before = r.request_counts()
    # Two chains of one segment, next to each other: still one request.
    assert same(r.get_many([k for c in chains[:2] for k, _ in c]), chains[0] + chains[1])
    assert r.request_counts()["GET"] - before["GET"] == 1


# ------------------------------------------------------------------------------ requests counted


def test_every_request_is_counted_by_kind_on_s3(s3):
    url, opts, _ = s3
    w = store(url, opts)
    # A new store: read the marker (absent), list the root, write the marker; the index is not listed.
    assert w.request_counts() == {"GET": 1, "PUT": 1, "LIST": 1, "HEAD": 0, "DELETE": 0}
    w.put_many(chain(0))
    w.put_many(chain(1))
    w.flush()
    assert w.request_counts()["PUT"] == 1 + 2  # the marker, then one segment and its index file
    assert set(w.stats()["object_requests"]) == set(REQUEST_KINDS)
    out = kv_stats(url, opts)
    assert out["packs"] == 1 and out["blocks"] == 8


def test_request_counter_refuses_an_unknown_kind():
    c = RequestCounter()
    c.add("GET", 2)
    with pytest.raises(ValueError, match="POST"):
        c.add("POST")
    assert c.since({"GET": 1}) == {"GET": 1, "PUT": 0, "LIST": 0, "HEAD": 0, "DELETE": 0}


# ------------------------------------------------------------------------------ create-only writes


@pytest.mark.parametrize("where", ["local", "s3"])
def test_put_new_never_overwrites(where, tmp_path, s3):
    if where == "local":
        tier = ObjectStoreTier(str(tmp_path / "kv"))
    else:
        url, opts, _ = s3
        tier = ObjectStoreTier(url, opts)
    path = f"{tier.layout.root}/objects/x"
    assert tier.layout.put_new(path, b"first") is True
    assert tier.layout.put_new(path, b"second") is False
    assert tier.fs.cat_file(path) == b"first"


def test_two_writers_of_the_same_segment_name_are_harmless(tmp_path):
    def same_ms() -> float:  # both writers' clocks: the same ms, so the same segment name
        return 1_700_000_000.0

    root = tmp_path / "kv"
    a, b = store(str(root), clock=same_ms), store(str(root), clock=same_ms)
    a.put_many(chain(0))
    b.put_many(chain(0))
    assert a.flush() == 4 and b.flush() == 4  # "already there, the same bytes" is success
    assert len(arrows(root)) == 1  # one object: the second create found it and wrote nothing
    assert a.durable.counters.write_errors == b.durable.counters.write_errors == 0
    assert same(store(str(root)).get_many([k for k, _ in chain(0)]), chain(0))


def test_concurrent_writers_of_the_same_blocks_on_s3(s3):
    url, opts, _ = s3
    writers = [store(url, opts) for _ in range(3)]
    barrier = threading.Barrier(3)

    def write(s: KVStore) -> None:
        barrier.wait()
        s.put_many(chain(0) + chain(1))
        s.flush()

    threads = [threading.Thread(target=write, args=(s,)) for s in writers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(s.stats()["puts_failed"] == 0 for s in writers)
    got = store(url, opts).get_many([k for k, _ in chain(0) + chain(1)])
    assert same(got, chain(0) + chain(1))
    assert kv_stats(url, opts)["unique_blocks"] == 8


# ------------------------------------------------------------------------------ the layout version


def test_a_store_in_the_old_layout_is_refused_saying_so(tmp_path, capsys):
    root = tmp_path / "old"
    (root / "index" / ("0" * 32)).mkdir(parents=True)  # what kvbatch before layout 2 left
    with pytest.raises(StoreLayoutError, match="old KV store layout 1"):
        store(str(root))
    assert main(["kv", "stats", "--store", str(root)]) == 2
    assert "old KV store layout 1" in capsys.readouterr().err
    assert not (root / LAYOUT_MARKER).exists()  # nothing written into it


def test_a_store_marked_with_another_layout_is_refused(tmp_path):
    root = tmp_path / "future"
    root.mkdir()
    (root / LAYOUT_MARKER).write_text(json.dumps({"format": "kvbatch.kv-store", "layout_version": 3}))
    with pytest.raises(StoreLayoutError, match=f"layout 3; this kvbatch reads layout {LAYOUT_VERSION}"):
        ObjectStoreTier(str(root), retry=RetryPolicy(attempts=1))


def test_a_new_store_is_marked_once(tmp_path):
    root = tmp_path / "new"
    a, b = store(str(root)), store(str(root))  # the second finds the first's marker
    assert json.loads((root / LAYOUT_MARKER).read_text())["layout_version"] == LAYOUT_VERSION
    assert a.request_counts()["PUT"] == 1 and b.request_counts()["PUT"] == 0


def test_memory_tier_above_sees_writes_at_once(tmp_path):
    tiers = [MemoryTier(1 << 20), ObjectStoreTier(str(tmp_path / "kv"))]
    s = KVStore(tiers, FP)
    s.put_many(chain(0))
    assert [t for _, t in s.get_many([k for k, _ in chain(0)])] == ["memory"] * 4


# ------------------------------------------------------------------------------ one range per chain


def ranges(locations) -> int:
    """How many runs of neighbouring byte ranges the block locations make (a reader's GETs)."""
    return 1 + sum(a["segment"] != b["segment"] or a["offset"] + a["length"] != b["offset"]
                   for a, b in itertools.pairwise(locations))


def contiguous(locations) -> bool:
    return ranges(locations) == 1


def test_a_chain_saved_in_pieces_between_other_chains_stays_contiguous(tmp_path):
    for expect in (True, False):
        w = store(str(tmp_path / f"kv-{expect}"))
        a, b = chain(1, 6), chain(2, 6)
        if expect:  # what the connector tells the store when it plans each sequence
            w.expect_chain([k for k, _ in a])
            w.expect_chain([k for k, _ in b])
        for i in range(0, 6, 2):  # two blocks of each prompt per engine step, interleaved
            w.put_many(a[i:i + 2])
            w.put_many(b[i:i + 2])
        w.flush()
        locs = [w.locations([k for k, _ in c]) for c in (a, b)]
        assert [ranges(loc) for loc in locs] == ([1, 1] if expect else [3, 3])


def test_the_connector_gives_the_store_each_sequence_s_chain(tmp_path):
    from kvbatch.engine.runtime.kv_connector import KVConnector

    kv_cache = torch.randn(2, 2, 16, *BLOCK[2:])  # [layers, K/V, blocks, block size, heads, dim]
    for planned in (True, False):
        w = store(str(tmp_path / f"kv-{planned}"))
        conn = KVConnector(w, 4, 1024)
        a, b = [key(f"a{planned}{i}") for i in range(6)], [key(f"b{planned}{i}") for i in range(6)]
        if planned:  # the scheduler plans each sequence: the connector learns its chain
            assert conn.match(None, 0, a) == [] and conn.match(None, 0, b) == []
        for i in range(0, 6, 2):  # saved a chunk per step, the two sequences' chunks interleaved
            conn.save([(a[i], i), (a[i + 1], i + 1)], kv_cache)
            conn.save([(b[i], 8 + i), (b[i + 1], 9 + i)], kv_cache)
        conn.flush()
        assert [contiguous(w.locations(c)) for c in (a, b)] == [planned, planned]


def test_a_size_flush_keeps_the_chains_still_growing_pending(tmp_path):
    w = store(str(tmp_path / "kv"), pack_bytes=6 * 1024)  # six 1 KiB blocks per segment
    a, b, c = chain(1, 4), chain(2, 4), chain(3, 4)
    for x in (a, b, c):
        w.expect_chain([k for k, _ in x])
    w.put_many(a[:2])
    w.put_many(b[:2])
    w.put_many(a[2:])  # a is whole; b is still being prefilled
    w.put_many(c[:2])  # 8 blocks pending: a segment goes out, with the chains least recently extended
    w.put_many(b[2:])
    w.put_many(c[2:])
    w.flush()
    assert all(contiguous(w.locations([k for k, _ in x])) for x in (a, b, c))


def test_a_prompt_longer_than_the_prefill_chunk_is_one_range(tmp_path):
    from kvbatch.engine.models.weights import load_checkpoint
    from kvbatch.engine.runtime.block_hash import chain_keys
    from kvbatch.engine.runtime.engine_config import EngineConfig
    from kvbatch.engine.runtime.llm import LLM, GenerationRequest
    from kvbatch.engine.spec import EngineSpec
    from tests.tiny_models import VOCAB, build_tiny

    build_tiny("llama", tmp_path / "model")  # transformers is imported once per test process
    ckpt = load_checkpoint(str(tmp_path / "model"))
    kv = KVStore.from_config(KVStoreConfig(url=str(tmp_path / "kv"), memory_bytes=0, index_refresh_s=0),
                             EngineSpec(dtype="fp32", block_size=4).kv_fingerprint(ckpt.fingerprint))
    # 8 tokens a step: each prompt of 33 tokens (8 blocks of 4) is prefilled in five chunks, the two
    # prompts' chunks interleaved step by step.
    llm = LLM(ckpt, engine_config=EngineConfig(block_size=4, max_num_batched_tokens=8, max_num_seqs=2,
                                               linear="blas"), kv_store=kv)
    prompts = [[(7 * i + 3 * j) % (VOCAB - 3) + 3 for j in range(33)] for i in range(2)]
    llm.generate([GenerationRequest(f"p{i}", prompt_token_ids=p, prefill_only=True) for i, p in enumerate(prompts)])
    assert llm.stats["steps"] >= 8
    kv.flush()
    for p in prompts:
        keys = chain_keys(llm.block_manager.root_key, p[:32], 4)
        locs = kv.locations(keys)
        assert len(keys) == 8 and None not in locs and contiguous(locs)
        reader = KVStore.from_config(KVStoreConfig(url=str(tmp_path / "kv"), memory_bytes=0), kv.fingerprint)
        reader.add_locations(locs)
        before = reader.request_counts()
        assert all(t is not None for t, _ in reader.get_many(keys))
        assert reader.durable.layout.requests.since(before)["GET"] == 1  # the chain in one ranged GET
