"""The kvbatch code location: ``dagster dev -w workspace.yaml`` or
``dagster asset materialize -m kvbatch.pipelines.definitions ...``.

It is the dg project of this repository (``[tool.dg]`` in pyproject.toml): every pipeline
declared under ``defs/`` (``defs/<folder>/defs.yaml``, ``type: kvbatch.BatchInference``; the
repository declares one, ``defs/demo``, named ``kvbatch``), plus the job ``kvbatch serve``'s
batches run as (``kvbatch_batch_api``) and the code location's executor.

Resources default from the environment, so one module serves a laptop and a deployment:

- shared by every pipeline (``factory.shared_resources``): ``KVBATCH_ROOT`` (the root of every
  table, default ``./kvbatch_data``; a pipeline's tables are under ``<root>/<name>``),
  ``KVBATCH_S3_ENDPOINT_URL``, ``KVBATCH_S3_REGION``, credentials from ``AWS_ACCESS_KEY_ID`` /
  ``AWS_SECRET_ACCESS_KEY`` (as Dagster ``EnvVar``\\ s: resolved at run time, never shown);
  ``KVBATCH_KV_URL`` (the shared KV store, default ``<root>/kv``);
- the demo pipeline's, through the templates of ``defs/demo/defs.yaml``: ``KVBATCH_MODEL``,
  ``KVBATCH_DTYPE``, ``KVBATCH_DECODE_LAUNCHER``, ``KVBATCH_DECODE_WORLD_SIZE``,
  ``KVBATCH_DECODE_IMAGE``;
- the batch API's model (``model``): ``KVBATCH_MODEL``, ``KVBATCH_DTYPE``;
- ``KVBATCH_EXECUTOR``: ``in_process`` (default: a run's steps in the run's process),
  ``multiprocess`` or ``k8s``, every step a Kubernetes Job (``k8s_job_executor``, the
  ``kvbatch[k8s]`` extra: see ``executor``);
- partitions: ``KVBATCH_MAX_SHARDS`` (the most shards a day may have, default 1024),
  ``KVBATCH_START_DATE``, ``KVBATCH_TIMEZONE`` (see ``partitions``); ``KVBATCH_MAX_ROWS_PER_SHARD``
  (default 10000), the default rows per shard. ``KVBATCH_NUM_SHARDS`` is refused.
Every value can still be overridden per launch under ``resources:`` in the run config.
"""

from __future__ import annotations

import os
from pathlib import Path

import dagster as dg

from kvbatch.pipelines.batch_api import batch_api_job
from kvbatch.pipelines.executor import executor_choice, executor_def
from kvbatch.pipelines.factory import default_spec, pipeline_resource_defs, resource_key, shared_resources
from kvbatch.resources import DecodeClusterResource, ModelResource


def project_root() -> Path:
    """The dg project holding this module: the repository (an editable install), else the working
    directory, where a deployment keeps the project's pyproject.toml (the Dockerfile's WORKDIR)."""
    here = Path(__file__).resolve().parents[1]
    return here if (here / "pyproject.toml").exists() else Path.cwd()


def default_resources() -> dict:
    """The resources of the code location's own pipeline (``defs/demo``, ``kvbatch``) by kind, as
    the environment gives them: ``object_store``, ``model``, ``kv_store``, ``pricing``,
    ``decode_cluster``, ``pipes_subprocess_client``. Key them for a pipeline with
    ``factory.pipeline_resources``."""
    # From the environment as it is now: not factory.default_pipeline(), which is built once per
    # process (a deployment's values read after a first build would be ignored).
    spec = default_spec()
    own = pipeline_resource_defs(spec)
    return {**shared_resources(),
            **{kind: own[resource_key(spec.name, kind, spec)] for kind in ("model", "pricing", "decode_cluster")}}


def _batch_api_resources() -> dict:
    # kvbatch serve's batches run on the server's model (KVBATCH_MODEL), not a pipeline's.
    return {"model": ModelResource(model=os.environ.get("KVBATCH_MODEL", "smollm2-135m"),
                                   dtype=os.environ.get("KVBATCH_DTYPE", "fp32"))}  # type: ignore[arg-type]


def load_definitions() -> dg.Definitions:
    """The project's pipelines (``defs/``), the batch API job and the executor."""
    pipelines = dg.load_from_defs_folder(path_within_project=project_root())
    return dg.Definitions.merge(pipelines, dg.Definitions(
        jobs=[batch_api_job], resources={**shared_resources(), **_batch_api_resources()},
        executor=executor_def(executor_choice())))  # None (multiprocess): Dagster's default executor


__all__ = ["DecodeClusterResource", "default_resources", "defs", "load_definitions", "project_root"]

defs = load_definitions()
