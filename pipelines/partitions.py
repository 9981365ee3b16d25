"""The partitions: date x shard.

- ``date`` (daily, ``KVBATCH_START_DATE`` onwards, days in ``KVBATCH_TIMEZONE``): the day a
  dataset belongs to. Nightly datasets have one per day; an ad-hoc dataset is given its URL in
  the run config and lands in the date partition it is launched for (see ``PromptsConfig``).
  Today's partition exists already (``end_offset=1``), so a file that lands today, or an ad-hoc
  run, can be processed at once.
- ``shard``: a fixed number of hash buckets of ``custom_id``. The count is fixed per deployment
  (``KVBATCH_NUM_SHARDS``, default 8) because a row's shard is ``sha256(custom_id) mod count``:
  changing it reshuffles every row, so it is a deployment setting read once at import.

``prompts`` and ``prompt_shards`` are partitioned by date only (one ingest and one tokenization
pass per dataset); ``prefill_kv``, ``decode_results`` and ``cost_metrics`` by date x shard, so a
failed (date, shard) re-runs alone. A multi-partition key joins the dimension values with ``|``
in dimension-name order: ``2026-11-29|0003`` (``dagster asset materialize --partition``).
"""

from __future__ import annotations

import os
import re
import warnings

import dagster as dg

from kvbatch.ops.shard_routing import shard_keys

NUM_SHARDS = int(os.environ.get("KVBATCH_NUM_SHARDS", "8"))
START_DATE = os.environ.get("KVBATCH_START_DATE", "2026-01-01")
TIMEZONE = os.environ.get("KVBATCH_TIMEZONE", "UTC")
DATE_KEY = re.compile(r"^\d{4}-\d{2}-\d{2}$")

shard_partitions = dg.StaticPartitionsDefinition(shard_keys(NUM_SHARDS))
date_partitions = dg.DailyPartitionsDefinition(start_date=START_DATE, timezone=TIMEZONE, end_offset=1)
date_shard_partitions = dg.MultiPartitionsDefinition({"date": date_partitions, "shard": shard_partitions})

with warnings.catch_warnings():  # the mapping is marked beta; it is the documented way to say this
    warnings.simplefilter("ignore", category=dg.BetaWarning)
    # A (date, shard) partition reads the date partition of a date-only upstream (prompt_shards).
    shard_to_date = dg.MultiToSingleDimensionPartitionMapping(partition_dimension_name="date")


def date_shard_key(date: str, shard: str) -> dg.MultiPartitionKey:
    """The partition key of one shard of one day (its string form is ``"<date>|<shard>"``)."""
    return dg.MultiPartitionKey({"date": date, "shard": shard})


def date_shard_keys(date: str) -> list[dg.MultiPartitionKey]:
    """Every (date, shard) key of one day, in shard order."""
    return [date_shard_key(date, s) for s in shard_partitions.get_partition_keys()]


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
