"""How decode runs: in the run's process, or as a worker group launched through Dagster Pipes.

Launchers (``launcher``):

- ``in_process`` (default): the run's own process, ``world_size`` 1.
- ``pipes_subprocess``: ``python -m kvbatch.ops.decode.worker`` through ``PipesSubprocessClient``,
  ``world_size`` 1.
- ``local``: ``world_size`` ranks on this machine, started by torchrun in standalone mode
  (``python -m torch.distributed.run --standalone --nproc-per-node W -m kvbatch.ops.decode.worker``),
  through ``PipesSubprocessClient``. ``gloo`` on CPU, ``nccl`` on GPUs (``backend``).
- ``torchrun``: the same entry point under torchrun with an explicit rendezvous
  (``master_addr``/``master_port``, ``nnodes``/``node_rank``) for groups that span machines, or
  ``rendezvous="c10d"``: every machine runs the same command and torchrun's c10d store at
  ``master_addr:master_port`` numbers the ranks.

Every rank also gets ``checkpoint_rows`` (it commits a part file every N results; a re-run
resumes from them), ``eplb_interval``/``eplb_window`` (live EPLB) and ``redundant_experts``.
- ``kubernetes``: one pod per decode group, built by :meth:`DecodeClusterResource.pod_spec`
  (``nvidia.com/gpu`` requests, the torchrun command, ``MASTER_ADDR``/``MASTER_PORT``/``WORLD_SIZE``),
  launched with ``dagster_k8s.PipesK8sClient`` (the ``kvbatch[k8s]`` extra: :mod:`kvbatch.resources.kubernetes`).

Every rank runs the same torchrun-compatible entry point (it reads ``RANK``/``WORLD_SIZE``), the
worker's ``shard`` command (:meth:`DecodeClusterResource.run` sets ``"command": "shard"`` in the spec);
rank 0 opens Dagster Pipes and reports the materialization. Terminating the run sends SIGINT to
the launcher, and torchrun stops its workers (SIGTERM, then SIGKILL); the Kubernetes client
deletes the pod.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping
from typing import Any, Literal

import dagster as dg
from pydantic import Field, model_validator

WORKER_MODULE = "kvbatch.ops.decode.worker"
GPU_RESOURCE = "nvidia.com/gpu"
Launcher = Literal["in_process", "pipes_subprocess", "local", "torchrun", "kubernetes"]


class DecodeClusterResource(dg.ConfigurableResource):
    """Where and how wide decode runs (``world_size`` ranks), and how the workers are started."""

    launcher: Launcher = Field(default="in_process", description=(
        "in_process | pipes_subprocess (world 1) | local (torchrun --standalone) | torchrun | kubernetes"))
    world_size: int = Field(default=1, ge=1, description="decode ranks in the group")
    backend: Literal["auto", "gloo", "nccl"] = Field(default="auto", description="auto: nccl when the ranks "
                                                     "compute on CUDA, else gloo")
    device: str = Field(default="auto", description="where the ranks compute: auto (CUDA when the worker has "
                        "it), cpu, cuda (each rank its LOCAL_RANK GPU); overrides the model's device in the workers")
    master_addr: str = Field(default="127.0.0.1", description="torchrun/kubernetes rendezvous host")
    master_port: int = Field(default=29500, ge=1, le=65535, description="torchrun/kubernetes rendezvous port")
    nnodes: int = Field(default=1, ge=1, description="torchrun: machines in the group (world_size divisible by it)")
    node_rank: int = Field(default=0, ge=0, description="torchrun: this machine's rank (static rendezvous)")
    rendezvous: Literal["static", "c10d"] = Field(default="static", description=(
        "torchrun: static (master_addr/port, node_rank per machine) or c10d (every machine runs the same "
        "command; torchrun's c10d store at master_addr:master_port assigns the ranks)"))
    rdzv_id: str = Field(default="kvbatch-decode", description="torchrun c10d: the group's rendezvous id")
    # What the ranks do (passed to every worker in its spec)
    checkpoint_rows: int = Field(default=256, ge=1, description=(
        "each rank commits its results as a part file every N results; a re-run resumes from them"))
    eplb_interval: int = Field(default=0, ge=0, description=(
        "MoE on a group: rebalance the experts over the ranks every N decode steps from the observed "
        "loads (live EPLB; 0: never), as `kvbatch decode --eplb-interval`"))
    eplb_window: int | None = Field(default=None, ge=1, description="live EPLB: steps of load history "
                                    "(default: the interval)")
    redundant_experts: int = Field(default=0, ge=0, description=(
        "MoE on a group: extra expert slots for replicas of hot experts (experts + R must divide by "
        "world_size), as `kvbatch decode --redundant-experts`"))
    # Kubernetes (launcher=kubernetes)
    image: str | None = Field(default=None, description="kubernetes: container image with kvbatch installed")
    namespace: str = Field(default="default", description="kubernetes namespace")
    gpus_per_rank: int = Field(default=1, ge=0, description="kubernetes: nvidia.com/gpu per rank (0: CPU pod)")
    cpu: str = Field(default="4", description="kubernetes: CPU request of the pod")
    memory: str = Field(default="32Gi", description="kubernetes: memory request of the pod")
    service_account: str | None = Field(default=None, description="kubernetes: service account (object store access)")
    secret_env: str | None = Field(default=None, description="kubernetes: Secret whose keys become env vars "
                                   "(credentials go here, never into the pod spec)")
    node_selector: dict[str, str] = Field(default_factory=dict, description="kubernetes: node selector")

    @model_validator(mode="after")
    def _check(self) -> "DecodeClusterResource":
        from kvbatch.engine.runtime.engine_config import parse_device_spec

        kind, index = parse_device_spec(self.device)
        if index is not None and self.world_size > 1:
            raise ValueError(f"device {self.device!r} names one GPU; a group of {self.world_size} ranks takes "
                             "one GPU per rank (LOCAL_RANK): use device 'cuda'")
        if self.backend == "nccl" and kind == "cpu":
            raise ValueError("backend 'nccl' moves CUDA tensors only: device 'cpu' needs backend 'gloo' or 'auto'")
        if self.launcher in ("in_process", "pipes_subprocess") and self.world_size != 1:
            raise ValueError(f"world_size={self.world_size} needs launcher 'local', 'torchrun' or 'kubernetes' "
                             f"({self.launcher!r} runs one process)")
        if self.world_size % self.nnodes:
            raise ValueError(f"world_size={self.world_size} is not divisible by nnodes={self.nnodes}")
        if self.node_rank >= self.nnodes:
            raise ValueError(f"node_rank={self.node_rank} must be < nnodes={self.nnodes}")
        if self.launcher == "kubernetes" and not self.image:
            raise ValueError("launcher 'kubernetes' needs an image (a container with kvbatch installed; "
                             "KVBATCH_DECODE_IMAGE in the code location's environment)")
        if self.launcher == "kubernetes" and self.nnodes != 1:
            raise ValueError("launcher 'kubernetes' runs one pod per group: nnodes must be 1")
        return self

    @property
    def nproc_per_node(self) -> int:
        return self.world_size // self.nnodes

    def resolved_backend(self) -> str:
        """nccl exactly when the ranks' tensors are on CUDA (NCCL moves nothing else), else gloo."""
        if self.backend != "auto":
            return self.backend
        if self.device == "cpu":
            return "gloo"
        if self.launcher == "kubernetes":
            return "nccl" if self.gpus_per_rank else "gloo"
        import torch

        return "nccl" if torch.cuda.is_available() else "gloo"

    def worker_device(self) -> str:
        """The engine device every rank uses: ``cpu`` with gloo, ``cuda`` (its LOCAL_RANK GPU) with nccl."""
        return "cuda" if self.resolved_backend() == "nccl" else "cpu"

    def torchrun_args(self, *, standalone: bool, target: list[str] | None = None) -> list[str]:
        """torchrun's arguments, then the target (default ``-m kvbatch.ops.decode.worker``)."""
        args = [f"--nproc-per-node={self.nproc_per_node}"]
        if standalone:
            args.append("--standalone")  # a private rendezvous on a free port: groups never collide
        elif self.rendezvous == "c10d":  # the same command on every machine; the store numbers them
            args += [f"--nnodes={self.nnodes}", "--rdzv-backend=c10d",
                     f"--rdzv-endpoint={self.master_addr}:{self.master_port}", f"--rdzv-id={self.rdzv_id}"]
        else:
            args += [f"--nnodes={self.nnodes}", f"--node-rank={self.node_rank}",
                     f"--master-addr={self.master_addr}", f"--master-port={self.master_port}"]
        return args + (target or ["-m", WORKER_MODULE])

    def command(self, python: str = sys.executable, target: list[str] | None = None) -> list[str]:
        """The command PipesSubprocessClient runs for this launcher."""
        if self.launcher == "pipes_subprocess":
            return [python, *(target or ["-m", WORKER_MODULE])]
        if self.launcher in ("local", "torchrun"):
            return [python, "-m", "torch.distributed.run",
                    *self.torchrun_args(standalone=self.launcher == "local", target=target)]
        raise ValueError(f"launcher {self.launcher!r} has no local command")

    def worker_options(self) -> dict[str, Any]:
        """The spec keys every rank reads (``kvbatch.ops.decode.worker``): checkpointing, live EPLB."""
        return {"checkpoint_rows": self.checkpoint_rows, "eplb_interval": self.eplb_interval,
                "eplb_window": self.eplb_window, "redundant_experts": self.redundant_experts}

    def worker_env(self) -> dict[str, str]:
        return {"KVBATCH_DIST_BACKEND": self.resolved_backend()}

    def pod_spec(self, name: str, *, labels: Mapping[str, str] | None = None) -> dict[str, Any]:
        """A Kubernetes Pod manifest running one decode group: ``world_size`` ranks under torchrun in
        one container, ``world_size * gpus_per_rank`` GPUs requested. A plain dict (what the
        Kubernetes API and ``PipesK8sClient(base_pod_spec=..., base_pod_meta=...)`` take)."""
        gpus = self.world_size * self.gpus_per_rank
        requests: dict[str, Any] = {"cpu": self.cpu, "memory": self.memory}
        limits: dict[str, Any] = {}
        if gpus:
            requests[GPU_RESOURCE] = gpus
            limits[GPU_RESOURCE] = gpus  # GPUs must be requested and limited alike
        env = [{"name": "MASTER_ADDR", "value": self.master_addr},
               {"name": "MASTER_PORT", "value": str(self.master_port)},
               {"name": "WORLD_SIZE", "value": str(self.world_size)},
               {"name": "KVBATCH_DIST_BACKEND", "value": self.resolved_backend()}]
        container: dict[str, Any] = {
            "name": "decode",
            "image": self.image,
            # torchrun expands nothing itself; Kubernetes substitutes $(VAR) from the env above.
            "command": ["torchrun", f"--nproc-per-node={self.world_size}", "--nnodes=1",
                        "--master-addr=$(MASTER_ADDR)", "--master-port=$(MASTER_PORT)", "-m", WORKER_MODULE],
            "env": env,
            "resources": {"requests": requests, **({"limits": limits} if limits else {})},
        }
        if self.secret_env:
            container["envFrom"] = [{"secretRef": {"name": self.secret_env}}]
        spec: dict[str, Any] = {"restartPolicy": "Never", "containers": [container]}
        if self.service_account:
            spec["serviceAccountName"] = self.service_account
        if self.node_selector:
            spec["nodeSelector"] = dict(self.node_selector)
        if gpus:
            spec["tolerations"] = [{"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}]
        return {"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": _dns_name(name), "namespace": self.namespace,
                             "labels": {"app.kubernetes.io/name": "kvbatch-decode", **dict(labels or {})}},
                "spec": spec}

    def run(self, context: dg.AssetExecutionContext, spec: dict[str, Any],
            subprocess_client: dg.PipesSubprocessClient) -> Iterator[Any]:
        """Launch the worker group for one shard and yield what rank 0 reported through Pipes."""
        # The worker's shard command; the ranks' tensors go where the collectives can move them.
        spec = {**spec, "command": "shard", "engine_spec": {**spec["engine_spec"], "device": self.worker_device()},
                **self.worker_options()}
        if self.launcher == "kubernetes":
            from kvbatch.resources.kubernetes import require_dagster_k8s

            PipesK8sClient = require_dagster_k8s("decode_cluster launcher 'kubernetes' (PipesK8sClient)").PipesK8sClient
            # Credentials stay out of the pod spec: the pod gets them from secret_env / its service account.
            spec = {**spec, "storage_options": _without_secrets(spec.get("storage_options") or {}),
                    "kv_store": {**spec["kv_store"],
                                 "storage_options": _without_secrets(spec["kv_store"].get("storage_options") or {})}}
            pod = self.pod_spec(f"kvbatch-decode-{context.run.run_id[:8]}")
            invocation = PipesK8sClient().run(context=context, extras={"spec": spec}, namespace=self.namespace,
                                              base_pod_meta=pod["metadata"], base_pod_spec=pod["spec"])
        else:
            invocation = subprocess_client.run(command=self.command(), context=context, extras={"spec": spec},
                                               env=self.worker_env())
        yield from invocation.get_results()


_SECRET_KEYS = ("key", "secret", "token", "access_key_id", "secret_access_key")


def _without_secrets(opts: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in opts.items() if k not in _SECRET_KEYS}


def _dns_name(name: str) -> str:
    """A valid pod name: lowercase alphanumerics and '-', at most 63 characters."""
    clean = "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")
    return clean[:63].rstrip("-") or "kvbatch-decode"
