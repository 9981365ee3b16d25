"""deploy/ and the Dockerfile: the Helm values, the K8s run config and the image agree with each
other and with the decode resource (parsed here; nothing is run against a cluster)."""

from __future__ import annotations

import re
from pathlib import Path

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
    cluster = DecodeClusterResource(**run_config["resources"]["decode_cluster"]["config"])
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

    list(cluster.run(None, {"manifests_url": "m", "engine": {}}, Client()))
    assert (seen["checkpoint_rows"], seen["eplb_interval"], seen["eplb_window"], seen["redundant_experts"]) == (
        64, 8, 16, 2)
    assert seen["engine"]["device"] == "cpu" and seen["manifests_url"] == "m"
