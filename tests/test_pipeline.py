"""The Dagster asset graph end to end on a tiny model, with a loopback S3 as the object store:
every valid row of a date partition gets exactly one result equal to an in-process generate,
rejects are kept, one (date, shard) re-runs alone, the decode worker group (1 or 2 ranks through
Pipes) gives the same tokens, and the CLI entry points (validate, materialize) work."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import dagster as dg
import pyarrow.parquet as pq
import pytest

from kvbatch.io.shard_tables import read_shards
from kvbatch.ops.shards.routing import shard_keys
from kvbatch.pipelines.automation import date_of_file, new_file_requests
from kvbatch.pipelines.default import (
    ASSETS,
    cost_metrics,
    decode_results,
    nightly_ingest,
    prefill_kv,
    prompt_shards,
    prompts,
    shards_after_ingest,
)
from kvbatch.pipelines.definitions import defs
from kvbatch.pipelines.factory import default_pipeline, pipeline_resources
from kvbatch.pipelines.layout import DayLayout
from kvbatch.pipelines.partitions import date_shard_key, date_shard_keys
from kvbatch.resources import (
    DecodeClusterResource,
    KVStoreResource,
    ModelResource,
    ObjectStoreResource,
    PricingResource,
)
from tests.tiny_models import build_tiny_chat_model

REPO = Path(__file__).resolve().parents[1]
DAGSTER = str(Path(sys.executable).with_name("dagster"))
SYSTEM = "You answer questions about a small bakery. Be brief and polite, and never invent prices. " * 2
SHARD_ASSETS = [prefill_kv, decode_results, cost_metrics]
DATE, OTHER_DATE = "2026-11-29", "2026-11-28"
# The 14 valid rows at 3 rows per shard: ceil(14 / 3) = 5 shards a date (the run config says so).
ROWS_PER_SHARD, NUM_SHARDS = 3, 5


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return build_tiny_chat_model(tmp_path_factory.mktemp("tiny"), max_positions=512)


def _rows() -> list[str]:
    rows = []
    for i in range(14):
        body = {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Question {i}?"}],
                "max_tokens": 4 + i % 3, "temperature": 0}
        rows.append(json.dumps({"custom_id": f"r{i:02d}", "method": "POST", "url": "/v1/chat/completions",
                                "body": body}))
    rows.insert(3, '{"custom_id": "bad-temp", "messages": [{"role": "user", "content": "x"}], "temperature": "hot"}')
    rows.insert(7, "not json")
    rows.append(json.dumps({"custom_id": "r01", "messages": [{"role": "user", "content": "dup"}]}))
    return rows


def keyed(by_kind: dict) -> dict:
    """Resources by kind, keyed as the code location's own pipeline (``kvbatch``) finds them."""
    return pipeline_resources(default_pipeline().spec, by_kind)


def tables(root: str) -> str:
    """Where the ``kvbatch`` pipeline's tables live under the object store root."""
    return f"{root}/kvbatch"


def _resources(tiny: Path, url: str, opts: dict) -> dict:
    return keyed({
        "object_store": ObjectStoreResource(url=url, endpoint_url=opts["endpoint_url"], access_key_id=opts["key"],
                                            secret_access_key=opts["secret"]),
        "model": ModelResource(model=str(tiny), max_batch=8, deterministic=True),
        "kv_store": KVStoreResource(memory_gb=0),  # every hit must come from the object tier
        "pricing": PricingResource(usd_per_device_hour={"cpu-host": 3.6}, usd_per_gb_month_by_tier={"object": 0.02},
                                   usd_per_gb_egress=0.09, kv_object_reads_leave_region=True),
        "decode_cluster": DecodeClusterResource(),
        "pipes_subprocess_client": dg.PipesSubprocessClient(),
    })


@pytest.fixture
def dataset(s3) -> tuple[str, str, dict, object]:
    url, opts, fs = s3
    root = url.rsplit("/", 1)[0]
    data = f"{root}/in/requests.jsonl"
    fs.pipe(data.removeprefix("s3://"), ("\n".join(_rows()) + "\n").encode())
    return data, f"{root}/out", opts, fs


def _reference(tiny: Path, tmp_path: Path) -> dict[str, tuple[str, int]]:
    from kvbatch.engine.runtime.engine_config import EngineConfig
    from kvbatch.engine.runtime.llm import LLM
    from kvbatch.ops.decode.generate import run_batch

    src = tmp_path / "ref_in.jsonl"
    src.write_text("\n".join(_rows()) + "\n")
    out = tmp_path / "ref_out.jsonl"
    run_batch(LLM(str(tiny), engine_config=EngineConfig(batch_invariant=True, max_num_seqs=8)), str(src), str(out))
    ref = {}
    for line in out.read_text().splitlines():
        o = json.loads(line)
        if not o["error"]:
            body = o["response"]["body"]
            ref[o["custom_id"]] = (body["choices"][0]["message"]["content"], body["usage"]["completion_tokens"])
    return ref


def _ingest_config(data: str) -> dict:
    return {"ops": {"kvbatch__prompts": {"config": {"url": data, "max_reject_rate": 0.5}},
                    "kvbatch__prompt_shards": {"config": {"max_rows_per_shard": ROWS_PER_SHARD}}}}


def _ingest(resources: dict, data: str, date: str = DATE, instance=None):
    return dg.materialize([prompts, prompt_shards], resources=resources, partition_key=date, instance=instance,
                          run_config=_ingest_config(data))


def _path(url: str) -> str:
    return url.removeprefix("s3://")


def test_whole_graph_on_loopback_s3(tiny, dataset, tmp_path):
    data, root, opts, fs = dataset
    resources = _resources(tiny, root, opts)
    instance = dg.DagsterInstance.ephemeral()
    day = DayLayout(tables(root), DATE)
    res = _ingest(resources, data, instance=instance)
    assert res.success
    checks = {c.check_name: c.passed for c in res.get_asset_check_evaluations()}
    assert checks == {"reject_rate_below_threshold": True, "unique_custom_ids": True}
    meta = res.asset_materializations_for_node("kvbatch__prompts")[0].metadata
    assert meta["rejected_rows"].value == 3 and meta["input_rows"].value == 17
    assert "rejects_preview" in meta
    assert meta["dataset_url"].value == data
    rejects = pq.read_table(fs.open(_path(day.table("rejects")))).to_pylist()
    assert sorted((r["row"], r["field"]) for r in rejects) == [(4, "temperature"), (8, "$"), (17, "custom_id")]

    assert res.asset_materializations_for_node("kvbatch__prompt_shards")[0].metadata["num_shards"].value == NUM_SHARDS
    for key in date_shard_keys(DATE, NUM_SHARDS):
        r = dg.materialize(SHARD_ASSETS, resources=resources, partition_key=key, instance=instance,
                           selection=SHARD_ASSETS)
        assert r.success
        assert all(c.passed for c in r.get_asset_check_evaluations())
    materialized = instance.get_materialized_partitions(decode_results.key)
    assert materialized == {str(k) for k in date_shard_keys(DATE, NUM_SHARDS)}

    results = read_shards(day.root, day.folder("results"), storage_options=opts)
    assert sorted(results.column("custom_id").to_pylist()) == [f"r{i:02d}" for i in range(14)]
    ref = _reference(tiny, tmp_path)
    got = {r["custom_id"]: (r["text"], r["completion_tokens"]) for r in results.to_pylist()}
    assert got == ref  # decoding from the stored KV gives exactly the in-process tokens
    assert all(len(r["output_token_ids"]) == r["completion_tokens"] <= r["max_tokens"] for r in results.to_pylist())

    metrics = read_shards(day.root, day.folder("cost_metrics"), storage_options=opts)
    assert sum(metrics.column("requests").to_pylist()) == 14
    assert sum(metrics.column("kv_tokens_hit_object").to_pylist()) > 0  # shared system prompt loaded
    assert sum(metrics.column("cost_usd").to_pylist()) > 0
    assert metrics.column("spec_acceptance_rate").null_count == metrics.num_rows  # no speculation here
    # The day's rollup (through s3fs too) is the sum of the shards' cost rows.
    import numpy as np

    from kvbatch.pipelines.default import cost_rollup

    assert dg.materialize([cost_rollup], resources=resources, partition_key=DATE, instance=instance).success
    [day_row] = pq.read_table(fs.open(_path(day.table("cost_rollup")))).to_pylist()
    assert day_row["shards"] == metrics.num_rows and day_row["requests"] == 14
    assert day_row["cost_usd"] == pytest.approx(sum(metrics.column("cost_usd").to_pylist()), abs=1e-12)
    assert day_row["ttft_s_p95"] == pytest.approx(float(np.percentile(results.column("ttft_s").to_pylist(), 95)),
                                                  abs=1e-6)
    # Hive layout: a dataset reader over the table folder sees date and shard columns.
    import pyarrow.dataset as ds

    table = ds.dataset(_path(day.root) + "/results", filesystem=fs, format="parquet", partitioning="hive").to_table()
    assert set(table.column("date").to_pylist()) == {DATE} and table.num_rows == 14
    assert fs.exists(_path(day.shard("results", "0000")))


def test_rerun_of_one_date_shard_replaces_it_and_nothing_else(tiny, dataset):
    data, root, opts, fs = dataset
    resources = _resources(tiny, root, opts)
    instance = dg.DagsterInstance.ephemeral()  # holds the days' (date, shard) partitions
    assert _ingest(resources, data, instance=instance).success
    assert _ingest(resources, data, date=OTHER_DATE, instance=instance).success
    keys = shard_keys(NUM_SHARDS)[:3]
    done = [(DATE, k) for k in keys] + [(OTHER_DATE, keys[1])]
    for date, key in done:
        assert dg.materialize(SHARD_ASSETS, resources=resources, partition_key=date_shard_key(date, key),
                              selection=SHARD_ASSETS, instance=instance).success

    def stamps():
        out = {}
        for date, key in done:
            for table in ("results", "cost_metrics"):
                info = fs.info(_path(DayLayout(tables(root), date).shard(table, key)), refresh=True)
                out[(table, date, key)] = info["LastModified"]
        return out

    day = DayLayout(tables(root), DATE)
    before = stamps()
    contents = fs.cat(_path(day.shard("results", keys[1])))
    time.sleep(1.1)  # S3 timestamps have one-second resolution
    assert dg.materialize([decode_results, cost_metrics], resources=resources, partition_key=f"{DATE}|{keys[1]}",
                          selection=[decode_results, cost_metrics], instance=instance).success
    after = stamps()
    changed = {k for k in before if before[k] != after[k]}
    assert changed == {("results", DATE, keys[1]), ("cost_metrics", DATE, keys[1])}
    rerun = pq.read_table(fs.open(_path(day.shard("results", keys[1]))))
    first = pq.read_table(__import__("io").BytesIO(contents))
    assert rerun.select(["custom_id", "text"]).equals(first.select(["custom_id", "text"]))
    assert len(fs.ls(_path(day.shard("results", keys[1], "")).rstrip("/"))) == 1


def test_definitions_surface():
    dg.Definitions.validate_loadable(defs)
    assert {a.key.to_user_string() for a in ASSETS} == {"kvbatch/prompts", "kvbatch/prompt_shards",
                                                         "kvbatch/prefill_kv", "kvbatch/decode_results",
                                                         "kvbatch/cost_metrics"}
    for name in ("kvbatch_ingest", "kvbatch_prefill", "kvbatch_decode", "kvbatch_shard", "kvbatch_rollup"):
        defs.resolve_job_def(name)
    assert defs.resolve_assets_def(dg.AssetKey(["kvbatch", "cost_rollup"])).partitions_def == prompts.partitions_def
    assert decode_results.op.pool == "gpu" and prefill_kv.op.pool == "gpu"
    assert prompts.op.retry_policy.max_retries == 3
    assert isinstance(prompts.partitions_def, dg.DailyPartitionsDefinition)
    assert prompt_shards.partitions_def == prompts.partitions_def
    # (date, shard) assets: one dynamic dimension whose keys name the day, added per day.
    shards = decode_results.partitions_def
    assert isinstance(shards, dg.DynamicPartitionsDefinition) and shards.name == "kvbatch_shards"
    assert str(date_shard_key(DATE, "0003")) == f"{DATE}|0003"
    graph = defs.resolve_asset_graph()
    mapping = graph.get(prefill_kv.key).partition_mappings[prompt_shards.key]
    assert isinstance(mapping, dg.AllPartitionMapping)
    sched = defs.resolve_schedule_def("kvbatch_nightly_ingest")
    assert sched.cron_schedule == "0 2 * * *" and sched.default_status == dg.DefaultScheduleStatus.STOPPED


def test_schedule_and_sensors(tmp_path, monkeypatch):
    ctx = dg.build_schedule_context(scheduled_execution_time=__import__("datetime").datetime(2026, 11, 29, 2))
    assert isinstance(nightly_ingest(ctx), dg.SkipReason)  # no dataset configured: nothing starts
    monkeypatch.setenv("KVBATCH_NIGHTLY_DATASET", "s3://bucket/in/{date}.jsonl")
    req = nightly_ingest(ctx)
    # At 02:00 the day that just ended is ingested, into its date partition.
    assert req.partition_key == "2026-11-28" and req.run_key == "nightly-2026-11-28"
    assert req.run_config["ops"]["kvbatch__prompts"]["config"]["url"] == "s3://bucket/in/2026-11-28.jsonl"

    (tmp_path / "2026-11-27.jsonl").write_text("{}\n")
    (tmp_path / "date=2026-11-26").mkdir()
    (tmp_path / "date=2026-11-26" / "part-1.parquet").write_bytes(b"x")
    (tmp_path / "skip.txt").write_text("x")
    first = new_file_requests(str(tmp_path), None)
    assert sorted((r.partition_key, r.run_config["ops"]["prompts"]["config"]["url"]) for r in first.run_requests) == [
        ("2026-11-26", str(tmp_path / "date=2026-11-26" / "part-1.parquet")),
        ("2026-11-27", str(tmp_path / "2026-11-27.jsonl"))]
    again = new_file_requests(str(tmp_path), first.cursor)
    assert again.run_requests == []
    (tmp_path / "undated.jsonl").write_text("{}\n")  # no date in the path: the day it was written
    # A written-at time of our choosing (one second before a UTC midnight), not "now": the
    # answer must not depend on the day, or the hour, the test runs.
    written = __import__("datetime").datetime(2026, 11, 26, 23, 59, 59, tzinfo=__import__("datetime").UTC)
    os.utime(tmp_path / "undated.jsonl", (written.timestamp(), written.timestamp()))
    third = new_file_requests(str(tmp_path), first.cursor)
    [undated] = third.run_requests
    assert undated.run_key.split("@")[0] == str(tmp_path / "undated.jsonl")
    assert undated.partition_key == "2026-11-26"
    assert date_of_file("in/1999-01-01.jsonl", {}) is None  # before the first date partition
    assert date_of_file("in/2026-13-45.jsonl", {}) is None
    assert shards_after_ingest.job_name == "kvbatch_shard"


def test_resource_validation_errors():
    with pytest.raises(Exception, match="unsupported scheme"):
        ObjectStoreResource(url="ftp://host/x")
    with pytest.raises(Exception, match="absolute path"):
        ObjectStoreResource(url="relative/folder")
    with pytest.raises(Exception, match="needs launcher 'local', 'torchrun' or 'kubernetes'"):
        DecodeClusterResource(world_size=4)
    with pytest.raises(Exception, match="needs an image"):
        DecodeClusterResource(launcher="kubernetes", world_size=2)
    with pytest.raises(Exception, match="not divisible"):
        DecodeClusterResource(launcher="torchrun", world_size=3, nnodes=2)
    store = ObjectStoreResource(url="s3://b/p", access_key_id="AKIA-SECRET", secret_access_key="very-secret")
    assert "SECRET" not in repr(store) and "very-secret" not in str(store)
    assert store.storage_options()["secret"] == "very-secret"


def test_decode_cluster_commands_and_pod_spec():
    local = DecodeClusterResource(launcher="local", world_size=2, backend="gloo")
    cmd = local.command(python="py")
    assert cmd == ["py", "-m", "torch.distributed.run", "--nproc-per-node=2", "--standalone", "-m",
                   "kvbatch.ops.decode.worker"]
    multi = DecodeClusterResource(launcher="torchrun", world_size=8, nnodes=2, node_rank=1, master_addr="10.0.0.5",
                                  master_port=29400, backend="nccl")
    assert multi.command(python="py")[3:8] == ["--nproc-per-node=4", "--nnodes=2", "--node-rank=1",
                                               "--master-addr=10.0.0.5", "--master-port=29400"]
    assert DecodeClusterResource(launcher="pipes_subprocess").command(python="py") == [
        "py", "-m", "kvbatch.ops.decode.worker"]

    k8s = DecodeClusterResource(launcher="kubernetes", world_size=4, image="ghcr.io/acme/kvbatch:1", namespace="llm",
                                secret_env="kvbatch-s3", node_selector={"gpu": "h200"}, master_port=29501)
    pod = k8s.pod_spec("KVBatch Decode/2026-11-29|0003")
    assert pod["apiVersion"] == "v1" and pod["kind"] == "Pod"
    assert pod["metadata"]["namespace"] == "llm"
    name = pod["metadata"]["name"]
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name) and len(name) <= 63
    spec = pod["spec"]
    assert spec["restartPolicy"] == "Never" and spec["nodeSelector"] == {"gpu": "h200"}
    [container] = spec["containers"]
    assert container["image"] == "ghcr.io/acme/kvbatch:1"
    assert container["resources"]["requests"]["nvidia.com/gpu"] == 4
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert container["command"][0] == "torchrun" and "--nproc-per-node=4" in container["command"]
    assert container["command"][-2:] == ["-m", "kvbatch.ops.decode.worker"]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env == {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29501", "WORLD_SIZE": "4",
                   "KVBATCH_DIST_BACKEND": "nccl"}
    assert "--master-port=$(MASTER_PORT)" in container["command"]  # Kubernetes substitutes it from env
    assert container["envFrom"] == [{"secretRef": {"name": "kvbatch-s3"}}]
    assert "secret" not in json.dumps(pod).replace("secretRef", "").lower()  # no credentials in the manifest
    cpu = DecodeClusterResource(launcher="kubernetes", world_size=2, image="img", gpus_per_rank=0).pod_spec("x")
    assert "nvidia.com/gpu" not in json.dumps(cpu) and cpu["spec"]["containers"][0]["env"][3]["value"] == "gloo"


def _cli_env(tmp_path: Path, tiny: Path) -> dict:
    home = tmp_path / "dagster_home"
    home.mkdir(exist_ok=True)
    env = dict(os.environ, DAGSTER_HOME=str(home), KVBATCH_ROOT=str(tmp_path / "data"), KVBATCH_MODEL=str(tiny),
               KVBATCH_MAX_ROWS_PER_SHARD="7", PYTHONPATH=str(REPO))  # 14 rows: 2 shards
    return env


def test_cli_validate_and_materialize(tiny, tmp_path):
    env = _cli_env(tmp_path, tiny)
    v = subprocess.run([DAGSTER, "definitions", "validate", "-w", "workspace.yaml"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=180)
    assert v.returncode == 0, v.stdout + v.stderr
    data = tmp_path / "requests.jsonl"
    data.write_text("\n".join(_rows()) + "\n")
    base = [DAGSTER, "asset", "materialize", "-m", "kvbatch.pipelines.definitions"]
    cfg = json.dumps({"ops": {"kvbatch__prompts": {"config": {"url": str(data), "max_reject_rate": 0.5}}}})
    a = subprocess.run(base + ["--select", "kvbatch/prompts,kvbatch/prompt_shards", "--partition", DATE,
                               "--config-json", cfg],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert a.returncode == 0, a.stdout[-3000:] + a.stderr[-3000:]
    b = subprocess.run(base + ["--select", "kvbatch/prefill_kv,kvbatch/decode_results,kvbatch/cost_metrics",
                               "--partition", f"{DATE}|0001"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert b.returncode == 0, b.stdout[-3000:] + b.stderr[-3000:]
    day = DayLayout(tables(str(tmp_path / "data")), DATE)
    results = pq.read_table(day.shard("results", "0001"))
    shard = pq.read_table(day.shard("shards", "0001"))
    assert results.num_rows == shard.num_rows > 0
    assert not Path(day.shard("results", "0000")).exists()


def ingested_local_day(tiny: Path, tmp_path: Path) -> tuple[dg.Definitions, dg.DagsterInstance, object]:
    """The code location's jobs over a local folder, an ephemeral instance, and the run of
    kvbatch_ingest for DATE over _rows() (asserted successful): a day ready for its shard runs."""
    from kvbatch.pipelines.default import JOBS

    data = tmp_path / "requests.jsonl"
    data.write_text("\n".join(_rows()) + "\n")
    resources = keyed({
        "object_store": ObjectStoreResource(url=str(tmp_path / "data")),
        "model": ModelResource(model=str(tiny), max_batch=8),
        "kv_store": KVStoreResource(memory_gb=0),
        "pricing": PricingResource(),
        "decode_cluster": DecodeClusterResource(),
        "pipes_subprocess_client": dg.PipesSubprocessClient(),
    })
    instance = dg.DagsterInstance.ephemeral()
    local_defs = dg.Definitions(assets=ASSETS, jobs=JOBS, resources=resources)
    ingest = local_defs.resolve_job_def("kvbatch_ingest").execute_in_process(
        partition_key=DATE, instance=instance, run_config=_ingest_config(str(data)))
    assert ingest.success
    return local_defs, instance, ingest


def test_day_runs_ingest_then_every_shard_of_the_date(tiny, tmp_path):
    """The whole graph of a day as the deployment runs it: kvbatch_ingest for the date, then the
    run requests shards_after_ingest makes from that run, executed with kvbatch_shard."""
    root = str(tmp_path / "data")
    local_defs, instance, ingest = ingested_local_day(tiny, tmp_path)
    ctx = dg.build_run_status_sensor_context(sensor_name="shards_after_ingest", dagster_instance=instance,
                                             dagster_run=ingest.dagster_run,
                                             dagster_event=ingest.get_run_success_event())
    requests = shards_after_ingest(ctx)
    assert [r.partition_key for r in requests] == [f"{DATE}|{i:04d}" for i in range(NUM_SHARDS)]
    key = requests[2].partition_key
    res = local_defs.resolve_job_def("kvbatch_shard").execute_in_process(partition_key=key, instance=instance)
    assert res.success
    day = DayLayout(tables(root), DATE)
    done = read_shards(day.root, day.folder("results"))
    assert set(done.column("shard").to_pylist()) == {key.split("|")[1]}
    assert done.num_rows == pq.read_table(day.shard("shards", key.split("|")[1])).num_rows


def _pipes_resources(tiny: Path, root: str, cluster: DecodeClusterResource) -> dict:
    return keyed({
        "object_store": ObjectStoreResource(url=root),
        "model": ModelResource(model=str(tiny), max_batch=8, deterministic=True, threads=1),
        "kv_store": KVStoreResource(memory_gb=0),
        "pricing": PricingResource(),
        "decode_cluster": cluster,
        "pipes_subprocess_client": dg.PipesSubprocessClient(env={"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}),
    })


def _largest_shard(day: DayLayout) -> str:
    return max(shard_keys(NUM_SHARDS), key=lambda k: pq.read_table(day.shard("shards", k)).num_rows)


def _decode_largest_shard(tiny, tmp_path: Path, cluster: DecodeClusterResource):
    """Ingest the test rows, then materialize the shard assets of the largest shard through
    ``cluster``; returns (root, day, shard key, result), the result checked for success."""
    data = tmp_path / "requests.jsonl"
    data.write_text("\n".join(_rows()) + "\n")
    root = str(tmp_path / "data")
    resources = _pipes_resources(tiny, root, cluster)
    instance = dg.DagsterInstance.ephemeral()
    assert _ingest(resources, str(data), instance=instance).success
    day = DayLayout(tables(root), DATE)
    key = _largest_shard(day)
    res = dg.materialize(SHARD_ASSETS, resources=resources, partition_key=date_shard_key(DATE, key),
                         selection=SHARD_ASSETS, instance=instance)
    assert res.success
    return root, day, key, res


def test_decode_through_pipes_subprocess(tiny, tmp_path):
    root, day, key, res = _decode_largest_shard(tiny, tmp_path, DecodeClusterResource(launcher="pipes_subprocess"))
    meta = res.asset_materializations_for_node("kvbatch__decode_results")[0].metadata
    assert meta["succeeded"].value == pq.read_table(day.shard("shards", key)).num_rows > 0
    assert meta["loaded_prompt_tokens"].value > 0
    assert all(c.passed for c in res.get_asset_check_evaluations())
    ref = _reference(tiny, tmp_path)
    got = {r["custom_id"]: (r["text"], r["completion_tokens"])
           for r in read_shards(day.root, day.folder("results")).to_pylist()}
    assert got == {k: ref[k] for k in got}


@pytest.mark.slow
def test_decode_with_two_ranks_under_torchrun_equals_one(tiny, tmp_path):
    """world_size 2 (launcher local: torchrun --standalone, gloo): the ranks split the shard,
    rank 0 commits one table and reports through Pipes; tokens equal an in-process generate."""
    root, day, key, res = _decode_largest_shard(
        tiny, tmp_path, DecodeClusterResource(launcher="local", world_size=2, backend="gloo"))
    meta = res.asset_materializations_for_node("kvbatch__decode_results")[0].metadata
    rows = pq.read_table(day.shard("shards", key)).num_rows
    assert meta["world_size"].value == 2 and meta["succeeded"].value == rows >= 2
    assert all(c.passed for c in res.get_asset_check_evaluations())
    stats = json.loads(Path(day.shard("decode_stats", key, "stats.json")).read_text())
    assert [r["requests"] for r in stats["by_rank"]] == [(rows + 1) // 2, rows // 2]
    metrics = pq.read_table(day.shard("cost_metrics", key)).to_pylist()[0]
    # Prefill ran in the step's own process (1 device), decode on the 2-rank group.
    assert metrics["device_s_prefill"] == pytest.approx(metrics["prefill_wall_s"], rel=1e-3)
    assert metrics["device_s_decode"] == pytest.approx(2 * metrics["decode_wall_s"], rel=1e-3)
    assert metrics["device_s"] == pytest.approx(metrics["device_s_prefill"] + metrics["device_s_decode"], rel=1e-3)
    ref = _reference(tiny, tmp_path)
    results = pq.read_table(day.shard("results", key)).to_pylist()
    assert [r["row"] for r in results] == sorted(r["row"] for r in results)
    assert {r["custom_id"]: (r["text"], r["completion_tokens"]) for r in results} == {
        r["custom_id"]: ref[r["custom_id"]] for r in results}


def test_terminating_the_launcher_stops_every_rank(tiny, tmp_path):
    """What Dagster does when a run is terminated: SIGINT to the launcher it started. torchrun
    then stops its workers; none may outlive it. The ranks are the real decode worker, stopped
    once each has committed a part of its own (so each is inside the decode loop, not starting)."""
    from kvbatch.engine.spec import EngineSpec
    from kvbatch.resources.decode_cluster import WORKER_MODULE

    rows = [json.dumps({"custom_id": f"r{i}", "messages": [{"role": "user", "content": f"Count to {i}"}],
                        "max_tokens": 200, "ignore_eos": True, "temperature": 0}) for i in range(8)]
    (tmp_path / "in.jsonl").write_text("\n".join(rows) + "\n")
    parts = tmp_path / "parts"
    spec = {"command": "generate", "input": str(tmp_path / "in.jsonl"), "output": str(tmp_path / "out.jsonl"),
            "parts_url": str(parts), "checkpoint_rows": 1,
            "engine_spec": EngineSpec(model=str(tiny), dtype="fp32", max_batch=1).to_json()}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    cluster = DecodeClusterResource(launcher="local", world_size=2, backend="gloo")
    cmd = cluster.command(target=["-m", WORKER_MODULE, "--spec", str(tmp_path / "spec.json")])
    proc = subprocess.Popen(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)

    def ranks() -> dict[str, int]:
        found = {}
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                if int(stat.read_text().rsplit(")", 1)[1].split()[1]) != proc.pid:
                    continue
                pairs = (stat.parent / "environ").read_bytes().split(b"\0")
                env = dict(kv.split(b"=", 1) for kv in pairs if b"=" in kv)
            except (OSError, ValueError):
                continue
            if b"RANK" in env:
                found[env[b"RANK"].decode()] = int(stat.parent.name)
        return found

    try:
        deadline = time.monotonic() + 240
        while not all(list(parts.glob(f"part-*-r{r:05d}-*.parquet")) for r in (0, 1)):
            assert proc.poll() is None and time.monotonic() < deadline, "the ranks did not commit a part each"
            time.sleep(0.2)
        pids = ranks()
        assert sorted(pids) == ["0", "1"], pids
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)

        def alive(pid: int) -> bool:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return False
            return Path(f"/proc/{pid}/stat").exists() and Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"

        deadline = time.monotonic() + 30
        while any(alive(p) for p in pids.values()) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(alive(p) for p in pids.values())
        assert not (tmp_path / "out.jsonl").exists()  # stopped mid-run: no output passes for the whole
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
