"""Jobs, the nightly schedule and the sensors.

- ``kvbatch_ingest``: prompts + prompt_shards (unpartitioned; needs the ``prompts`` run config).
- ``kvbatch_prefill``: prefill_kv, per shard.  ``kvbatch_decode``: decode_results + cost_metrics, per shard.
- ``kvbatch_shard``: prefill + decode + metrics of one shard (what a failed shard re-runs).
- ``kvbatch_all``: the whole graph; launched for shard K it ingests, then runs shard K.
- ``nightly_ingest`` (02:00, timezone from ``KVBATCH_TIMEZONE``, STOPPED until turned on) runs
  ``kvbatch_ingest`` on ``KVBATCH_NIGHTLY_DATASET``; ``shards_after_ingest`` then requests one
  ``kvbatch_shard`` run per shard, so shards run in parallel and fail and retry alone.
- ``new_dataset_files`` (STOPPED) ingests each new file under ``KVBATCH_INPUT_PREFIX``.
"""

from __future__ import annotations

import json
import os

import dagster as dg

from kvbatch.pipelines.assets import cost_metrics, decode_results, prefill_kv, prompt_shards, prompts
from kvbatch.pipelines.partitions import shard_partitions

ingest_job = dg.define_asset_job("kvbatch_ingest", selection=[prompts, prompt_shards],
                                 description="Validate the dataset and tokenize it into shards.")
prefill_job = dg.define_asset_job("kvbatch_prefill", selection=[prefill_kv],
                                  description="Prefill one shard into the KV store.")
decode_job = dg.define_asset_job("kvbatch_decode", selection=[decode_results, cost_metrics],
                                 description="Decode one shard from the stored KV and meter it.")
shard_job = dg.define_asset_job("kvbatch_shard", selection=[prefill_kv, decode_results, cost_metrics],
                                description="Prefill, decode and meter one shard.")
all_job = dg.define_asset_job("kvbatch_all", selection=dg.AssetSelection.all(),
                              description="The whole graph: ingest, then one shard.")

JOBS = [ingest_job, prefill_job, decode_job, shard_job, all_job]


def prompts_run_config(url: str) -> dict:
    return {"ops": {"prompts": {"config": {"url": url}}}}


@dg.schedule(job=ingest_job, cron_schedule="0 2 * * *",
             execution_timezone=os.environ.get("KVBATCH_TIMEZONE", "UTC"),
             default_status=dg.DefaultScheduleStatus.STOPPED)
def nightly_ingest(context: dg.ScheduleEvaluationContext):
    """Every night at 02:00: ingest ``KVBATCH_NIGHTLY_DATASET`` (``{date}`` becomes the run's date)."""
    template = os.environ.get("KVBATCH_NIGHTLY_DATASET")
    if not template:
        return dg.SkipReason("KVBATCH_NIGHTLY_DATASET is not set")
    date = context.scheduled_execution_time.strftime("%Y-%m-%d")
    return dg.RunRequest(run_key=f"nightly-{date}", run_config=prompts_run_config(template.format(date=date)),
                         tags={"kvbatch/date": date})


@dg.run_status_sensor(run_status=dg.DagsterRunStatus.SUCCESS, monitored_jobs=[ingest_job], request_job=shard_job,
                      default_status=dg.DefaultSensorStatus.RUNNING)
def shards_after_ingest(context: dg.RunStatusSensorContext):
    """After a successful ingest, one ``kvbatch_shard`` run per shard partition."""
    run_id = context.dagster_run.run_id
    return [dg.RunRequest(run_key=f"{run_id}-{key}", partition_key=key, tags={"kvbatch/ingest_run": run_id})
            for key in shard_partitions.get_partition_keys()]


@dg.sensor(job=ingest_job, minimum_interval_seconds=300, default_status=dg.DefaultSensorStatus.STOPPED)
def new_dataset_files(context: dg.SensorEvaluationContext):
    """Ingest each new (or changed) ``.jsonl``/``.jsonl.gz``/``.parquet`` file under
    ``KVBATCH_INPUT_PREFIX``. The cursor holds the files seen; the run key is path + version,
    so a re-evaluation never launches a file twice."""
    prefix = os.environ.get("KVBATCH_INPUT_PREFIX")
    if not prefix:
        return dg.SkipReason("KVBATCH_INPUT_PREFIX is not set")
    return new_file_requests(prefix, context.cursor, storage_options=_input_options(prefix))


def _input_options(prefix: str) -> dict:
    if prefix.startswith(("s3://", "s3a://")) and os.environ.get("KVBATCH_S3_ENDPOINT_URL"):
        return {"endpoint_url": os.environ["KVBATCH_S3_ENDPOINT_URL"]}
    return {}


def new_file_requests(prefix: str, cursor: str | None, storage_options: dict | None = None) -> dg.SensorResult:
    import fsspec

    fs, base = fsspec.core.url_to_fs(prefix, **(storage_options or {}))
    seen: dict[str, str] = json.loads(cursor) if cursor else {}
    protocol = prefix.split("://", 1)[0] + "://" if "://" in prefix else ""
    requests = []
    for path, info in sorted(fs.find(base, detail=True).items()):
        if not path.endswith((".jsonl", ".jsonl.gz", ".parquet")):
            continue
        version = str(info.get("ETag") or info.get("etag") or f"{info.get('mtime')}-{info.get('size')}")
        if seen.get(path) == version:
            continue
        seen[path] = version
        url = protocol + path if protocol else path
        requests.append(dg.RunRequest(run_key=f"{path}@{version}", run_config=prompts_run_config(url)))
    return dg.SensorResult(run_requests=requests, cursor=json.dumps(seen, sort_keys=True))
