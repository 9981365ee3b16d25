"""deploy/ and the Dockerfile: the Helm values, the K8s run config and the image agree with each
other and with the decode resource (parsed here; nothing is run against a cluster)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import yaml

from kvbatch.resources.decode_cluster import GPU_RESOURCE, WORKER_MODULE, DecodeClusterResource

ROOT = Path(__file__).resolve().parents[1]


def _yaml(rel: str) -> dict:
    return yaml.safe_load((ROOT / rel).read_text())


def test_helm_values_launch_runs_as_k8s_jobs_from_the_kvbatch_code_location():
    values = _yaml("deploy/helm/values.yaml")
    assert values["runLauncher"]["type"] == "K8sRunLauncher"
    [dep] = values["dagster-user-deployments"]["deployments"]
    assert dep["dagsterApiGrpcArgs"] == ["--module-name", "kvbatch.pipelines.definitions"]
    dockerfile = (ROOT / "Dockerfile").read_text()
    cmd = re.search(r"^CMD (\[.*\])$", dockerfile, re.MULTILINE)
    assert cmd is not None
    image_cmd = yaml.safe_load(cmd.group(1))
    assert image_cmd[:3] == ["dagster", "code-server", "start"]
    assert image_cmd[image_cmd.index("--port") + 1] == str(dep["port"])  # the webserver reaches the image
    assert image_cmd[-2:] == dep["dagsterApiGrpcArgs"]
    env = {e["name"]: e["value"] for e in dep["env"]}
    assert env["KVBATCH_DECODE_LAUNCHER"] == "kubernetes"  # definitions.py reads it
    secrets = {s["name"] for s in dep["envSecrets"]}
    assert secrets == {s["name"] for s in values["runLauncher"]["config"]["k8sRunLauncher"]["envSecrets"]}


def test_the_decode_pod_requests_what_the_decode_group_needs():
    run_config = _yaml("deploy/run_config/decode_k8s.yaml")
    cluster = DecodeClusterResource(**run_config["resources"]["kvbatch_decode_cluster"]["config"])
    assert cluster.resolved_backend() == "nccl"  # GPUs in the pod: the ranks talk over NCCL
    pod = cluster.pod_spec("kvbatch-decode-test")
    [container] = pod["spec"]["containers"]
    gpus = cluster.world_size * cluster.gpus_per_rank
    assert container["resources"]["requests"][GPU_RESOURCE] == container["resources"]["limits"][GPU_RESOURCE] == gpus
    assert container["resources"]["requests"]["cpu"] == cluster.cpu
    assert container["command"][:2] == ["torchrun", f"--nproc-per-node={cluster.world_size}"]
    assert container["command"][-2:] == ["-m", WORKER_MODULE]
    assert {"name": "WORLD_SIZE", "value": str(cluster.world_size)} in container["env"]
    assert container["envFrom"] == [{"secretRef": {"name": "kvbatch-s3"}}]
    assert pod["spec"]["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H200"}
    # Credentials come from the Secret only: the run config carries none.
    assert not re.search(r"secret_access_key|access_key_id|password", (ROOT / "deploy").joinpath(
        "run_config/decode_k8s.yaml").read_text())
    assert run_config["execution"]["config"]["env_secrets"] == ["kvbatch-s3"]


def test_the_image_holds_every_package_folder_and_the_k8s_extra():
    dockerfile = (ROOT / "Dockerfile").read_text()
    copied = set(re.findall(r"^COPY (\w+) \1$", dockerfile, re.MULTILINE))
    pyproject = (ROOT / "pyproject.toml").read_text()
    folders = set(re.findall(r'"kvbatch\.(\w+)', pyproject))
    assert folders <= copied, f"not copied into the image: {sorted(folders - copied)}"
    assert 'pip install ".[k8s]"' in dockerfile


def test_the_resource_passes_checkpointing_and_live_eplb_to_every_rank():
    cluster = DecodeClusterResource(launcher="pipes_subprocess", device="cpu", checkpoint_rows=64, eplb_interval=8, eplb_window=16,
                                    redundant_experts=2)
    seen = {}

    class Client:
        def run(self, *, command, context, extras, env):
            seen.update(extras["spec"])

            class Done:
                def get_results(self):
                    return []

            return Done()

    list(cluster.run(None, {"manifests_url": "m", "engine_spec": {}}, Client()))
    assert (seen["checkpoint_rows"], seen["eplb_interval"], seen["eplb_window"], seen["redundant_experts"]) == (
        64, 8, 16, 2)
    assert seen["engine_spec"]["device"] == "cpu" and seen["manifests_url"] == "m"
    assert seen["command"] == "shard"  # the worker entry point's pipeline shard command


# ------------------------------------------------------------------ the executor and the decode pods wired in


def _values_env() -> dict[str, str]:
    [dep] = _yaml("deploy/helm/values.yaml")["dagster-user-deployments"]["deployments"]
    return {e["name"]: e["value"] for e in dep["env"]}


def _fake_dagster_k8s(monkeypatch, seen: dict):
    """A stand-in for dagster_k8s (not installable here): an executor and a PipesK8sClient that record."""
    import types

    import dagster as dg

    @dg.executor(name="fake_k8s_job_executor")
    def fake_executor(_init_context):
        raise AssertionError("not run in these tests")

    class PipesK8sClient:
        def run(self, **kwargs):
            seen.update(kwargs)

            class Done:
                def get_results(self):
                    return ["reported"]

            return Done()

    module = types.ModuleType("dagster_k8s")
    module.k8s_job_executor = fake_executor
    module.PipesK8sClient = PipesK8sClient
    monkeypatch.setitem(sys.modules, "dagster_k8s", module)


def test_the_helm_values_environment_loads_the_resources_and_asks_for_the_k8s_executor(monkeypatch):
    from kvbatch.pipelines import definitions
    from kvbatch.pipelines.executor import executor_choice

    env = _values_env()
    assert executor_choice(env) == "k8s"
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    cluster = definitions.default_resources()["decode_cluster"]  # the code location's resources, as on the cluster
    assert (cluster.launcher, cluster.world_size, cluster.image) == (
        "kubernetes", 4, env["KVBATCH_DECODE_IMAGE"])


def test_k8s_executor_without_the_extra_is_refused_naming_it(monkeypatch):
    from kvbatch.pipelines.executor import executor_def
    from kvbatch.resources.kubernetes import MissingK8sExtra

    monkeypatch.setitem(sys.modules, "dagster_k8s", None)  # not installed (import raises)
    with pytest.raises(MissingK8sExtra, match=r"KVBATCH_EXECUTOR=k8s .*pip install 'kvbatch\[k8s\]'"):
        executor_def("k8s")
    assert executor_def("multiprocess") is None
    import dagster as dg

    assert executor_def("in_process") is dg.in_process_executor


def test_an_unknown_executor_name_is_refused():
    from kvbatch.pipelines.executor import executor_choice

    with pytest.raises(ValueError, match=r"KVBATCH_EXECUTOR='k9s' .*\['in_process', 'multiprocess', 'k8s'\]"):
        executor_choice({"KVBATCH_EXECUTOR": "k9s"})
    assert executor_choice({}) == "in_process"


def test_kvbatch_executor_k8s_puts_every_job_on_the_k8s_job_executor(monkeypatch):
    import importlib

    from kvbatch.pipelines import definitions

    _fake_dagster_k8s(monkeypatch, {})
    monkeypatch.setenv("KVBATCH_EXECUTOR", "k8s")
    try:
        defs = importlib.reload(definitions).defs
        names = {job.name for job in defs.resolve_all_job_defs() if not job.name.startswith("__")}
        assert {"kvbatch_decode", "kvbatch_shard", "kvbatch_ingest"} <= names
        for name in names - {"kvbatch_batch_api"}:
            assert defs.resolve_job_def(name).executor_def.name == "fake_k8s_job_executor", name
        # The batch API's job names its own executor: `kvbatch serve`'s worker runs it in one process.
        assert defs.resolve_job_def("kvbatch_batch_api").executor_def.name == "in_process"
    finally:
        monkeypatch.delenv("KVBATCH_EXECUTOR")
        monkeypatch.delitem(sys.modules, "dagster_k8s")
        defs = importlib.reload(definitions).defs
    # Unset: a run's steps share the run's process (and the engine its prefill built).
    assert defs.resolve_job_def("kvbatch_decode").executor_def.name == "in_process"
    monkeypatch.setenv("KVBATCH_EXECUTOR", "multiprocess")
    try:
        defs = importlib.reload(definitions).defs
        assert defs.resolve_job_def("kvbatch_shard").executor_def.name == "multi_or_in_process_executor"
    finally:
        monkeypatch.delenv("KVBATCH_EXECUTOR")
        importlib.reload(definitions)


def test_the_run_config_execution_block_is_what_the_k8s_job_executor_gets():
    from kvbatch.pipelines.executor import k8s_execution_config

    run_config = _yaml("deploy/run_config/decode_k8s.yaml")
    config = k8s_execution_config(run_config)
    assert config == {"job_namespace": "kvbatch", "max_concurrent": 8, "env_secrets": ["kvbatch-s3"],
                      "step_k8s_config": {"container_config": {"resources": {"requests": {"cpu": "2",
                                                                                           "memory": "8Gi"}}}}}
    elsewhere = {**run_config, "execution": {"config": {**run_config["execution"]["config"], "job_namespace": "x"}}}
    with pytest.raises(ValueError, match="differs from kvbatch_decode_cluster.namespace 'kvbatch'"):
        k8s_execution_config(elsewhere)
    no_secret = {**run_config, "execution": {"config": {**run_config["execution"]["config"], "env_secrets": []}}}
    with pytest.raises(ValueError, match="lacks kvbatch_decode_cluster.secret_env 'kvbatch-s3'"):
        k8s_execution_config(no_secret)
    with pytest.raises(ValueError, match="no execution.config block"):
        k8s_execution_config({"resources": run_config["resources"]})


def _k8s_cluster() -> DecodeClusterResource:
    run_config = _yaml("deploy/run_config/decode_k8s.yaml")
    return DecodeClusterResource(**run_config["resources"]["kvbatch_decode_cluster"]["config"])


class _Context:
    class run:  # the attribute path of dagster's context: context.run.run_id
        run_id = "0123456789abcdef"


SPEC = {"manifests_url": "s3://b/m.jsonl", "engine_spec": {}, "storage_options": {"key": "AKIA", "endpoint_url": "http://s3"},
        "kv_store": {"url": "s3://b/kv", "storage_options": {"secret": "shh", "anon": False}}}


def test_the_kubernetes_decode_path_without_the_extra_is_refused_naming_it(monkeypatch):
    from kvbatch.resources.kubernetes import MissingK8sExtra

    monkeypatch.setitem(sys.modules, "dagster_k8s", None)
    with pytest.raises(MissingK8sExtra, match=r"launcher 'kubernetes' \(PipesK8sClient\) .*kvbatch\[k8s\]"):
        list(_k8s_cluster().run(_Context(), SPEC, None))


def test_the_kubernetes_decode_path_starts_the_pod_spec_through_pipes_k8s_client(monkeypatch):
    seen: dict = {}
    _fake_dagster_k8s(monkeypatch, seen)
    cluster = _k8s_cluster()
    assert list(cluster.run(_Context(), SPEC, None)) == ["reported"]
    pod = cluster.pod_spec("kvbatch-decode-01234567")
    assert seen["namespace"] == "kvbatch" and seen["base_pod_spec"] == pod["spec"]
    assert seen["base_pod_meta"] == pod["metadata"]
    spec = seen["extras"]["spec"]
    assert spec["storage_options"] == {"endpoint_url": "http://s3"}  # credentials come from the Secret
    assert spec["kv_store"]["storage_options"] == {"anon": False}
    assert (spec["checkpoint_rows"], spec["eplb_interval"]) == (256, 64)
