"""The shard step's spill (``ops/shards/spill.py``): pieces of many shards appended in input order,
then written one shard at a time, so a night's thousand shards never hold a thousand Parquet
writers (each keeps its row groups' metadata in memory) open at once."""

from __future__ import annotations

import threading

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbatch.ops.shards import spill as shard_spill
from kvbatch.ops.shards.spill import ShardSpill

SCHEMA = pa.schema([("n", pa.int64()), ("text", pa.string()), ("ids", pa.list_(pa.int32()))])


def _piece(start: int, rows: int) -> pa.Table:
    return pa.table({"n": list(range(start, start + rows)), "text": [f"t{i}" * (i % 5) for i in range(rows)],
                     "ids": [[i] * (i % 4) for i in range(rows)]}, schema=SCHEMA)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4), st.integers(0, 40)), max_size=30), st.integers(1, 2),
       st.integers(1, 64))
def test_each_shard_reads_back_its_pieces_in_order_in_bounded_row_groups(tmp_path_factory, monkeypatch_module,
                                                                         pieces, threads, group_rows):
    monkeypatch_module.setattr(shard_spill, "ROW_GROUP_ROWS", group_rows)
    monkeypatch_module.setenv("KVBATCH_SPOOL_DIR", str(tmp_path_factory.mktemp("spool")))
    spill = ShardSpill(SCHEMA, 5)
    want: dict[int, list[pa.Table]] = {s: [] for s in range(5)}
    start = 0
    for shard, rows in pieces:
        piece = _piece(start, rows)
        # A slice of a larger table, as the shard step adds them.
        padded = pa.concat_tables([_piece(-3, 3), piece, _piece(-9, 2)]).slice(3, rows)
        spill.add(shard, padded)
        want[shard].append(piece)
        start += rows
    got: dict[int, list[pa.Table]] = {}
    lock = threading.Lock()

    def write(shard, groups):
        tables = list(groups)
        with lock:
            got[shard] = tables

    spill.write_shards(write, threads=threads)
    spill.close()
    assert sorted(got) == list(range(5))  # every shard, empty ones too
    for s in range(5):
        expected = pa.concat_tables(want[s]) if want[s] else SCHEMA.empty_table()
        groups = got[s]
        assert (pa.concat_tables(groups) if groups else SCHEMA.empty_table()).equals(expected)
        # Every row group but the last reaches the size; none is empty.
        assert all(g.num_rows >= group_rows for g in groups[:-1]) and all(g.num_rows for g in groups)


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def test_the_spill_file_is_removed_after_an_error_in_a_shard_write(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBATCH_SPOOL_DIR", str(tmp_path))
    spill = ShardSpill(SCHEMA, 3)
    spill.add(1, _piece(0, 10))
    assert len(list(tmp_path.iterdir())) == 1

    def write(shard, groups):
        list(groups)
        if shard == 1:
            raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        spill.write_shards(write, threads=2)
    spill.close()
    assert list(tmp_path.iterdir()) == []
