"""Parquet tables of the pipeline, partitioned like the shards, each committed atomically.

Layout under a dataset root (any fsspec URL)::

    <root>/<table>/shard=0003/part.parquet     one file per shard (hive-style partition folder)
    <root>/<table>/part.parquet                 unpartitioned tables (prompts, rejects)

A shard's file is written to a name nobody reads and made visible only on commit (local:
``os.replace``; s3/gcs/azure: a multipart upload completed on commit; other filesystems: a
``.tmp-`` sibling then ``mv``; see :mod:`kvbatch.io.batch_output`). So a re-run replaces the
shard whole, and a crash leaves the last good commit. Readers read ``part.parquet`` by name and
never see a half-written table (a stale ``part.parquet.tmp-*`` from a killed writer is ignored).
"""

from __future__ import annotations

import io as _io
import json
import re
from collections.abc import Mapping
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from kvbatch.io.batch_output import AtomicSink

__all__ = [
    "PART",
    "exists",
    "join",
    "read_json",
    "read_shards",
    "read_table",
    "shard_url",
    "table_url",
    "write_json",
    "write_table",
]

PART = "part.parquet"
_SHARD_KEY = re.compile(r"^[0-9A-Za-z_-]{1,64}$")


def join(root: str, *parts: str) -> str:
    return "/".join([root.rstrip("/"), *(p.strip("/") for p in parts)])


def shard_url(root: str, table: str, shard: str, name: str = PART) -> str:
    """``<root>/<table>/shard=<shard>/<name>``. Shard keys come from the partition definition,
    never from user data; they are checked anyway, since they become a path."""
    if not _SHARD_KEY.match(shard):
        raise ValueError(f"shard key {shard!r} is not a safe path component")
    return join(root, table, f"shard={shard}", name)


def table_url(root: str, table: str, name: str = PART) -> str:
    return join(root, table, name)


def write_table(table: pa.Table, url: str, *, storage_options: Mapping[str, Any] | None = None) -> int:
    """Write ``table`` as one Parquet file at ``url``, atomically. Returns the bytes written."""
    buf = _io.BytesIO()
    pq.write_table(table, buf, compression="zstd")
    return _commit_bytes(buf.getvalue(), url, storage_options)


def write_json(obj: Mapping[str, Any], url: str, *, storage_options: Mapping[str, Any] | None = None) -> None:
    """A small JSON document (per-shard step stats), committed atomically like the tables."""
    _commit_bytes((json.dumps(obj, sort_keys=True, default=str) + "\n").encode(), url, storage_options)


def _commit_bytes(data: bytes, url: str, storage_options: Mapping[str, Any] | None) -> int:
    """Write ``data`` to ``url`` in one atomic commit (nothing is left on a failure); its length."""
    sink = AtomicSink(url, storage_options)
    try:
        sink.write(data)
        sink.commit()
    except BaseException:
        sink.abort()
        raise
    return len(data)


def read_json(url: str, *, storage_options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    with fsspec.open(url, "rt", encoding="utf-8", **dict(storage_options or {})) as f:
        return json.load(f)


def read_table(url: str, *, storage_options: Mapping[str, Any] | None = None) -> pa.Table:
    with fsspec.open(url, "rb", **dict(storage_options or {})) as f:
        return pq.read_table(f)


def exists(url: str, *, storage_options: Mapping[str, Any] | None = None) -> bool:
    fs, path = fsspec.core.url_to_fs(url, **dict(storage_options or {}))
    return bool(fs.exists(path))


# Partition values stay strings ("0003"), never inferred as numbers.
_SHARD_PARTITIONING = pa.schema([("shard", pa.string())])


def read_shards(root: str, table: str, *, storage_options: Mapping[str, Any] | None = None,
                columns: list[str] | None = None) -> pa.Table:
    """Every committed shard of ``table`` with a ``shard`` column, in shard order (empty when none).
    ``columns``: read only those (a day's results are large, its latencies are not).

    A hive-partitioned dataset read by pyarrow (``shard=K`` folders give the string column ``shard``);
    only each folder's committed ``part.parquet`` is in it, so a writer's temporary file is never
    read. Shards written by older code with fewer columns are promoted (missing columns are null).
    For polars, ``pl.from_arrow`` of the result (the rollup does)."""
    import pyarrow.dataset as ds
    from pyarrow.fs import FSSpecHandler, PyFileSystem

    fs, base = fsspec.core.url_to_fs(join(root, table), **dict(storage_options or {}))
    base = base.rstrip("/")
    try:
        folders = sorted(p.rstrip("/") for p in fs.ls(base, detail=False)
                         if p.rstrip("/").rsplit("/", 1)[-1].startswith("shard="))
    except FileNotFoundError:
        folders = []
    files = [f"{folder}/{PART}" for folder in folders if fs.exists(f"{folder}/{PART}")]
    if not files:
        return pa.table({})
    factory = ds.FileSystemDatasetFactory(
        PyFileSystem(FSSpecHandler(fs)), files, ds.ParquetFileFormat(),
        ds.FileSystemFactoryOptions(partition_base_dir=base,
                                    partitioning=ds.partitioning(_SHARD_PARTITIONING, flavor="hive")))
    dataset = factory.finish(factory.inspect(promote_options="permissive", fragments=None))
    return dataset.to_table(columns=None if columns is None else [*columns, "shard"])
