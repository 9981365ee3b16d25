"""Which executor runs the steps of every job: one process per run (Dagster's in-process
executor, the default), Dagster's multiprocess executor, or on Kubernetes dagster-k8s's
``k8s_job_executor`` (each step its own Kubernetes Job).

``KVBATCH_EXECUTOR`` (read at import, like the partitions: a deployment setting) picks it:

- ``in_process`` (default): every step of a run in the run's own process, one after another. A
  shard run's steps are a chain (prefill -> decode -> cost), so separate step processes buy no
  parallelism (that comes from many shard runs at once); they cost a process start and a code
  location load per step (2-3 s each), and the decode step built its engine again after the
  prefill step had built the same one: 10-25 s a shard on a 2-vCPU machine
  (docs/pipeline.md#one-process-per-run). Runs stay isolated from each other: the run launcher
  starts each in a process of its own.
- ``multiprocess``: Dagster's default executor, each step a process of the run worker (a step that
  crashes the interpreter fails alone; retries of a step start a fresh process).
- ``k8s``: ``dagster_k8s.k8s_job_executor`` for every job of the code location. It needs the
  ``kvbatch[k8s]`` extra; without it the code location refuses to load, naming the extra. The
  executor is left unconfigured, so each run's ``execution: config:`` block (for instance
  ``deploy/run_config/decode_k8s.yaml``) configures it; :func:`k8s_execution_config` checks that
  block against the decode resource of the same run config before anything reaches a cluster.

The decode worker pods are a separate choice: ``decode_cluster.launcher: kubernetes`` (or
``KVBATCH_DECODE_LAUNCHER=kubernetes``) starts them through ``PipesK8sClient``
(:mod:`kvbatch.resources.decode_cluster`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import dagster as dg
from pydantic import BaseModel, ConfigDict, Field

from kvbatch.resources.kubernetes import require_dagster_k8s

EXECUTOR_ENV = "KVBATCH_EXECUTOR"
EXECUTORS = ("in_process", "multiprocess", "k8s")
DEFAULT_EXECUTOR = "in_process"


def executor_choice(env: Mapping[str, str] | None = None) -> str:
    """The executor ``KVBATCH_EXECUTOR`` names (default ``in_process``); a clear error otherwise."""
    value = (os.environ if env is None else env).get(EXECUTOR_ENV, DEFAULT_EXECUTOR).strip().lower() or DEFAULT_EXECUTOR
    if value not in EXECUTORS:
        raise ValueError(f"{EXECUTOR_ENV}={value!r} is not an executor kvbatch knows; use one of {list(EXECUTORS)}")
    return value


def executor_def(choice: str) -> dg.ExecutorDefinition | None:
    """The executor of every job for ``choice`` (None: Dagster's default, the multiprocess executor)."""
    if choice == "in_process":
        return dg.in_process_executor
    if choice == "multiprocess":
        return None
    if choice == "k8s":
        return require_dagster_k8s(f"{EXECUTOR_ENV}=k8s (the k8s_job_executor)").k8s_job_executor
    raise ValueError(f"unknown executor {choice!r}; use one of {list(EXECUTORS)}")


class K8sExecutionConfig(BaseModel):
    """The ``execution: config:`` block kvbatch's Kubernetes run config gives ``k8s_job_executor``.

    The fields kvbatch relies on are checked here; the executor's other options (``job_image``,
    ``image_pull_policy``, ``service_account_name``, ``volumes``, ...) pass through unchanged and
    are validated by Dagster when the run is launched."""

    model_config = ConfigDict(extra="allow")

    job_namespace: str = Field(min_length=1, description="namespace of the step Jobs")
    max_concurrent: int | None = Field(default=None, ge=1, description="step pods of one run at once")
    env_secrets: list[str] = Field(default_factory=list, description="Secrets whose keys become env vars")
    step_k8s_config: dict[str, Any] = Field(default_factory=dict, description="container/pod config of each step")


def k8s_execution_config(run_config: Mapping[str, Any]) -> dict[str, Any]:
    """The executor config a run with ``run_config`` passes to ``k8s_job_executor``, checked against
    the same run config's ``decode_cluster``: the steps run in the decode pods' namespace and get
    the object-store Secret the pods get (credentials never travel in the config itself)."""
    from kvbatch.resources import DecodeClusterResource

    execution = (run_config.get("execution") or {}).get("config")
    if execution is None:
        raise ValueError("run config has no execution.config block for the k8s_job_executor")
    config = K8sExecutionConfig.model_validate(execution)
    resources = run_config.get("resources") or {}
    # A pipeline's decode group is ``<name>_decode_cluster`` (pipelines/factory.py); each is checked.
    for key in sorted(k for k in resources if k == "decode_cluster" or k.endswith("_decode_cluster")):
        cluster_config = (resources[key] or {}).get("config")
        if cluster_config is None:
            continue
        cluster = DecodeClusterResource(**cluster_config)
        if cluster.launcher == "kubernetes" and cluster.namespace != config.job_namespace:
            raise ValueError(f"execution.config.job_namespace {config.job_namespace!r} differs from "
                             f"{key}.namespace {cluster.namespace!r}: steps and decode pods share one")
        if cluster.secret_env and cluster.secret_env not in config.env_secrets:
            raise ValueError(f"execution.config.env_secrets {config.env_secrets} lacks {key}.secret_env "
                             f"{cluster.secret_env!r}: the step pods could not reach the object store")
    return config.model_dump(exclude_none=True)
