"""The partitions: date x shard.

- ``date`` (daily, ``KVBATCH_START_DATE`` onwards, days in ``KVBATCH_TIMEZONE``): the day a
  dataset belongs to. Nightly datasets have one per day; an ad-hoc dataset is given its URL in
  the run config and lands in the date partition it is launched for (see ``PromptsConfig``).
  Today's partition exists already (``end_offset=1``), so a file that lands today, or an ad-hoc
  run, can be processed at once.
- ``shard``: a fixed, wide range of keys, ``0000`` .. ``KVBATCH_MAX_SHARDS - 1`` (default 1024
  keys, read once at import). A date uses only its first n of them: ``prompt_shards`` chooses
  n = ceil(valid rows / max_rows_per_shard) and routes a row to ``sha256(custom_id) mod n``, so
  the count follows each day's data while the partitions definition never changes. The
  (date, shard) assets of a shard >= n materialize nothing (see ``assets``), and
  ``shards_after_ingest`` requests only 0..n-1. ``KVBATCH_NUM_SHARDS`` (the old fixed count) is
  refused at import, so a deployment that still sets it learns at once that it no longer applies.

``prompts`` and ``prompt_shards`` are partitioned by date only (one ingest and one tokenization
pass per dataset); ``prefill_kv``, ``decode_results`` and ``cost_metrics`` by date x shard, so a
failed (date, shard) re-runs alone. A multi-partition key joins the dimension values with ``|``
in dimension-name order: ``2026-11-29|0003`` (``dagster asset materialize --partition``).
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Mapping

import dagster as dg

from kvbatch.ops.shards.routing import MAX_SHARD_KEYS, shard_keys

MAX_SHARDS_ENV, OLD_NUM_SHARDS_ENV = "KVBATCH_MAX_SHARDS", "KVBATCH_NUM_SHARDS"
DEFAULT_MAX_SHARDS = 1024


def max_shards_from_env(environ: Mapping[str, str]) -> int:
    """The width of the shard range (``KVBATCH_MAX_SHARDS``, default 1024). ``KVBATCH_NUM_SHARDS``
    set at all is an error: a fixed count silently ignored would shard every day differently
    from what its operator asked for."""
    if OLD_NUM_SHARDS_ENV in environ:
        raise ValueError(
            f"{OLD_NUM_SHARDS_ENV} is no longer read: a date's shard count now follows its data, "
            f"ceil(valid rows / max_rows_per_shard) (prompt_shards' run config, or KVBATCH_MAX_ROWS_PER_SHARD, "
            f"default 10000), within {MAX_SHARDS_ENV} shard keys (default {DEFAULT_MAX_SHARDS}). "
            f"Unset {OLD_NUM_SHARDS_ENV}; to get about N shards a day, set max_rows_per_shard to rows / N")
    raw = environ.get(MAX_SHARDS_ENV, str(DEFAULT_MAX_SHARDS))
    try:
        width = int(raw)
    except ValueError:
        raise ValueError(f"{MAX_SHARDS_ENV}={raw!r} is not an integer") from None
    if not 1 <= width <= MAX_SHARD_KEYS:
        raise ValueError(f"{MAX_SHARDS_ENV}={width} is outside 1..{MAX_SHARD_KEYS} (four-digit shard keys)")
    return width


MAX_SHARDS = max_shards_from_env(os.environ)
START_DATE = os.environ.get("KVBATCH_START_DATE", "2026-01-01")
TIMEZONE = os.environ.get("KVBATCH_TIMEZONE", "UTC")
DATE_KEY = re.compile(r"^\d{4}-\d{2}-\d{2}$")

shard_partitions = dg.StaticPartitionsDefinition(shard_keys(MAX_SHARDS))
date_partitions = dg.DailyPartitionsDefinition(start_date=START_DATE, timezone=TIMEZONE, end_offset=1)
date_shard_partitions = dg.MultiPartitionsDefinition({"date": date_partitions, "shard": shard_partitions})

with warnings.catch_warnings():  # the mapping is marked beta; it is the documented way to say this
    warnings.simplefilter("ignore", category=dg.BetaWarning)
    # A (date, shard) partition reads the date partition of a date-only upstream (prompt_shards).
    shard_to_date = dg.MultiToSingleDimensionPartitionMapping(partition_dimension_name="date")


def date_shard_key(date: str, shard: str) -> dg.MultiPartitionKey:
    """The partition key of one shard of one day (its string form is ``"<date>|<shard>"``)."""
    return dg.MultiPartitionKey({"date": date, "shard": shard})


def date_shard_keys(date: str, num_shards: int) -> list[dg.MultiPartitionKey]:
    """The (date, shard) keys of a day of ``num_shards`` shards (0..num_shards-1), in shard order."""
    if not 1 <= num_shards <= MAX_SHARDS:
        raise ValueError(f"{date} has {num_shards} shards; the shard range has {MAX_SHARDS} ({MAX_SHARDS_ENV})")
    return [date_shard_key(check_date(date), s) for s in shard_keys(num_shards)]


def split_date_shard(key: str | dg.MultiPartitionKey) -> tuple[str, str]:
    """(date, shard) of a date x shard key, given as a ``MultiPartitionKey`` or its string."""
    if isinstance(key, dg.MultiPartitionKey):
        dims = key.keys_by_dimension
        return check_date(dims["date"]), dims["shard"]
    date, _, shard = str(key).partition("|")
    return check_date(date), shard


def check_date(date: str) -> str:
    """A date partition key, checked (it becomes a path component)."""
    if not DATE_KEY.match(date):
        raise ValueError(f"date partition key {date!r} is not YYYY-MM-DD")
    return date
