"""The Dagster asset graph end to end on a tiny model, with a loopback S3 as the object store:
every valid row gets exactly one result equal to an in-process generate, rejects are kept,
one shard re-runs alone, and the CLI entry points (validate, materialize) work."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

import dagster as dg
from kvbatch.io.shard_tables import read_shards, shard_url, table_url
from kvbatch.pipelines.assets import ASSETS, cost_metrics, decode_results, prefill_kv, prompt_shards, prompts
from kvbatch.pipelines.automation import new_file_requests, nightly_ingest, shards_after_ingest
from kvbatch.pipelines.definitions import defs
from kvbatch.pipelines.partitions import shard_partitions
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


def _resources(tiny: Path, url: str, opts: dict) -> dict:
    return {
        "object_store": ObjectStoreResource(url=url, endpoint_url=opts["endpoint_url"], access_key_id=opts["key"],
                                            secret_access_key=opts["secret"]),
        "model": ModelResource(model=str(tiny), max_batch=8, deterministic=True),
        "kv_store": KVStoreResource(memory_gb=0),  # every hit must come from the object tier
        "pricing": PricingResource(usd_per_device_hour=3.6, usd_per_gb_stored=0.02, usd_per_gb_moved=0.09),
        "decode_cluster": DecodeClusterResource(),
        "pipes_subprocess_client": dg.PipesSubprocessClient(),
    }


@pytest.fixture
def dataset(s3) -> tuple[str, str, dict, object]:
    url, opts, fs = s3
    root = url.rsplit("/", 1)[0]
    data = f"{root}/in/requests.jsonl"
    fs.pipe(data.removeprefix("s3://"), ("\n".join(_rows()) + "\n").encode())
    return data, f"{root}/out", opts, fs


def _reference(tiny: Path, tmp_path: Path) -> dict[str, tuple[str, int]]:
    from kvbatch.engine.config import EngineConfig
    from kvbatch.engine.llm import LLM
    from kvbatch.ops.batch_generate import run_batch

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


def _ingest(resources: dict, data: str):
    return dg.materialize([prompts, prompt_shards], resources=resources,
                          run_config={"ops": {"prompts": {"config": {"url": data, "max_reject_rate": 0.5}}}})


def test_whole_graph_on_loopback_s3(tiny, dataset, tmp_path):
    data, root, opts, fs = dataset
    resources = _resources(tiny, root, opts)
    instance = dg.DagsterInstance.ephemeral()
    res = _ingest(resources, data)
    assert res.success
    checks = {c.check_name: c.passed for c in res.get_asset_check_evaluations()}
    assert checks == {"reject_rate_below_threshold": True, "unique_custom_ids": True}
    meta = res.asset_materializations_for_node("prompts")[0].metadata
    assert meta["rejected_rows"].value == 3 and meta["input_rows"].value == 17
    assert "rejects_preview" in meta
    rejects = pq.read_table(fs.open(table_url(root, "rejects").removeprefix("s3://"))).to_pylist()
    assert sorted((r["row"], r["field"]) for r in rejects) == [(4, "temperature"), (8, "$"), (17, "custom_id")]

    for key in shard_partitions.get_partition_keys():
        r = dg.materialize(SHARD_ASSETS, resources=resources, partition_key=key, instance=instance,
                           selection=SHARD_ASSETS)
        assert r.success
        assert all(c.passed for c in r.get_asset_check_evaluations())

    results = read_shards(root, "results", storage_options=opts)
    assert sorted(results.column("custom_id").to_pylist()) == [f"r{i:02d}" for i in range(14)]
    ref = _reference(tiny, tmp_path)
    got = {r["custom_id"]: (r["text"], r["completion_tokens"]) for r in results.to_pylist()}
    assert got == ref  # decoding from the stored KV gives exactly the in-process tokens
    assert all(len(r["output_token_ids"]) == r["completion_tokens"] <= r["max_tokens"] for r in results.to_pylist())

    metrics = read_shards(root, "cost_metrics", storage_options=opts)
    assert sum(metrics.column("requests").to_pylist()) == 14
    assert sum(metrics.column("kv_tokens_hit_object").to_pylist()) > 0  # shared system prompt loaded
    assert sum(metrics.column("cost_usd").to_pylist()) > 0
    assert fs.exists(shard_url(root, "results", "0000").removeprefix("s3://"))


def test_rerun_of_one_shard_replaces_it_and_nothing_else(tiny, dataset):
    data, root, opts, fs = dataset
    resources = _resources(tiny, root, opts)
    assert _ingest(resources, data).success
    keys = shard_partitions.get_partition_keys()
    for key in keys[:3]:
        assert dg.materialize(SHARD_ASSETS, resources=resources, partition_key=key, selection=SHARD_ASSETS).success

    def stamps():
        out = {}
        for key in keys[:3]:
            for table in ("results", "cost_metrics"):
                info = fs.info(shard_url(root, table, key).removeprefix("s3://"), refresh=True)
                out[(table, key)] = info["LastModified"]
        return out

    before = stamps()
    contents = fs.cat(shard_url(root, "results", keys[1]).removeprefix("s3://"))
    time.sleep(1.1)  # S3 timestamps have one-second resolution
    assert dg.materialize([decode_results, cost_metrics], resources=resources, partition_key=keys[1],
                          selection=[decode_results, cost_metrics]).success
    after = stamps()
    changed = {k for k in before if before[k] != after[k]}
    assert changed == {("results", keys[1]), ("cost_metrics", keys[1])}
    rerun = pq.read_table(fs.open(shard_url(root, "results", keys[1]).removeprefix("s3://")))
    first = pq.read_table(__import__("io").BytesIO(contents))
    assert rerun.select(["custom_id", "text"]).equals(first.select(["custom_id", "text"]))
    assert len(fs.ls(shard_url(root, "results", keys[1], "").removeprefix("s3://").rstrip("/"))) == 1


def test_definitions_surface():
    dg.Definitions.validate_loadable(defs)
    assert {a.key.to_user_string() for a in ASSETS} == {"prompts", "prompt_shards", "prefill_kv", "decode_results",
                                                         "cost_metrics"}
    for name in ("kvbatch_all", "kvbatch_ingest", "kvbatch_prefill", "kvbatch_decode", "kvbatch_shard"):
        defs.resolve_job_def(name)
    assert decode_results.op.pool == "gpu" and prefill_kv.op.pool == "gpu"
    assert prompts.op.retry_policy.max_retries == 3
    sched = defs.resolve_schedule_def("nightly_ingest")
    assert sched.cron_schedule == "0 2 * * *" and sched.default_status == dg.DefaultScheduleStatus.STOPPED


def test_schedule_and_sensors(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBATCH_NIGHTLY_DATASET", "s3://bucket/in/{date}.jsonl")
    ctx = dg.build_schedule_context(scheduled_execution_time=__import__("datetime").datetime(2026, 11, 28, 2))
    req = nightly_ingest(ctx)
    assert req.run_config["ops"]["prompts"]["config"]["url"] == "s3://bucket/in/2026-11-28.jsonl"
    assert req.run_key == "nightly-2026-11-28"

    (tmp_path / "a.jsonl").write_text("{}\n")
    (tmp_path / "skip.txt").write_text("x")
    first = new_file_requests(str(tmp_path), None)
    assert [r.run_config["ops"]["prompts"]["config"]["url"] for r in first.run_requests] == [str(tmp_path / "a.jsonl")]
    again = new_file_requests(str(tmp_path), first.cursor)
    assert again.run_requests == []
    (tmp_path / "b.parquet").write_bytes(b"x")
    third = new_file_requests(str(tmp_path), first.cursor)
    assert [r.run_key.split("@")[0] for r in third.run_requests] == [str(tmp_path / "b.parquet")]
    assert shards_after_ingest.job_name == "kvbatch_shard"


def test_resource_validation_errors():
    with pytest.raises(Exception, match="unsupported scheme"):
        ObjectStoreResource(url="ftp://host/x")
    with pytest.raises(Exception, match="absolute path"):
        ObjectStoreResource(url="relative/folder")
    with pytest.raises(Exception, match="multi-rank decode is not implemented"):
        DecodeClusterResource(world_size=4)
    store = ObjectStoreResource(url="s3://b/p", access_key_id="AKIA-SECRET", secret_access_key="very-secret")
    assert "SECRET" not in repr(store) and "very-secret" not in str(store)
    assert store.storage_options()["secret"] == "very-secret"


def _cli_env(tmp_path: Path, tiny: Path) -> dict:
    home = tmp_path / "dagster_home"
    home.mkdir(exist_ok=True)
    env = dict(os.environ, DAGSTER_HOME=str(home), KVBATCH_ROOT=str(tmp_path / "data"), KVBATCH_MODEL=str(tiny),
               KVBATCH_NUM_SHARDS="2", PYTHONPATH=str(REPO))
    return env


def test_cli_validate_and_materialize(tiny, tmp_path):
    env = _cli_env(tmp_path, tiny)
    v = subprocess.run([DAGSTER, "definitions", "validate", "-w", "workspace.yaml"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=180)
    assert v.returncode == 0, v.stdout + v.stderr
    data = tmp_path / "requests.jsonl"
    data.write_text("\n".join(_rows()) + "\n")
    base = [DAGSTER, "asset", "materialize", "-m", "kvbatch.pipelines.definitions"]
    cfg = json.dumps({"ops": {"prompts": {"config": {"url": str(data), "max_reject_rate": 0.5}}}})
    a = subprocess.run(base + ["--select", "prompts,prompt_shards", "--config-json", cfg], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=300)
    assert a.returncode == 0, a.stdout[-3000:] + a.stderr[-3000:]
    b = subprocess.run(base + ["--select", "prefill_kv,decode_results,cost_metrics", "--partition", "0001"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert b.returncode == 0, b.stdout[-3000:] + b.stderr[-3000:]
    root = str(tmp_path / "data")
    results = pq.read_table(shard_url(root, "results", "0001"))
    shard = pq.read_table(shard_url(root, "shards", "0001"))
    assert results.num_rows == shard.num_rows > 0
    assert not Path(shard_url(root, "results", "0000")).exists()


def test_whole_graph_job_for_one_shard(tiny, tmp_path):
    from kvbatch.pipelines.automation import JOBS

    data = tmp_path / "requests.jsonl"
    data.write_text("\n".join(_rows()) + "\n")
    root = str(tmp_path / "data")
    resources = {
        "object_store": ObjectStoreResource(url=root),
        "model": ModelResource(model=str(tiny), max_batch=8),
        "kv_store": KVStoreResource(memory_gb=0),
        "pricing": PricingResource(),
        "decode_cluster": DecodeClusterResource(),
        "pipes_subprocess_client": dg.PipesSubprocessClient(),
    }
    job = dg.Definitions(assets=ASSETS, jobs=JOBS, resources=resources).resolve_job_def("kvbatch_all")
    key = shard_partitions.get_partition_keys()[2]
    res = job.execute_in_process(partition_key=key, run_config={
        "ops": {"prompts": {"config": {"url": str(data), "max_reject_rate": 0.5}}}})
    assert res.success
    done = read_shards(root, "results")
    assert set(done.column("shard").to_pylist()) == {key}
    assert done.num_rows == pq.read_table(shard_url(root, "shards", key)).num_rows


def test_decode_through_pipes_subprocess(tiny, tmp_path):
    data = tmp_path / "requests.jsonl"
    data.write_text("\n".join(_rows()) + "\n")
    root = str(tmp_path / "data")
    resources = {
        "object_store": ObjectStoreResource(url=root),
        "model": ModelResource(model=str(tiny), max_batch=8, deterministic=True),
        "kv_store": KVStoreResource(memory_gb=0),
        "pricing": PricingResource(),
        "decode_cluster": DecodeClusterResource(launcher="pipes_subprocess"),
        "pipes_subprocess_client": dg.PipesSubprocessClient(env={"PYTHONPATH": str(REPO)}),
    }
    assert _ingest(resources, str(data)).success
    key = max(shard_partitions.get_partition_keys(), key=lambda k: pq.read_table(shard_url(root, "shards", k)).num_rows)
    res = dg.materialize(SHARD_ASSETS, resources=resources, partition_key=key, selection=SHARD_ASSETS)
    assert res.success
    meta = res.asset_materializations_for_node("decode_results")[0].metadata
    assert meta["succeeded"].value == pq.read_table(shard_url(root, "shards", key)).num_rows > 0
    assert meta["loaded_prompt_tokens"].value > 0
    assert all(c.passed for c in res.get_asset_check_evaluations())
    ref = _reference(tiny, tmp_path)
    got = {r["custom_id"]: (r["text"], r["completion_tokens"]) for r in read_shards(root, "results").to_pylist()}
    assert got == {k: ref[k] for k in got}
