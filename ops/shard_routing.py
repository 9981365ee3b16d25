"""Which shard a row goes to: a stable hash of its ``custom_id``, and the shard partition keys.

Its own light module (hashlib only): the Dagster definitions need the shard keys at import, and
importing them from the shard builder loaded torch and the whole engine into every ``dagster``
command and every run worker process (~3 s each on a 2-vCPU machine).
"""

from __future__ import annotations

import hashlib

import numpy as np


def shard_keys(num_shards: int) -> list[str]:
    """The shard partition keys: ``"0000"``, ``"0001"``... (zero-padded, so they sort)."""
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    return [f"{i:04d}" for i in range(num_shards)]


def shard_of(custom_id: str, num_shards: int) -> int:
    digest = hashlib.sha256(custom_id.encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(digest[:8], "big") % num_shards



def shard_index(custom_ids: list[str], num_shards: int) -> np.ndarray:
    """:func:`shard_of` for a column of ids at once (int64 array). sha256 rather than a polars
    or Arrow hash: theirs may change between versions, and a row must keep its shard for good."""
    sha = hashlib.sha256
    return np.fromiter((int.from_bytes(sha(c.encode("utf-8", "surrogatepass")).digest()[:8], "big") % num_shards
                        for c in custom_ids), dtype=np.int64, count=len(custom_ids))


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
