"""The code location's own pipeline, ``kvbatch`` (``defs/demo/defs.yaml``; in Python,
``factory.default_spec``), as module-level names: its assets, jobs, schedule and sensors, for
scripts and tests that materialize or call them directly.

    from kvbatch.pipelines.default import prompts, prompt_shards, shards_after_ingest

Built once per process (``factory.default_pipeline``) when this module is first imported. Its
resources are keyed for the ``kvbatch`` pipeline: key a dict of them by kind with
``factory.pipeline_resources(PIPELINE.spec, {...})``.
"""

from __future__ import annotations

from kvbatch.pipelines.factory import default_pipeline, pipeline_resources

PIPELINE = default_pipeline()

prompts = PIPELINE.assets["prompts"]
prompt_shards = PIPELINE.assets["prompt_shards"]
prefill_kv = PIPELINE.assets["prefill_kv"]
decode_results = PIPELINE.assets["decode_results"]
cost_metrics = PIPELINE.assets["cost_metrics"]
cost_rollup = PIPELINE.assets["cost_rollup"]
ASSETS = [prompts, prompt_shards, prefill_kv, decode_results, cost_metrics]
ROLLUP_ASSETS = [cost_rollup]

ingest_job = PIPELINE.job("ingest")
prefill_job = PIPELINE.job("prefill")
decode_job = PIPELINE.job("decode")
shard_job = PIPELINE.job("shard")
rollup_job = PIPELINE.job("rollup")
JOBS = [ingest_job, prefill_job, decode_job, shard_job, rollup_job]

_name = PIPELINE.spec.name
nightly_ingest = PIPELINE.schedules[f"{_name}_nightly_ingest"]
shards_after_ingest = PIPELINE.sensors[f"{_name}_shards_after_ingest"]
rollup_after_shard = PIPELINE.sensors[f"{_name}_rollup_after_shard"]
rollup_after_failed_shard = PIPELINE.sensors[f"{_name}_rollup_after_failed_shard"]
new_dataset_files = PIPELINE.sensors[f"{_name}_new_dataset_files"]


def resources(by_kind: dict) -> dict:
    """``by_kind`` (``{"object_store": ..., "model": ...}``) keyed as this pipeline's steps find them."""
    return pipeline_resources(PIPELINE.spec, by_kind)
