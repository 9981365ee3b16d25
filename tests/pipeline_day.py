"""One day of the default pipeline on a tiny model, ingested, sharded and prefilled in process,
for tests that then materialize ``decode_results`` themselves (as often as they need)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

SHARD = "0000"


@dataclass
class PreparedDay:
    resources: dict[str, Any]
    instance: Any  # the DagsterInstance that knows the day's (date, shard) partitions
    key: str  # the (date, shard 0000) partition key


def prepared_day(root: Path, model: Path, data: Path, date: str, *, spec: str | None = None,
                 response_cache: str | None = None, decode_cluster: Any = None) -> PreparedDay:
    """``data`` (a batch JSONL) through prompts, prompt_shards and prefill_kv of the default
    pipeline under ``root``, with ``model`` at max_batch 8 and no KV memory tier; ``decode_cluster``
    (a DecodeClusterResource) launches the decode, in process by default."""
    import dagster as dg

    from kvbatch.pipelines import default
    from kvbatch.pipelines.default import prefill_kv, prompt_shards, prompts
    from kvbatch.pipelines.partitions import date_shard_key
    from kvbatch.resources import (
        DecodeClusterResource,
        KVStoreResource,
        ModelResource,
        ObjectStoreResource,
        PricingResource,
    )

    resources = default.resources({
        "object_store": ObjectStoreResource(url=str(root)),
        "model": ModelResource(model=str(model), max_batch=8, spec=spec),
        "kv_store": KVStoreResource(memory_gb=0, response_cache=response_cache),
        "pricing": PricingResource(),
        "decode_cluster": decode_cluster or DecodeClusterResource(),
        "pipes_subprocess_client": dg.PipesSubprocessClient(),
    })
    # One instance: ingest adds the day's (date, shard) keys the shard runs then use.
    instance = dg.DagsterInstance.ephemeral()
    config = {"ops": {prompts.op.name: {"config": {"url": str(data)}}}}
    assert dg.materialize([prompts, prompt_shards], resources=resources, partition_key=date, run_config=config,
                          instance=instance).success
    key = date_shard_key(date, SHARD)
    assert dg.materialize([prefill_kv], resources=resources, partition_key=key, selection=[prefill_kv],
                          instance=instance).success
    return PreparedDay(resources, instance, key)


def decode_metadata(day: PreparedDay) -> dict[str, Any]:
    """Materialize the day's ``decode_results``; its materialization's metadata values."""
    import dagster as dg

    from kvbatch.pipelines.default import decode_results

    res = dg.materialize([decode_results], resources=day.resources, partition_key=day.key,
                         selection=[decode_results], instance=day.instance)
    assert res.success
    return {k: v.value for k, v in res.asset_materializations_for_node(decode_results.op.name)[0].metadata.items()}
