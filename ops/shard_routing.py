"""Which shard a row goes to: a stable hash of its ``custom_id``, and the shard partition keys.

Its own light module (hashlib only): the Dagster definitions need the shard keys at import, and
importing them from the shard builder loaded torch and the whole engine into every ``dagster``
command and every run worker process (~3 s each on a 2-vCPU machine).
"""

from __future__ import annotations

import hashlib


def shard_keys(num_shards: int) -> list[str]:
    """The shard partition keys: ``"0000"``, ``"0001"``... (zero-padded, so they sort)."""
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    return [f"{i:04d}" for i in range(num_shards)]


def shard_of(custom_id: str, num_shards: int) -> int:
    digest = hashlib.sha256(custom_id.encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(digest[:8], "big") % num_shards

