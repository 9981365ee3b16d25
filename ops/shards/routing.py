"""Which shard a row goes to: a stable hash of its ``custom_id``, the shard partition keys, and
how many shards a date gets (its :class:`ShardCount`, written beside its shards).

Its own light module (hashlib and numpy; the count file's reader and writer import pyarrow and
fsspec only when called): the Dagster definitions need the shard keys at import, and
importing them from the shard builder loaded torch and the whole engine into every ``dagster``
command and every run worker process (~3 s each on a 2-vCPU machine).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

import numpy as np


# Shard keys are four digits ("0000".."9999"), so they sort as numbers; a range holds at most this many.
MAX_SHARD_KEYS = 10_000


def shard_keys(num_shards: int) -> list[str]:
    """The shard partition keys: ``"0000"``, ``"0001"``... (zero-padded, so they sort)."""
    if not 1 <= num_shards <= MAX_SHARD_KEYS:
        raise ValueError(f"num_shards must be 1..{MAX_SHARD_KEYS}, got {num_shards}")
    return [f"{i:04d}" for i in range(num_shards)]


def shard_of(custom_id: str, num_shards: int) -> int:
    digest = hashlib.sha256(custom_id.encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(digest[:8], "big") % num_shards


def shard_index(custom_ids: list[str], num_shards: int) -> np.ndarray:
    """:func:`shard_of` for a column of ids at once (int64 array). sha256 rather than a polars
    or Arrow hash: theirs may change between versions, and a row must keep its shard for good.
    The digests are joined and their first 8 bytes read by numpy as big-endian uint64, so the
    per-row Python is one hash call (the modulo and the byte order run a column at a time)."""
    if not custom_ids:
        return np.zeros(0, dtype=np.int64)
    sha = hashlib.sha256
    digests = b"".join([sha(c.encode("utf-8", "surrogatepass")).digest() for c in custom_ids])
    heads = np.frombuffer(digests, dtype=">u8").reshape(len(custom_ids), 4)[:, 0]
    return (heads % np.uint64(num_shards)).astype(np.int64)


# Rows per shard when a date's shard count follows its data: a shard a decode group finishes in
# minutes, and 1,000 shards for a night of ten million prompts.
DEFAULT_MAX_ROWS_PER_SHARD = 10_000


def shards_for_rows(rows: int, max_rows_per_shard: int = DEFAULT_MAX_ROWS_PER_SHARD,
                    max_shards: int | None = None) -> int:
    """How many shards ``rows`` rows get: ceil(rows / max_rows_per_shard), at least one (an empty
    day still has a shard, so its tables exist). Hash routing spreads rows evenly on average, so
    a shard holds about ``max_rows_per_shard`` rows or fewer, not exactly at most that many.
    More than ``max_shards`` (the width of a fixed shard range) is an error naming both."""
    if max_rows_per_shard < 1:
        raise ValueError(f"max_rows_per_shard must be >= 1, got {max_rows_per_shard}")
    count = max(1, -(-rows // max_rows_per_shard))
    if max_shards is not None and count > max_shards:
        raise ValueError(f"{rows} rows at max_rows_per_shard={max_rows_per_shard} need {count} shards, more than "
                         f"the {max_shards} the shard range has; raise max_rows_per_shard or the range")
    return count


# Where ``prompt_shards`` writes a date's shard count: beside the shard folders, a name no dataset
# reader takes for data (hive readers skip ``_`` files; ``read_shards`` reads only ``shard=`` folders).
SHARD_COUNT_FILE = "_shard_count.json"


@dataclass(frozen=True)
class ShardCount:
    """How many shards a date got and from what: ``num_shards`` = :func:`shards_for_rows` of
    ``rows`` (the valid prompts) at ``max_rows_per_shard``, within a range of ``max_shards`` keys."""

    date: str
    num_shards: int
    rows: int
    max_rows_per_shard: int
    max_shards: int

    def has(self, shard: str) -> bool:
        """Whether shard key ``shard`` ("0003") is one of this date's shards (0..num_shards-1)."""
        return int(shard) < self.num_shards


def write_shard_count(count: ShardCount, url: str, *, storage_options: Mapping[str, Any] | None = None) -> None:
    """``count`` as JSON at ``url``, committed atomically (a reader sees the old count or the new)."""
    from kvbatch.io.shard_tables import write_json  # pyarrow and fsspec: not for every importer of the keys

    write_json(asdict(count), url, storage_options=storage_options)


def read_shard_count(url: str, *, storage_options: Mapping[str, Any] | None = None) -> ShardCount | None:
    """The shard count written at ``url``, or None when there is none (prompt_shards not run yet)."""
    from kvbatch.io.shard_tables import read_json

    try:
        doc = read_json(url, storage_options=storage_options)
    except FileNotFoundError:
        return None
    return ShardCount(**{f.name: doc[f.name] for f in fields(ShardCount)})
