"""The persistent, partitioned index (io/kvstore/index.py): a reader loads only the partitions its keys
fall in, whatever the store's size; compaction can die anywhere, or run twice at once, and no
reader ever loses a block."""

from __future__ import annotations

import hashlib
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbatch.io.kvstore.compaction import compact_index
from kvbatch.io.kvstore.faults import RetryPolicy
from kvbatch.io.kvstore.index import PARTITIONS, _ModelIndex, partition_of, recent_prefixes
from kvbatch.io.kvstore.index_files import fingerprint_id
from kvbatch.io.kvstore.object_layout import ObjectLayout
from kvbatch.io.kvstore.object_tier import ObjectStoreTier
from kvbatch.io.kvstore.store import KVStore, kv_compact

FP = "test-kv-index|float16|bs16"
FPID = fingerprint_id(FP)
HOUR = 3600.0


def key(i: int) -> str:
    return hashlib.sha256(f"block-{i}".encode()).hexdigest()


def store(root: Path | str, **kw) -> KVStore:
    return KVStore([ObjectStoreTier(str(root), index_refresh_s=0, retry=RetryPolicy(attempts=1), **kw)], FP)


def fill(root: Path | str, start: int, n: int, per_segment: int = 10) -> list[str]:
    """n blocks in segments of `per_segment` blocks; returns their keys."""
    w = store(root)
    keys = [key(i) for i in range(start, start + n)]
    for i in range(0, n, per_segment):
        w.put_many([(k, torch.full((2, 4), float(j))) for j, k in enumerate(keys[i:i + per_segment], start + i)])
        w.flush()
    return keys


def layout(root: Path | str) -> ObjectLayout:
    return store(root).durable.layout


def later(hours: float) -> float:
    """A compaction clock this far ahead: the segments written now are then all behind its
    `covers_before_ms`, so a reader finds them through the generation only."""
    return time.time() + hours * HOUR


def test_a_lookup_costs_the_partitions_its_keys_need_whatever_the_store_size(tmp_path):
    small, big = tmp_path / "small", tmp_path / "big"
    asked = fill(small, 0, 20)[:3]
    assert fill(big, 0, 400)[:3] == asked  # the same three keys, in a store twenty times bigger
    costs = []
    for root in (small, big):
        assert compact_index(layout(root), now=later(2))["generations_written"] == 1
        r = store(root)
        before = r.request_counts()
        assert r.contains(asked) == [True] * 3
        costs.append(r.durable.layout.requests.since(before))
        before = r.request_counts()
        # A key of a partition already read that the store lacks: no partition read again, only
        # the listing of recent index files (every call here: index_refresh_s=0).
        missing = next(key(i) for i in range(10**6, 10**7) if partition_of(key(i)) == partition_of(asked[0]))
        assert r.contains([missing]) == [False]
        assert r.durable.layout.requests.since(before) == {"GET": 0, "PUT": 0, "LIST": 1, "HEAD": 0, "DELETE": 0}
    # List the generations, read the newest, read one directory entry and one page per distinct
    # partition asked, list the index files written since the generation (none): the same for both.
    parts = len({partition_of(k) for k in asked})
    assert costs[0] == costs[1] == {"GET": 1 + 2 * parts, "PUT": 0, "LIST": 2, "HEAD": 0, "DELETE": 0}
    got = store(big).get_many(asked)
    assert [float(t[0, 0]) for t, _ in got] == [0.0, 1.0, 2.0]


def bytes_read(r: KVStore) -> list[int]:
    """Count the bytes every ranged read of the reader's layout returns."""
    lay, seen = r.durable.layout, []
    real = lay.get_ranges

    def counted(paths, starts, ends):
        out = real(paths, starts, ends)
        seen.extend(len(b) for b in out if isinstance(b, bytes | bytearray))
        return out

    lay.get_ranges = counted
    return seen


def test_a_paged_lookup_reads_the_pages_of_its_keys_not_their_partitions(tmp_path):
    small, big = tmp_path / "small", tmp_path / "big"
    asked = fill(small, 0, 60, per_segment=60)[:5]
    fill(big, 0, 3000, per_segment=1000)  # 50 times the rows in each partition
    reads = []
    for root in (small, big):
        compact_index(layout(root), now=later(2))
        r = store(root)
        seen = bytes_read(r)
        before = r.request_counts()
        assert r.contains(asked) == [True] * 5
        reads.append((r.durable.layout.requests.since(before)["GET"], sum(seen)))
        assert [float(t[0, 0]) for t, _ in r.get_many(asked)] == [0.0, 1.0, 2.0, 3.0, 4.0]
        # Asked again: the pages are cached, nothing is read.
        before = r.request_counts()
        assert r.contains(asked) == [True] * 5
        assert r.durable.layout.requests.since(before)["GET"] == 0
    (gets_small, bytes_small), (gets_big, bytes_big) = reads
    assert gets_big == gets_small == 1 + 2 * len({partition_of(k) for k in asked})
    assert bytes_big < 3 * bytes_small  # whole partitions: ~50 times the bytes
    whole = store(big)
    compact_index(layout(big), now=later(3), paged=False)  # partitions as before pages
    seen, lay = [], whole.durable.layout
    real_get = lay.get

    def counted_get(path):
        out = real_get(path)
        seen.append(len(out))
        return out

    lay.get = counted_get
    assert all(whole.contains(asked))
    assert sum(seen) > 2 * bytes_big


def test_segments_written_after_a_compaction_are_found(tmp_path):
    old = fill(tmp_path, 0, 20)
    compact_index(layout(tmp_path))  # covers what is older than an hour: nothing yet
    new = fill(tmp_path, 100, 20)
    r = store(tmp_path)
    assert all(r.contains(old + new))
    assert [t is not None for t, _ in r.get_many(old[:2] + new[:2])] == [True] * 4


def test_partitions_spread_keys_and_recent_prefixes_cover_the_span():
    counts = [0] * PARTITIONS
    for i in range(4096):
        counts[int(partition_of(key(i)), 16)] += 1
    assert min(counts) > 0 and max(counts) < 40  # 16 per partition on average
    t = 1_796_140_201_195
    ps = recent_prefixes(t - 3_600_000, t + 600_000)
    assert 0 < len(ps) <= 8 and all(str(t).startswith(p) or p < str(t) for p in ps)
    assert any(str(t - 3_600_000).startswith(p) for p in ps) and any(str(t + 600_000).startswith(p) for p in ps)
    assert len(recent_prefixes(t - 30 * 86_400_000, t)) <= 8  # a month: coarser prefixes, still few


def test_a_reader_whose_generation_is_removed_falls_back_to_the_newest(tmp_path):
    keys = fill(tmp_path, 0, 60)
    compact_index(layout(tmp_path), now=later(2))
    r = store(tmp_path)
    assert r.contains(keys[:1]) == [True]  # holds the first generation and one partition
    for hours in (3, 4):  # two newer generations; the first is removed (grace 0, keep 2)
        out = compact_index(layout(tmp_path), now=later(hours), grace_s=0)
    assert out["generations_deleted"] == 1 and out["partitions_deleted"] > 0
    assert all(r.contains(keys))  # its next partition is gone: it moves to the newest generation


def test_two_compactions_at_once_leave_a_complete_index(tmp_path):
    keys = fill(tmp_path, 0, 80)
    outs: list[dict] = []
    threads = [threading.Thread(target=lambda h=h: outs.append(compact_index(layout(tmp_path), now=later(h))))
               for h in (2, 2)]  # the same clock: two generations of the same millisecond
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [o["generations_written"] for o in outs] == [1, 1]
    gens = layout(tmp_path).list_generations(FPID)
    assert len(gens) == 2
    for g in gens:  # each generation is whole on its own: a reader told to skip the other one
        r = store(tmp_path)
        r.durable._index._models[FPID] = _ModelIndex(broken=set(gens) - {g})
        assert all(r.contains(keys)), g


def test_a_compaction_that_stalls_while_another_runs_loses_nothing(tmp_path, monkeypatch):
    # A is held after writing its partitions, before publishing; B runs whole meanwhile and, with
    # no grace, removes A's partitions as a dead compaction's. A then publishes a generation whose
    # partitions are gone: readers must skip it for B's.
    keys = fill(tmp_path, 0, 80)
    a_layout = layout(tmp_path)
    held, go = threading.Event(), threading.Event()
    real = a_layout.put_new

    def put_new(path, data):
        if "/generations/" in path and not go.is_set():
            held.set()
            go.wait(30)
        return real(path, data)

    monkeypatch.setattr(a_layout, "put_new", put_new)
    a = threading.Thread(target=lambda: compact_index(a_layout, now=later(3), grace_s=0))
    a.start()
    assert held.wait(30)
    b = compact_index(layout(tmp_path), now=later(3) + 10, grace_s=0)
    assert b["partitions_deleted"] > 0  # A's, not yet named by any generation
    go.set()
    a.join()
    r = store(tmp_path)
    assert all(r.contains(keys))


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(crash_at=st.integers(0, 60), compacted_before=st.integers(0, 2))
def test_a_compaction_killed_at_any_write_or_delete_loses_nothing(crash_at, compacted_before):
    with tempfile.TemporaryDirectory() as d:
        keys = fill(d, 0, 40)
        for i in range(compacted_before):
            compact_index(layout(d), now=later(2 + i))
        lay = layout(d)
        calls = {"n": 0}

        def dying(fn):
            def wrapped(*a, **kw):
                calls["n"] += 1
                if calls["n"] > crash_at:
                    raise RuntimeError("killed")
                return fn(*a, **kw)
            return wrapped

        lay.put_new, lay.remove = dying(lay.put_new), dying(lay.remove)
        try:
            compact_index(lay, RetryPolicy(attempts=1), now=later(5), grace_s=0, keep_generations=1)
            died = False
        except RuntimeError:
            died = True
        r = store(d)
        assert all(r.contains(keys)), (crash_at, compacted_before, died)
        # The next compaction finishes the job: one generation left (keep 1), every key found.
        out = compact_index(layout(d), now=later(6), grace_s=0, keep_generations=1)
        assert out["generations_written"] == 1 and len(layout(d).list_generations(FPID)) == 1
        assert {g for g, _ in layout(d).list_partitions(FPID)} == set(layout(d).list_generations(FPID))
        assert all(store(d).contains(keys))


def test_kv_compact_refuses_a_negative_grace_and_reports(tmp_path):
    fill(tmp_path, 0, 10)
    with pytest.raises(ValueError, match="grace_s"):
        kv_compact(str(tmp_path), grace_s=-1)
    out = kv_compact(str(tmp_path))
    assert out["generations_written"] == 1 and out["blocks_indexed"] == 10 and out["segments_indexed"] == 1


def test_cli_kv_compact(tmp_path, capsys):
    import json

    from kvbatch.cli.main import main

    keys = fill(tmp_path, 0, 10)
    assert main(["kv", "compact", "--store", str(tmp_path), "--grace-hours", "0"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["generations_written"] == 1 and out["blocks_indexed"] == 10
    assert main(["kv", "compact", "--store", str(tmp_path), "--grace-hours", "-1"]) != 0
    assert all(store(tmp_path).contains(keys))


def test_an_invalid_partition_is_skipped_for_an_older_generation(tmp_path):
    keys = fill(tmp_path, 0, 30)
    compact_index(layout(tmp_path), now=later(2))
    compact_index(layout(tmp_path), now=later(3))
    newest = max(layout(tmp_path).list_generations(FPID))
    for path in (tmp_path / "partitions" / FPID).glob(f"{newest}.*.arrow"):
        path.write_bytes(b"not arrow")  # written over by someone else
    r = store(tmp_path)
    assert all(r.contains(keys))
    assert r.durable.stats()["invalid_index_files"] == 1


def test_a_compaction_that_cannot_read_an_index_file_publishes_nothing(tmp_path, monkeypatch):
    fill(tmp_path, 0, 20, per_segment=5)
    lay = layout(tmp_path)
    real = lay.get

    def flaky(path):
        if "/index/" in path:
            raise TimeoutError("read timed out")
        return real(path)

    monkeypatch.setattr(lay, "get", flaky)
    out = compact_index(lay, RetryPolicy(attempts=1))
    assert out["generations_written"] == 0 and out["unreadable_index_files"] == 4
    assert lay.list_generations(FPID) == [] and lay.list_partitions(FPID) == []


def test_a_paged_partition_that_lies_is_skipped_for_an_older_generation(tmp_path):
    import struct

    keys = fill(tmp_path, 0, 600, per_segment=600)
    compact_index(layout(tmp_path), now=later(2))
    compact_index(layout(tmp_path), now=later(3))
    newest = max(layout(tmp_path).list_generations(FPID))
    for path in (tmp_path / "partitions" / FPID).glob(f"{newest}.*.arrow"):
        raw = bytearray(path.read_bytes())
        assert raw[:8] == b"KVIDXPG1"
        raw[8:16] = struct.pack("<Q", len(raw) + 100)  # page 0 starts past the end of the file
        raw[16:24] = struct.pack("<Q", len(raw) + 200)
        path.write_bytes(bytes(raw))
    r = store(tmp_path)
    assert all(r.contains(keys))  # every key found through the older generation
    assert r.durable.stats()["invalid_index_files"] == 1
