"""The partitions: a day, and the shards of that day.

- ``date`` (daily, ``KVBATCH_START_DATE`` onwards, days in ``KVBATCH_TIMEZONE``): the day a
  dataset belongs to, shared by every pipeline. Nightly datasets have one per day; an ad-hoc
  dataset is given its URL in the run config and lands in the date partition it is launched for
  (see ``PromptsConfig``). Today's partition exists already (``end_offset=1``), so a file that
  lands today, or an ad-hoc run, can be processed at once.
- ``<name>_shards``: one :class:`~dagster.DynamicPartitionsDefinition` per pipeline whose keys are
  ``"<date>|<shard>"`` (``2026-12-06|0003``), and only the shards a day has: ``prompt_shards``
  chooses n = ceil(valid rows / max_rows_per_shard), adds that day's n keys and deletes the keys
  of a day's shards >= n that an earlier run of the day added. So a finished day is every key it
  has (100 %), and nothing targets keys no data fills.

Why one dynamic dimension that holds the date, rather than ``date x shard``: a multi-partition
is the cross product of its dimensions, so with a day of 4 shards and another of 10, the first
would show 6 "missing" shards, whatever the shard dimension's keys are (static or dynamic). A key
that names its day exists only for the shards that day has. The string form is the one a
``date x shard`` multi-partition had, so ``dagster asset materialize --partition "2026-11-29|0003"``
reads as before (the key must exist in the instance: ``DAGSTER_HOME`` the ingest ran in).

Dagster has no built-in partition mapping from such a key to the day it names (a custom mapping
is deprecated and not shown in the UI), so the per-shard assets depend on the date-partitioned
ones with :class:`~dagster.AllPartitionMapping`; each step reads its day from its own key.

``KVBATCH_MAX_SHARDS`` (default 1024, at most 10,000: four-digit shard keys) caps n, so a wrong
``max_rows_per_shard`` cannot add a million keys; ``KVBATCH_NUM_SHARDS`` (the old fixed count) is
refused at import.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

import dagster as dg

from kvbatch.ops.shards.routing import MAX_SHARD_KEYS, shard_keys

MAX_SHARDS_ENV, OLD_NUM_SHARDS_ENV = "KVBATCH_MAX_SHARDS", "KVBATCH_NUM_SHARDS"
DEFAULT_MAX_SHARDS = 1024
KEY_SEPARATOR = "|"


def max_shards_from_env(environ: Mapping[str, str]) -> int:
    """The most shards a day may have (``KVBATCH_MAX_SHARDS``, default 1024). ``KVBATCH_NUM_SHARDS``
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
SHARD_KEY = re.compile(r"^\d{4}$")

date_partitions = dg.DailyPartitionsDefinition(start_date=START_DATE, timezone=TIMEZONE, end_offset=1)
# A per-shard asset depends on every partition of its date-partitioned neighbours (module docstring).
shard_to_date = dg.AllPartitionMapping()


def shard_partitions_name(pipeline: str) -> str:
    """The name of a pipeline's dynamic shard partitions (its keys live in the instance under it)."""
    return f"{pipeline}_shards"


def shard_partitions(pipeline: str) -> dg.DynamicPartitionsDefinition:
    """The (date, shard) partitions of one pipeline: keys ``"<date>|<shard>"``, added per day."""
    return dg.DynamicPartitionsDefinition(name=shard_partitions_name(pipeline))


def date_shard_key(date: str, shard: str) -> str:
    """The partition key of one shard of one day: ``"<date>|<shard>"``."""
    if not SHARD_KEY.match(shard):
        raise ValueError(f"shard key {shard!r} is not four digits")
    return f"{check_date(date)}{KEY_SEPARATOR}{shard}"


def date_shard_keys(date: str, num_shards: int) -> list[str]:
    """The (date, shard) keys of a day of ``num_shards`` shards (0..num_shards-1), in shard order."""
    if not 1 <= num_shards <= MAX_SHARDS:
        raise ValueError(f"{date} has {num_shards} shards; at most {MAX_SHARDS} are allowed ({MAX_SHARDS_ENV})")
    return [date_shard_key(date, s) for s in shard_keys(num_shards)]


def split_date_shard(key: str) -> tuple[str, str]:
    """(date, shard) of a (date, shard) key, checked (both become path components)."""
    date, sep, shard = str(key).partition(KEY_SEPARATOR)
    if not sep or not SHARD_KEY.match(shard):
        raise ValueError(f"partition key {key!r} is not '<YYYY-MM-DD>|<four-digit shard>'")
    return check_date(date), shard


def check_date(date: str) -> str:
    """A date partition key, checked (it becomes a path component)."""
    if not DATE_KEY.match(date):
        raise ValueError(f"date partition key {date!r} is not YYYY-MM-DD")
    return date


def register_day_shards(instance: dg.DagsterInstance, pipeline: str, date: str, num_shards: int) -> list[str]:
    """Make the instance's shard keys of ``date`` exactly its ``num_shards`` shards: add the missing
    ones, delete those of shards >= ``num_shards`` (an earlier, larger sharding of the day). Other
    days' keys are untouched. Returns the keys deleted."""
    name = shard_partitions_name(pipeline)
    want = date_shard_keys(date, num_shards)
    prefix = check_date(date) + KEY_SEPARATOR
    have = [k for k in instance.get_dynamic_partitions(name) if k.startswith(prefix)]
    missing = [k for k in want if k not in set(have)]
    if missing:
        instance.add_dynamic_partitions(name, missing)
    stale = sorted(set(have) - set(want))
    for key in stale:
        instance.delete_dynamic_partition(name, key)
    return stale
