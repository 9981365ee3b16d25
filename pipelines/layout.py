"""Where one day's tables live under the object store root: hive-style ``date=`` / ``shard=`` folders.

    <root>/prompts/date=2026-11-29/part.parquet                  date-only tables
    <root>/results/date=2026-11-29/shard=0003/part.parquet       per (date, shard)
    <root>/kv/...                                                the KV store, shared by every day

So ``pyarrow.parquet.read_table("<root>/results")`` (or polars/DuckDB/Spark with hive
partitioning) gives every result with ``date`` and ``shard`` columns, and a re-run of one
(date, shard) replaces exactly one file. The KV store is not dated: blocks are
content-addressed, so a system prompt prefilled yesterday is a hit today.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvbatch.io.shard_tables import PART, join, shard_url
from kvbatch.pipelines.partitions import check_date


@dataclass(frozen=True)
class DayLayout:
    root: str
    date: str

    def __post_init__(self) -> None:
        check_date(self.date)

    def folder(self, table: str) -> str:
        """``<table>/date=<date>``: the table's folder for this day, relative to the root."""
        return f"{table}/date={self.date}"

    def table(self, table: str, name: str = PART) -> str:
        """A date-only table: ``<root>/<table>/date=<date>/<name>``."""
        return join(self.root, self.folder(table), name)

    def shard(self, table: str, shard: str, name: str = PART) -> str:
        """One shard's file: ``<root>/<table>/date=<date>/shard=<shard>/<name>``."""
        return shard_url(self.root, self.folder(table), shard, name)
