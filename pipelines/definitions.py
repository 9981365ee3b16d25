"""The kvbatch code location: ``dagster dev -w workspace.yaml`` or
``dagster asset materialize -m kvbatch.pipelines.definitions ...``.

Resources default from the environment, so one module serves a laptop and a deployment:

- ``KVBATCH_ROOT``: root of every table (default: ``./kvbatch_data`` under the working directory);
- ``KVBATCH_S3_ENDPOINT_URL``, ``KVBATCH_S3_REGION``; credentials from ``AWS_ACCESS_KEY_ID`` /
  ``AWS_SECRET_ACCESS_KEY`` (as Dagster ``EnvVar``\\ s: resolved at run time, never shown);
- ``KVBATCH_MODEL``, ``KVBATCH_DTYPE``; ``KVBATCH_KV_URL`` (default ``<root>/kv``);
- ``KVBATCH_DECODE_LAUNCHER``, ``KVBATCH_DECODE_WORLD_SIZE`` and ``KVBATCH_DECODE_IMAGE`` (the decode
  worker group; the image is the pods' with ``launcher=kubernetes``);
- ``KVBATCH_EXECUTOR``: ``multiprocess`` (default) or ``k8s``, every step a Kubernetes Job
  (``k8s_job_executor``, the ``kvbatch[k8s]`` extra: see ``executor``);
- partitions: ``KVBATCH_MAX_SHARDS`` (the shard keys, default 1024), ``KVBATCH_START_DATE``,
  ``KVBATCH_TIMEZONE`` (see ``partitions``); ``KVBATCH_MAX_ROWS_PER_SHARD`` (default 10000), the
  default of ``prompt_shards``' ``max_rows_per_shard``: a date gets ceil(rows / it) shards.
  ``KVBATCH_NUM_SHARDS`` is refused (the count follows the data now).
Every value can still be overridden per launch under ``resources:`` in the run config.
"""

from __future__ import annotations

import os

import dagster as dg

from kvbatch.pipelines.assets import ASSETS
from kvbatch.pipelines.automation import (
    JOBS,
    new_dataset_files,
    nightly_ingest,
    rollup_after_shard,
    shards_after_ingest,
)
from kvbatch.pipelines.batch_api import batch_api_job
from kvbatch.pipelines.executor import executor_choice, executor_def
from kvbatch.pipelines.rollup import ROLLUP_ASSETS
from kvbatch.resources import (
    DecodeClusterResource,
    KVStoreResource,
    ModelResource,
    ObjectStoreResource,
    PricingResource,
)


def _env_secret(name: str):
    return dg.EnvVar(name) if os.environ.get(name) else None


def default_resources() -> dict:
    return {
        "object_store": ObjectStoreResource(
            url=os.environ.get("KVBATCH_ROOT", os.path.abspath("kvbatch_data")),
            endpoint_url=os.environ.get("KVBATCH_S3_ENDPOINT_URL"),
            region=os.environ.get("KVBATCH_S3_REGION"),
            access_key_id=_env_secret("AWS_ACCESS_KEY_ID"),
            secret_access_key=_env_secret("AWS_SECRET_ACCESS_KEY"),
        ),
        "model": ModelResource(model=os.environ.get("KVBATCH_MODEL", "smollm2-135m"),
                               dtype=os.environ.get("KVBATCH_DTYPE", "fp32")),
        "kv_store": KVStoreResource(url=os.environ.get("KVBATCH_KV_URL")),
        "pricing": PricingResource(),
        "decode_cluster": DecodeClusterResource(launcher=os.environ.get("KVBATCH_DECODE_LAUNCHER", "in_process"),
                                                world_size=int(os.environ.get("KVBATCH_DECODE_WORLD_SIZE", "1")),
                                                image=os.environ.get("KVBATCH_DECODE_IMAGE")),
        "pipes_subprocess_client": dg.PipesSubprocessClient(),
    }


defs = dg.Definitions(
    assets=[*ASSETS, *ROLLUP_ASSETS],
    jobs=[*JOBS, batch_api_job],
    schedules=[nightly_ingest],
    sensors=[shards_after_ingest, rollup_after_shard, new_dataset_files],
    resources=default_resources(),
    executor=executor_def(executor_choice()),  # None: Dagster's multiprocess executor
)
