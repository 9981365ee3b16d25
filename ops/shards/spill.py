"""The shard step's rows spilled to one local Arrow file, then written out one shard at a time.

Hash routing sends a night's rows to all of its shards until the last input batch. Writing each
shard's Parquet file as its rows come means a thousand Parquet writers open at once, and a
writer keeps every row group's metadata in memory until it closes (about 15 KB per row group of
the shard schema, measured): 1,000,000 rows into 100 shards took the step from 357 MB to 777 MB,
and ten million rows into a thousand shards would need gigabytes. So the step writes each input
batch's per-shard pieces, in order, to one local Arrow IPC file (lz4-compressed; one open file
whatever the shard count), and afterwards writes the shards one at a time, each read back from
the file piece by piece into row groups of ``ROW_GROUP_ROWS`` rows. Memory is then
one input batch while tokenizing and a row group or two per writing thread after; the local disk
holds the day's tokenized rows (compressed) until the step ends.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import pyarrow as pa

from kvbatch.io.batch_output import spool_dir

ROW_GROUP_ROWS = 8192


class ShardSpill:
    """Pieces of ``num_shards`` shards appended in input order, read back shard by shard."""

    def __init__(self, schema: pa.Schema, num_shards: int) -> None:
        self.schema = schema
        self._dir = tempfile.mkdtemp(prefix="kvbatch-shard-spill-", dir=spool_dir())
        self._path = os.path.join(self._dir, "pieces.arrow")
        self._sink = pa.OSFile(self._path, "wb")
        self._writer = pa.ipc.new_file(self._sink, schema, options=pa.ipc.IpcWriteOptions(compression="lz4"))
        self._pieces: list[list[int]] = [[] for _ in range(num_shards)]
        self._count = 0

    def add(self, shard: int, piece: pa.Table) -> None:
        """Append rows of shard ``shard`` (after every piece of it added before)."""
        for batch in piece.to_batches():
            if batch.num_rows:
                self._writer.write_batch(batch)
                self._pieces[shard].append(self._count)
                self._count += 1

    def write_shards(self, write: Callable[[int, Iterator[pa.Table]], None], threads: int = 1) -> None:
        """``write(shard, row_groups)`` for every shard, ``threads`` shards at a time; each shard's
        row groups are its pieces in order, joined up to ``ROW_GROUP_ROWS`` rows."""
        self._writer.close()
        self._sink.close()
        # Read, not memory-mapped: mapped pages count in the process's RSS until unmapped, so a
        # map would show (and, under memory pressure, hold) the whole spill file.
        with pa.OSFile(self._path, "rb") as source:
            reader = pa.ipc.open_file(source)
            lock = threading.Lock()  # one reader for the writing threads: reads one at a time

            def row_groups(shard: int) -> Iterator[pa.Table]:
                group: list[pa.RecordBatch] = []
                rows = 0
                for index in self._pieces[shard]:
                    with lock:
                        batch = reader.get_batch(index)
                    group.append(batch)
                    rows += batch.num_rows
                    if rows >= ROW_GROUP_ROWS:
                        yield pa.Table.from_batches(group, self.schema)
                        group, rows = [], 0
                if group:
                    yield pa.Table.from_batches(group, self.schema)

            if threads <= 1:
                for shard in range(len(self._pieces)):
                    write(shard, row_groups(shard))
                return
            with ThreadPoolExecutor(threads, thread_name_prefix="kvbatch-shard-writer") as pool:
                # Parquet encoding and compression release the GIL: shards are written side by side.
                for done in [pool.submit(write, shard, row_groups(shard)) for shard in range(len(self._pieces))]:
                    done.result()

    def close(self) -> None:
        """Remove the spill file (after :meth:`write_shards`, or on an error)."""
        try:
            self._writer.close()
        except Exception:  # noqa: BLE001 - already closed, or the error in flight matters more
            pass
        try:
            self._sink.close()
        except Exception:  # noqa: BLE001
            pass
        shutil.rmtree(self._dir, ignore_errors=True)
