"""One day's committed tables, read for the scorecard (:mod:`kvbatch.ops.results.scorecard`).

Plain Python (no Dagster). Only what the scorecard needs is read: row counts from Parquet
footers (prompts, rejects, every shard), the day's shard count, the results' scalar columns
(never the token ids) and the per-shard ``cost_metrics`` rows. A table a step has not written
yet reads as empty, so a day part-way through still has a scorecard that says what is missing.
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import polars as pl

from kvbatch.io.shard_tables import PART, join, read_shards
from kvbatch.ops.shards.routing import SHARD_COUNT_FILE, read_shard_count

FOOTER_READERS = 16  # shard footers read at once (small range reads on an object store)
# The results columns the scorecard reads (the token ids and the text are left on the store).
RESULT_COLUMNS = ("finish_reason", "prompt_tokens", "completion_tokens", "cached_prompt_tokens",
                  "loaded_prompt_tokens", "ttft_s", "tpot_s", "cached")
# Columns a day's results may lack in every shard (written before the column existed): read as absent.
OPTIONAL_RESULT_COLUMNS = ("cached",)


@dataclass(frozen=True)
class DayTables:
    """What one day's tables hold, as the scorecard reads them.

    ``shard_rows``: one row per shard table written (``shard``, ``rows``); ``results``: one row
    per result with its ``shard`` (a row the response cache answered, ``cached``, has null
    ``ttft_s`` and ``tpot_s``: no engine ran it, so it measured no latency; the P95s and the
    rollup's percentiles are the engine's rows); ``metrics``: the ``cost_metrics`` rows with their
    ``shard``."""

    date: str
    num_shards: int | None  # the day's shard count (None: prompt_shards has not run)
    valid_rows: int  # rows ingest accepted (the prompts table)
    rejected_at_ingest: int
    rejected_at_tokenization: int
    shard_rows: pl.DataFrame
    results: pl.DataFrame
    metrics: pl.DataFrame


def _folder(table: str, date: str) -> str:
    return f"{table}/date={date}"


def _footer_rows(url: str, opts: Mapping[str, Any]) -> int:
    """Rows of a Parquet file from its footer; 0 when the file is not there (the step has not run)."""
    import fsspec
    import pyarrow.parquet as pq

    try:
        with fsspec.open(url, "rb", **dict(opts)) as f:
            return pq.ParquetFile(f).metadata.num_rows
    except FileNotFoundError:
        return 0


def _shard_row_counts(root: str, date: str, opts: Mapping[str, Any]) -> pl.DataFrame:
    """(shard, rows) of every committed shard table, from the footers."""
    import fsspec

    fs, base = fsspec.core.url_to_fs(join(root, _folder("shards", date)), **dict(opts))
    try:
        folders = sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(base.rstrip("/"), detail=False))
    except FileNotFoundError:
        folders = []
    shards = [f.split("=", 1)[1] for f in folders if f.startswith("shard=")]
    # One footer per shard: a night of a thousand shards reads them side by side, not in series.
    with ThreadPoolExecutor(max_workers=FOOTER_READERS) as pool:
        rows = list(pool.map(lambda s: _footer_rows(join(root, _folder("shards", date), f"shard={s}", PART), opts),
                             shards))
    return pl.DataFrame({"shard": shards, "rows": rows}, schema={"shard": pl.String, "rows": pl.Int64})


def read_day(root: str, date: str, *, storage_options: Mapping[str, Any] | None = None) -> DayTables:
    """The tables of ``date`` under the object-store ``root``."""
    opts = dict(storage_options or {})
    count = read_shard_count(join(root, _folder("shards", date), SHARD_COUNT_FILE), storage_options=opts)
    results = _read_results(root, date, opts)
    metrics = read_shards(root, _folder("cost_metrics", date), storage_options=opts)
    return DayTables(
        date=date,
        num_shards=None if count is None else count.num_shards,
        valid_rows=_footer_rows(join(root, _folder("prompts", date), PART), opts),
        rejected_at_ingest=_footer_rows(join(root, _folder("rejects", date), PART), opts),
        rejected_at_tokenization=_footer_rows(join(root, _folder("shard_rejects", date), PART), opts),
        shard_rows=_shard_row_counts(root, date, opts),
        results=_no_latency_when_cached(pl.from_arrow(results)) if results.num_columns else empty_results(),
        metrics=(pl.from_arrow(metrics) if metrics.num_columns
                 else pl.DataFrame({"shard": []}, schema={"shard": pl.String})),
    )


def _read_results(root: str, date: str, opts: Mapping[str, Any]) -> Any:
    """The day's results columns the scorecard reads; an optional column no shard has is left out."""
    import pyarrow as pa

    try:
        return read_shards(root, _folder("results", date), storage_options=opts, columns=list(RESULT_COLUMNS))
    except pa.ArrowInvalid:  # "No match for FieldRef": every shard predates an optional column
        columns = [c for c in RESULT_COLUMNS if c not in OPTIONAL_RESULT_COLUMNS]
        return read_shards(root, _folder("results", date), storage_options=opts, columns=columns)


def _no_latency_when_cached(results: pl.DataFrame) -> pl.DataFrame:
    if "cached" not in results.columns:
        return results
    cached = pl.col("cached").fill_null(False)
    return results.with_columns(*(pl.when(cached).then(None).otherwise(pl.col(c)).alias(c)
                                  for c in ("ttft_s", "tpot_s")))


def empty_results() -> pl.DataFrame:
    """A results frame with no rows (no shard decoded yet)."""
    schema = {"shard": pl.String, "finish_reason": pl.String, **{c: pl.Int64 for c in RESULT_COLUMNS[1:5]},
              "ttft_s": pl.Float64, "tpot_s": pl.Float64, "cached": pl.Boolean}
    return pl.DataFrame(schema=schema)
