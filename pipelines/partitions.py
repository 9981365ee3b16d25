"""The shard partitions: a fixed number of hash buckets of ``custom_id``.

The count is fixed per deployment (``KVBATCH_NUM_SHARDS``, default 8) because a row's shard is
``sha256(custom_id) mod count``: changing it reshuffles every row, so it is a deployment
setting, read once at import, not a run setting.
"""

from __future__ import annotations

import os

import dagster as dg

from kvbatch.ops.shards import shard_keys

NUM_SHARDS = int(os.environ.get("KVBATCH_NUM_SHARDS", "8"))
shard_partitions = dg.StaticPartitionsDefinition(shard_keys(NUM_SHARDS))
