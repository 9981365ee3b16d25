"""Decode that writes as it goes: each rank commits a part file every N results, a re-run resumes.

A shard's decode writes into a staging folder (``parts_url``, outside the results table so that
no reader of ``results/`` ever sees a part)::

    <parts_url>/key.json                                   what the parts were decoded from
    <parts_url>/part-<attempt>-r<rank>-<seq>.parquet       one checkpoint: up to N results of one rank

A part file is the checkpoint: it is created atomically (visible whole or not at all), holds the
results of up to ``checkpoint_rows`` finished requests (each with its manifest index) and, in its
schema metadata, the rank's cumulative stats at that point. Every rank writes only its own
parts; no result row travels between ranks. A re-run lists the parts, skips every manifest index
already in one (so a SIGKILL loses at most the results since the rank's last part) and decodes
the rest; a run whose parts came from other manifests (``key.json`` differs: prefill re-ran)
starts over. When every rank is done, rank 0 merges the parts (a k-way merge over small batches, in
manifest order) into the shard's one ``part.parquet`` (committed atomically, as before: readers
are unchanged) and only then deletes the staging folder. Each manifest index is in at most one part, so the committed table holds each
request exactly once.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from kvbatch.io.batch_output import AtomicSink, ParquetSinkFile
from kvbatch.io.shard_tables import write_json

DEFAULT_CHECKPOINT_ROWS = 256  # a part per 256 results: at most that much work lost, few small objects
INDEX_COLUMN = "manifest_index"
STATS_KEY = b"kvbatch.decode_stats"
KEY_NAME = "key.json"


def default_parts_url(results_url: str) -> str:
    """The staging folder beside the results file when none is given: ``.../.decode_parts`` (a
    dot name: pyarrow, polars, Spark and DuckDB folder scans skip it, as they skip temp files)."""
    return results_url.rsplit("/", 1)[0] + "/.decode_parts"


def manifests_key(manifests_url: str, storage_options: Mapping[str, Any] | None) -> str:
    """Identity of the manifests the parts were decoded from (size and modification / ETag), so
    parts of an older prefill are never mixed into a new shard's results."""
    fs, path = fsspec.core.url_to_fs(manifests_url, **dict(storage_options or {}))
    return fs.ukey(path)


def prepare_parts(parts_url: str, key: str, storage_options: Mapping[str, Any] | None) -> bool:
    """Make ``parts_url`` hold only parts decoded from ``key``; True when earlier parts are kept
    (a resume). Called once per shard (rank 0) before any rank writes; the key itself is written
    by the first part (:class:`PartWriter`), so a run that commits nothing leaves nothing."""
    if parts_key(parts_url, storage_options) == key:
        return True
    remove_parts(parts_url, storage_options)
    return False


def parts_key(parts_url: str, storage_options: Mapping[str, Any] | None) -> str | None:
    """The key the parts in ``parts_url`` were decoded under (``key.json``); None when there is none."""
    fs, base = fsspec.core.url_to_fs(parts_url, **dict(storage_options or {}))
    try:
        with fs.open(f"{base.rstrip('/')}/{KEY_NAME}", "rt", encoding="utf-8") as f:
            key = json.load(f).get("manifests")
    except (FileNotFoundError, json.JSONDecodeError, AttributeError):
        return None
    return key if isinstance(key, str) else None


def parts_count(parts_url: str, storage_options: Mapping[str, Any] | None) -> tuple[int, int]:
    """How many committed parts ``parts_url`` holds, and their rows (footers only)."""
    fs, base = fsspec.core.url_to_fs(parts_url, **dict(storage_options or {}))
    paths = _part_paths(fs, base)
    rows = 0
    for path in paths:
        with fs.open(path, "rb") as f:
            rows += pq.ParquetFile(f).metadata.num_rows
    return len(paths), rows


def _part_paths(fs: Any, base: str, attempt: str | None = None) -> list[str]:
    """The committed parts under ``base`` (of one ``attempt`` when given), in name order."""
    prefix = "part-" if attempt is None else f"part-{attempt}-"
    try:
        names = fs.ls(base, detail=False)
    except FileNotFoundError:
        return []
    return sorted(p for p in names if p.rsplit("/", 1)[-1].startswith(prefix) and p.endswith(".parquet"))


def done_indexes(parts_url: str, storage_options: Mapping[str, Any] | None) -> set[int]:
    """Manifest indexes already answered by a committed part (only that column is read)."""
    fs, base = fsspec.core.url_to_fs(parts_url, **dict(storage_options or {}))
    done: set[int] = set()
    for path in _part_paths(fs, base):
        with fs.open(path, "rb") as f:
            done.update(pq.read_table(f, columns=[INDEX_COLUMN]).column(0).to_numpy().tolist())
    return done


def done_index_array(parts_url: str, storage_options: Mapping[str, Any] | None, rank: int = 0,
                     world: int = 1) -> np.ndarray:
    """The indexes of rank ``rank``'s share (``i % world == rank``) already in a committed part,
    sorted: a numpy array (8 bytes a row), not a set, for shares of millions of rows."""
    fs, base = fsspec.core.url_to_fs(parts_url, **dict(storage_options or {}))
    pieces = [np.empty(0, np.int64)]
    for path in _part_paths(fs, base):
        with fs.open(path, "rb") as f:
            idx = pq.read_table(f, columns=[INDEX_COLUMN]).column(0).to_numpy()
        pieces.append(idx[idx % world == rank])
    return np.unique(np.concatenate(pieces))


@dataclass
class PartWriter:
    """One rank's results, committed as a part file every ``checkpoint_rows`` results."""

    parts_url: str
    schema: pa.Schema
    rank: int
    key: str
    checkpoint_rows: int = DEFAULT_CHECKPOINT_ROWS
    storage_options: Mapping[str, Any] | None = None
    attempt: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    rows: list[dict[str, Any]] = field(default_factory=list)
    parts_written: int = 0
    rows_written: int = 0

    def __post_init__(self) -> None:
        if self.checkpoint_rows < 1:
            raise ValueError(f"checkpoint_rows must be at least 1, got {self.checkpoint_rows}")

    def add(self, index: int, row: dict[str, Any], stats: Any) -> None:
        """Buffer one result (``index``: its manifest position); commit a part when the buffer is
        full. ``stats`` is a zero-argument callable giving the rank's cumulative stats then."""
        self.rows.append({**row, INDEX_COLUMN: index})
        if len(self.rows) >= self.checkpoint_rows:
            self.flush(stats())

    def flush(self, stats: Mapping[str, Any]) -> None:
        """Commit the buffered results (if any) as one part carrying ``stats``."""
        if not self.rows:
            return
        if self.parts_written == 0:  # the staging folder says what it was decoded from, before any part
            write_json({"manifests": self.key}, f"{self.parts_url.rstrip('/')}/{KEY_NAME}",
                       storage_options=self.storage_options)
        schema = self.schema.append(pa.field(INDEX_COLUMN, pa.int64())).with_metadata(
            {STATS_KEY: json.dumps({"attempt": self.attempt, "rank": self.rank, "stats": stats}, default=str)})
        table = pa.Table.from_pylist(sorted(self.rows, key=lambda r: r[INDEX_COLUMN]), schema)
        url = f"{self.parts_url.rstrip('/')}/part-{self.attempt}-r{self.rank:05d}-{self.parts_written:06d}.parquet"
        sink = AtomicSink(url, self.storage_options)
        try:
            sink.write(_parquet_bytes(table))
            sink.commit()
        except BaseException:
            sink.abort()
            raise
        self.parts_written += 1
        self.rows_written += len(self.rows)
        self.rows = []


def _parquet_bytes(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression="zstd")
    return sink.getvalue().to_pybytes()


@dataclass
class Compacted:
    """What :func:`compact_parts` committed: bytes, rows, and the last stats of every
    (attempt, rank) that committed a part (killed attempts included)."""

    results_bytes: int
    rows: int
    stats_by_attempt_rank: dict[tuple[str, int], dict[str, Any]]
    ttft_s: list[float]
    tpot_s: list[float]


MERGE_WINDOW = 1024  # manifest indexes merged (sorted) at a time while compacting


def part_stats(parts_url: str, storage_options: Mapping[str, Any] | None) -> dict[tuple[str, int], dict[str, Any]]:
    """The stats of the last part of every (attempt, rank) in ``parts_url`` (footers only)."""
    fs, base = fsspec.core.url_to_fs(parts_url, **dict(storage_options or {}))
    stats: dict[tuple[str, int], tuple[int, dict[str, Any]]] = {}
    for path in _part_paths(fs, base):
        with fs.open(path, "rb") as f:
            meta = json.loads((pq.ParquetFile(f).schema_arrow.metadata or {})[STATS_KEY])
        seq = int(path.rsplit("-", 1)[-1].split(".")[0])
        who = (meta["attempt"], int(meta["rank"]))
        if who not in stats or stats[who][0] < seq:
            stats[who] = (seq, meta["stats"])
    return {k: v for k, (_, v) in stats.items()}


def merged_parts(parts_url: str, schema: pa.Schema, storage_options: Mapping[str, Any] | None,
                 attempt: str | None = None) -> Iterator[pa.Table]:
    """Every part's rows (of one ``attempt`` when given) in index order, a window of
    :data:`MERGE_WINDOW` indexes at a time, as ``schema`` plus the index column: a k-way merge of
    the sorted parts, so memory is a batch per part plus a window, never the whole table."""
    fs, base = fsspec.core.url_to_fs(parts_url, **dict(storage_options or {}))
    files = [fs.open(path, "rb") for path in _part_paths(fs, base, attempt)]
    try:
        yield from _merged_windows([pq.ParquetFile(f) for f in files], schema.append(pa.field(INDEX_COLUMN, pa.int64())))
    finally:
        for f in files:
            f.close()


def remove_parts(parts_url: str, storage_options: Mapping[str, Any] | None) -> None:
    """Delete the staging folder (after its rows are committed elsewhere)."""
    fs, base = fsspec.core.url_to_fs(parts_url, **dict(storage_options or {}))
    if fs.exists(base):
        fs.rm(base, recursive=True)


def compact_parts(parts_url: str, results_url: str, schema: pa.Schema,
                  storage_options: Mapping[str, Any] | None) -> Compacted:
    """Merge every part into the shard's one results file in manifest order (:func:`merged_parts`),
    commit it atomically, then delete the staging folder. A crash before the commit leaves the
    parts: the re-run finds every request done and compacts again."""
    stats = part_stats(parts_url, storage_options)
    sink = AtomicSink(results_url, storage_options)
    ttft: list[float] = []
    tpot: list[float] = []
    rows = 0
    try:
        out = ParquetSinkFile(sink)
        with pq.ParquetWriter(out, schema, compression="zstd") as writer:
            for window in merged_parts(parts_url, schema, storage_options):
                table = window.select(schema.names)
                # Rows the response cache answered measured no latency (their ttft_s is 0): left out.
                timed = (table.filter(pc.invert(pc.fill_null(table.column("cached"), False)))
                         if "cached" in schema.names else table)
                ttft += pc.drop_null(timed.column("ttft_s")).to_numpy().tolist()
                tpot += pc.drop_null(timed.column("tpot_s")).to_numpy().tolist()
                rows += table.num_rows
                writer.write_table(table)
        sink.commit()
    except BaseException:
        sink.abort()
        raise
    remove_parts(parts_url, storage_options)
    return Compacted(out.bytes_written, rows, stats, ttft, tpot)


def _merged_windows(parts: list[pq.ParquetFile], schema: pa.Schema) -> Iterator[pa.Table]:
    """The parts' rows in index order, a window of indexes at a time (``schema``'s columns)."""
    batches = [p.iter_batches(batch_size=256) for p in parts]
    heads: list[pa.Table | None] = [None] * len(parts)

    def head(i: int) -> pa.Table | None:
        while heads[i] is None or heads[i].num_rows == 0:
            nxt = next(batches[i], None)
            if nxt is None:
                heads[i] = None
                return None
            heads[i] = pa.Table.from_batches([nxt])
        return heads[i]

    while True:
        live = [(i, t) for i in range(len(parts)) if (t := head(i)) is not None]
        if not live:
            return
        end = min(t.column(INDEX_COLUMN)[0].as_py() for _, t in live) + MERGE_WINDOW
        pieces = []
        for i, _ in live:
            while (t := head(i)) is not None:
                idx = t.column(INDEX_COLUMN).to_numpy()
                cut = int(np.searchsorted(idx, end))
                pieces.append(t.slice(0, cut))
                heads[i] = t.slice(cut)
                if cut < t.num_rows:
                    break
        window = pa.concat_tables(pieces).sort_by(INDEX_COLUMN)
        yield window.select(schema.names).cast(schema)
