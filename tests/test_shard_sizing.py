"""Shards sized by the data: a date with N rows gets ceil(N / max_rows_per_shard) shards, every
one of them holding rows (``ops/shards/routing.py``, ``ops/shards/build.py``); and in the pipeline: the
count chosen by ``prompt_shards`` and written beside the shards, ``shards_after_ingest`` requesting
only those, a (date, shard) beyond them materializing nothing, a re-sharded day keeping no
stale shard, and ``KVBATCH_NUM_SHARDS`` refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from kvbatch.ops.ingest.prompts import ingest
from kvbatch.ops.shards.routing import shards_for_rows
from kvbatch.ops.shards.build import RowTokenizer, build_shards, sized_shard_count

REPO = Path(__file__).resolve().parents[1]
DATE = "2026-11-29"


@pytest.mark.parametrize(("rows", "per_shard", "expected"),
                         [(0, 10, 1), (1, 10, 1), (10, 10, 1), (11, 10, 2), (95, 10, 10), (10_000_000, 10_000, 1000)])
def test_a_date_gets_ceil_rows_over_rows_per_shard_shards(rows, per_shard, expected):
    assert shards_for_rows(rows, per_shard) == expected


def test_more_shards_than_the_range_has_is_an_error_naming_both():
    with pytest.raises(ValueError, match="need 1001 shards, more than the 1000"):
        shards_for_rows(10_000_001, 10_000, max_shards=1000)
    with pytest.raises(ValueError, match="max_rows_per_shard must be >= 1"):
        shards_for_rows(5, 0)


def test_build_shards_writes_that_many_shards_all_with_rows(tmp_path):
    from kvbatch.engine.models.weights import load_tokenizer_source
    from kvbatch.engine.text.tokenizer import ChatTokenizer
    from kvbatch.ops.tokenizer_source_cache import kept_tokenizer_source

    tok = ChatTokenizer.from_source(kept_tokenizer_source("smollm2-135m"))
    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "tokenizer.json").write_text(tok._tok.to_str())
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": tok.chat_template,
                                                              "bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}))
    rows = [{"custom_id": f"night-{i:04d}", "messages": [{"role": "user", "content": f"question {i}"}]}
            for i in range(95)]
    (tmp_path / "in.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    prompts = str(tmp_path / "prompts.parquet")
    ingest(str(tmp_path / "in.jsonl"), prompts, str(tmp_path / "rejects.parquet"))
    count = sized_shard_count(prompts, max_rows_per_shard=10)
    assert count == 10
    report = build_shards(RowTokenizer(load_tokenizer_source(str(folder)), 512, "cd" * 32, 16), prompts,
                          str(tmp_path / "out"), count, rejects_url=str(tmp_path / "out" / "rejects.parquet"))
    assert sorted(report.rows_by_shard) == [f"{i:04d}" for i in range(10)]
    files = sorted((tmp_path / "out" / "shards").glob("shard=*/part.parquet"))
    assert len(files) == 10
    assert all(pq.read_metadata(f).num_rows > 0 for f in files)
    assert sum(pq.read_metadata(f).num_rows for f in files) == 95


# ---------------------------------------------------------------- the pipeline: n from the data


def test_kvbatch_num_shards_is_refused_with_its_message():
    """The fixed count is gone; a deployment that still sets it is told so, and what replaces it."""
    from kvbatch.pipelines.partitions import max_shards_from_env

    with pytest.raises(ValueError, match=r"KVBATCH_NUM_SHARDS is no longer read: a date's shard count now follows "
                                         r"its data, .*max_rows_per_shard.*KVBATCH_MAX_SHARDS"):
        max_shards_from_env({"KVBATCH_NUM_SHARDS": "8"})
    assert max_shards_from_env({}) == 1024 and max_shards_from_env({"KVBATCH_MAX_SHARDS": "16"}) == 16
    if "KVBATCH_MAX_ROWS_PER_SHARD" not in os.environ:  # the default the docs state
        from kvbatch.pipelines.assets import ShardsConfig

        assert ShardsConfig().max_rows_per_shard == 10_000
    for bad in ("0", "10001", "many"):
        with pytest.raises(ValueError, match="KVBATCH_MAX_SHARDS"):
            max_shards_from_env({"KVBATCH_MAX_SHARDS": bad})
    # Read at import: the code location itself refuses to load.
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVBATCH_")}
    env.update(KVBATCH_NUM_SHARDS="8", PYTHONPATH=str(REPO))
    run = subprocess.run([sys.executable, "-c", "import kvbatch.pipelines.definitions"], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "KVBATCH_NUM_SHARDS is no longer read" in run.stderr, run.stderr[-2000:]


def _lines(n: int) -> list[str]:
    return [json.dumps({"custom_id": f"night-{i:04d}", "messages": [{"role": "user", "content": f"question {i}"}],
                        "max_tokens": 2, "temperature": 0}) for i in range(n)]


@pytest.fixture(scope="module")
def day_of_95(tmp_path_factory):
    """95 rows ingested at 10 rows per shard through ``kvbatch_ingest``, in one instance."""
    import dagster as dg

    from kvbatch.pipelines import default
    from kvbatch.resources import (
        DecodeClusterResource,
        KVStoreResource,
        ModelResource,
        ObjectStoreResource,
        PricingResource,
    )
    from tests.tiny_models import build_tiny_chat_model

    base = tmp_path_factory.mktemp("sized")
    tiny = build_tiny_chat_model(base / "tiny", max_positions=256)
    root = base / "data"
    defs = dg.Definitions(assets=default.ASSETS, jobs=default.JOBS, resources=default.resources({
        "object_store": ObjectStoreResource(url=str(root)), "model": ModelResource(model=str(tiny), max_batch=8),
        "kv_store": KVStoreResource(memory_gb=0), "pricing": PricingResource(),
        "decode_cluster": DecodeClusterResource(), "pipes_subprocess_client": dg.PipesSubprocessClient()}))
    instance = dg.DagsterInstance.ephemeral()

    def ingest(rows: int, date: str = DATE):
        data = base / f"in-{rows}.jsonl"
        data.write_text("\n".join(_lines(rows)) + "\n")
        result = defs.resolve_job_def("kvbatch_ingest").execute_in_process(
            partition_key=date, instance=instance,
            run_config={"ops": {"kvbatch__prompts": {"config": {"url": str(data)}},
                                "kvbatch__prompt_shards": {"config": {"max_rows_per_shard": 10}}}})
        assert result.success
        return result

    first = ingest(95)
    # The kvbatch pipeline's tables are under <root>/kvbatch (factory.py).
    return {"defs": defs, "instance": instance, "root": root / "kvbatch", "store_root": root, "ingest": ingest,
            "first": first}


def _shard_folders(root, table: str, date: str = DATE) -> list[str]:
    return sorted(p.name.removeprefix("shard=") for p in (root / table / f"date={date}").glob("shard=*"))


def test_a_day_gets_its_shard_count_from_its_rows_and_the_sensor_requests_only_those(day_of_95):
    """95 rows at max_rows_per_shard 10: prompt_shards writes 10 shards, says so in its metadata
    and in shards/date=D/_shard_count.json, adds exactly the day's 10 keys to the pipeline's
    dynamic partitions, and shards_after_ingest requests 0000..0009 only."""
    import dagster as dg

    from kvbatch.ops.shards.routing import read_shard_count
    from kvbatch.pipelines.default import shards_after_ingest

    root, first = day_of_95["root"], day_of_95["first"]
    meta = first.asset_materializations_for_node("kvbatch__prompt_shards")[0].metadata
    assert meta["num_shards"].value == 10 and meta["rows_per_shard_target"].value == 10
    sizes = [int(pq.read_metadata(f).num_rows) for f in sorted((root / "shards" / f"date={DATE}").glob("*/*.parquet"))]
    assert sum(sizes) == 95 and meta["rows_largest_shard"].value == max(sizes)
    assert meta["stale_shards_removed"].value == 0
    count = read_shard_count(str(root / "shards" / f"date={DATE}" / "_shard_count.json"))
    assert count is not None and (count.date, count.num_shards, count.rows, count.max_rows_per_shard,
                                  count.max_shards) == (DATE, 10, 95, 10, 1024)
    assert _shard_folders(root, "shards") == [f"{i:04d}" for i in range(10)]
    day_keys = [k for k in day_of_95["instance"].get_dynamic_partitions("kvbatch_shards") if k.startswith(DATE)]
    assert day_keys == [f"{DATE}|{i:04d}" for i in range(10)]
    ctx = dg.build_run_status_sensor_context(sensor_name="kvbatch_shards_after_ingest",
                                             dagster_instance=day_of_95["instance"],
                                             dagster_run=first.dagster_run, dagster_event=first.get_run_success_event())
    requests = shards_after_ingest(ctx)
    assert [r.partition_key for r in requests] == [f"{DATE}|{i:04d}" for i in range(10)]
    assert {r.job_name for r in requests} <= {None, "kvbatch_shard"}


def _observed(res) -> dict:
    return {e.asset_key.to_user_string(): e.event_specific_data.asset_observation
            for e in res.all_events if e.event_type_value == "ASSET_OBSERVATION"}


def _skipped_steps(res) -> list[str]:
    return sorted(e.step_key for e in res.all_events if e.event_type_value == "STEP_SKIPPED")


def test_a_shard_beyond_its_day_materializes_nothing_and_says_why(day_of_95):
    """kvbatch_shard of 2026-11-29|0010 (what "Materialize all" or a backfill over the whole
    range launches): the run succeeds, nothing is materialized or written, prefill_kv records an
    observation with the reason and logs it, and Dagster skips the two steps after it. Run alone
    (kvbatch_decode), decode_results says the same itself. The checks of the skipped assets are
    left planned in a successful run, which the UI shows as skipped, not failed."""
    import dagster as dg
    from dagster._core.storage.asset_check_execution_record import AssetCheckExecutionRecordStatus

    defs, instance, root = day_of_95["defs"], day_of_95["instance"], day_of_95["root"]
    key = f"{DATE}|0010"
    # The day has 10 keys; a key beyond them exists only when added by hand (or left by an older
    # instance): the step must still refuse to make up a shard.
    instance.add_dynamic_partitions("kvbatch_shards", [key])
    reason = f"shard 0010 is not one of the 10 shards of {DATE} (95 rows at max_rows_per_shard=10)"
    runs = []
    for job, observer, skipped in (("kvbatch_shard", "prefill_kv", ["kvbatch__cost_metrics",
                                                                     "kvbatch__decode_results"]),
                                   ("kvbatch_decode", "decode_results", ["kvbatch__cost_metrics"])):
        res = defs.resolve_job_def(job).execute_in_process(partition_key=key, instance=instance)
        assert res.success
        assert res.get_asset_materialization_events() == [] and res.get_asset_check_evaluations() == []
        [(name, obs)] = _observed(res).items()
        assert name == f"kvbatch/{observer}" and obs.partition == key
        assert obs.metadata["skipped"].value.startswith(reason)
        assert obs.metadata["num_shards"].value == 10
        assert _skipped_steps(res) == skipped
        assert any(reason in (e.user_message or "") for e in instance.all_logs(res.run_id))
        runs.append(res.run_id)
    for table in ("manifests", "prefill_stats", "results", "decode_stats", "cost_metrics", "decode_parts"):
        assert "0010" not in _shard_folders(root, table), table
    for asset, check in (("decode_results", "one_result_per_custom_id"), ("decode_results", "output_within_max_tokens"),
                         ("cost_metrics", "latency_p95_within_slo")):
        history = instance.event_log_storage.get_asset_check_execution_history(
            dg.AssetCheckKey(dg.AssetKey(["kvbatch", asset]), check), limit=50)
        records = [r for r in history if r.run_id in runs]
        assert len(records) == 2 and {r.status for r in records} == {AssetCheckExecutionRecordStatus.PLANNED}
    assert {instance.get_run_by_id(r).status for r in runs} == {dg.DagsterRunStatus.SUCCESS}  # so: SKIPPED in the UI


def test_an_ingest_run_without_prompt_shards_starts_no_shard(day_of_95):
    """The sensor reads n from the run's own prompt_shards materialization: a run that
    materialized only prompts has none, and the sensor says so instead of guessing."""
    import dagster as dg

    from kvbatch.pipelines.default import prompts, resources, shards_after_ingest
    from kvbatch.resources import ObjectStoreResource

    data = day_of_95["store_root"].parent / "in-95.jsonl"
    res = dg.materialize([prompts], partition_key="2026-11-26", instance=day_of_95["instance"],
                         resources=resources({"object_store": ObjectStoreResource(url=str(day_of_95["store_root"]))}),
                         run_config={"ops": {"kvbatch__prompts": {"config": {"url": str(data)}}}})
    ctx = dg.build_run_status_sensor_context(sensor_name="kvbatch_shards_after_ingest",
                                             dagster_instance=day_of_95["instance"],
                                             dagster_run=res.dagster_run, dagster_event=res.get_run_success_event())
    skip = shards_after_ingest(ctx)
    assert isinstance(skip, dg.SkipReason)
    assert skip.skip_message == (f"ingest run {res.run_id} of 2026-11-26 materialized no prompt_shards: "
                                 "no shard to start")


def test_a_check_run_without_its_asset_is_refused(day_of_95):
    """decode_results is subsettable (so a skipped shard's checks are optional); its checks still
    run only inside its materialization, and selecting them alone says so."""
    import dagster as dg

    from kvbatch.pipelines.default import decode_results

    # (Dagster 1.13 cannot give a checks-only selection a partition key at all: "There is no
    # PartitionsDefinition shared by all the provided assets"; without one it runs the step.)
    key = dg.AssetCheckKey(decode_results.key, "one_result_per_custom_id")
    res = dg.materialize(day_of_95["defs"].assets, selection=dg.AssetSelection.checks(key),
                         resources=day_of_95["defs"].resources, raise_on_error=False)
    assert not res.success
    [failure] = [e for e in res.all_events if e.event_type_value == "STEP_FAILURE"]
    assert "the checks of decode_results run inside its materialization: select the asset" in (
        failure.event_specific_data.error.message)


def test_a_shard_before_its_day_is_sharded_fails_naming_the_date(day_of_95):
    """No prompt_shards for 2026-11-27 yet: its (date, shard) fails at once (no retry), saying so.
    (Ingest adds a day's keys, so such a key exists only when added by hand, as here.)"""
    day_of_95["instance"].add_dynamic_partitions("kvbatch_shards", ["2026-11-27|0000"])
    res = day_of_95["defs"].resolve_job_def("kvbatch_shard").execute_in_process(
        partition_key="2026-11-27|0000", instance=day_of_95["instance"], raise_on_error=False)
    assert not res.success
    [failure] = [e for e in res.all_events if e.event_type_value == "STEP_FAILURE"]
    assert failure.step_key == "kvbatch__prefill_kv"
    message = failure.event_specific_data.error.message
    assert "date 2026-11-27 has no shards yet" in message and "prompt_shards for 2026-11-27" in message
    assert not [e for e in res.all_events if e.event_type_value == "STEP_UP_FOR_RETRY"]


def test_reingesting_fewer_rows_removes_the_shards_the_day_no_longer_has(day_of_95):
    """A day of 95 rows (10 shards), shard 0009 run end to end, then the day re-ingested with 35
    rows (4 shards): every table of shards 0004..0009 is gone, so no stale shard is read with the
    day; each of the 35 rows is in shard sha256(custom_id) mod 4. (Its own date: the other tests
    keep 2026-11-29 at 10 shards.)"""
    from kvbatch.ops.shards.routing import read_shard_count, shard_of

    defs, root = day_of_95["defs"], day_of_95["root"]
    instance, date = day_of_95["instance"], "2026-11-25"
    day_of_95["ingest"](95, date)
    assert defs.resolve_job_def("kvbatch_shard").execute_in_process(partition_key=f"{date}|0009",
                                                                    instance=instance).success
    for table in ("shards", "manifests", "results", "cost_metrics", "prefill_stats", "decode_stats"):
        assert "0009" in _shard_folders(root, table, date), table
    again = day_of_95["ingest"](35, date)
    meta = again.asset_materializations_for_node("kvbatch__prompt_shards")[0].metadata
    assert (meta["num_shards"].value, meta["stale_shards_removed"].value) == (4, 6)
    assert read_shard_count(str(root / "shards" / f"date={date}" / "_shard_count.json")).num_shards == 4
    for table in ("shards", "manifests", "results", "cost_metrics", "prefill_stats", "decode_stats"):
        assert all(int(k) < 4 for k in _shard_folders(root, table, date)), table
    assert _shard_folders(root, "shards", date) == ["0000", "0001", "0002", "0003"]
    placed = {cid: k for k in _shard_folders(root, "shards", date)
              for cid in pq.read_table(root / "shards" / f"date={date}" / f"shard={k}").column("custom_id").to_pylist()}
    assert sorted(placed) == [f"night-{i:04d}" for i in range(35)]
    assert all(int(k) == shard_of(cid, 4) for cid, k in placed.items())
