"""Which asset checks block, and why (``AssetCheckSpec(blocking=True)``).

A blocking check that fails with severity ERROR fails its step after the asset's events are
recorded (Dagster 1.13: ``DagsterAssetCheckFailedError``, not retried), so the run shows red and
nothing downstream of that asset runs in it. A check with severity WARN never fails a step,
blocking or not. The policy:

- ``prompts``: ``reject_rate_below_threshold`` and ``unique_custom_ids`` block: no shard is
  tokenized, prefilled or decoded from a table with repeated ids or too many rejects.
- ``decode_results``: ``one_result_per_custom_id`` and ``output_within_max_tokens`` block: a
  shard with missing, repeated or over-long results is not costed (its ``cost_metrics`` does not
  run), so the day's scorecard lists it under the shards that need a look instead of counting
  it as done, and the shard's run is red.
- ``cost_rollup``: ``latency_p95_within_slo`` blocks: nothing is downstream of the day, so
  blocking only makes the run fail when the SLO severity is ERROR (``KVBATCH_SLO_SEVERITY`` or
  the run config); the day's table and scorecard are written first.
- ``cost_metrics``: ``latency_p95_within_slo`` warns only (never blocks): a slow shard is a fact
  about latency, not bad data, and the day's rollup must still count it.
"""

from __future__ import annotations

# (asset name, check name): the asset's last key component, so a pipeline's key prefix does not matter.
BLOCKING = frozenset({
    ("prompts", "reject_rate_below_threshold"),
    ("prompts", "unique_custom_ids"),
    ("decode_results", "one_result_per_custom_id"),
    ("decode_results", "output_within_max_tokens"),
    ("cost_rollup", "latency_p95_within_slo"),
})


def blocks(asset: str, check: str) -> bool:
    """Whether ``check`` of ``asset`` (a name or a ``/``-joined key) is blocking."""
    return (asset.rsplit("/", 1)[-1], check) in BLOCKING
