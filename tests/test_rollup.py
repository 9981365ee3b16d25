"""``cost_metrics`` and ``cost_rollup`` as Dagster runs them, on shard inputs written by hand (a
results table and the prefill/decode stats per shard: what prefill_kv and decode_results commit),
so no model runs: the day's rollup equals the sum of its shards' cost rows, also after one shard
is re-run with other figures; the rollup's page is the day's scorecard (the report first, only
the plotted figures as numbers, typed tables) and the same scorecard lands beside the Parquet;
the P95 SLO check fails on slow data and passes on fast data, with the configured severity,
against its own partition, and the day's check blocks (ERROR fails the run after the scorecard
is written); which checks block; ``rollup_after_shard`` asks for the re-roll; ``wait_for_run``
(what ``make demo`` waits with) returns the finished run."""

from __future__ import annotations

import json
from pathlib import Path

import dagster as dg
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kvbatch.io.shard_tables import write_json, write_table
from kvbatch.ops.results.cost import CLASSES
from kvbatch.ops.decode.shard import RESULTS_SCHEMA
from kvbatch.ops.shards.routing import SHARD_COUNT_FILE, ShardCount, write_shard_count
from kvbatch.pipelines.automation import wait_for_run
from kvbatch.pipelines.default import cost_metrics, cost_rollup, rollup_after_shard
from kvbatch.pipelines.factory import default_pipeline, pipeline_resources
from kvbatch.pipelines.layout import DayLayout
from kvbatch.pipelines.partitions import date_shard_key, register_day_shards
from kvbatch.pipelines.scorecard_metadata import PLOTTED
from kvbatch.resources import DecodeClusterResource, ObjectStoreResource, PricingResource

DATE = "2026-11-29"
SHARDS = ("0000", "0001")
FAST, SLOW = 0.05, 5.0


def _write_shard(day: DayLayout, shard: str, *, n: int, ttft_s: float, wall_s: float) -> None:
    rows = [{"row": i, "custom_id": f"{shard}-{i}", "text": "ok", "output_token_ids": [5] * (4 + i),
             "finish_reason": "length", "prompt_tokens": 64, "completion_tokens": 4 + i, "cached_prompt_tokens": 0,
             "loaded_prompt_tokens": 48, "max_tokens": 16, "ttft_s": ttft_s * (1 + i / 10), "tpot_s": 0.01,
             "spec_draft_tokens": None, "spec_accepted_tokens": None, "spec_target_steps": None} for i in range(n)]
    write_table(pa.Table.from_pylist(rows, RESULTS_SCHEMA), day.shard("results", shard))
    write_json({"wall_s": wall_s, "prompt_tokens_computed": 48 * n, "prompt_tokens_already_stored": 0,
                "connector": {"blocks_written": n, "kv_bytes_written": 10 ** 6 * n,
                              "object_requests": {"PUT": 3 * n, "HEAD": n}}},
               day.shard("prefill_stats", shard, "stats.json"))
    write_json({"wall_s": 2 * wall_s, "results_bytes": 1000,
                "connector": {"prompt_tokens_served_by_tier": {"object": 48 * n},
                              "kv_bytes_read_by_tier": {"object": 10 ** 6 * n}, "object_requests": {"GET": 2 * n}}},
               day.shard("decode_stats", shard, "stats.json"))
    # The shard's own table (the scorecard counts its rows) and the day's prompts: every row valid.
    write_table(pa.table({"custom_id": [f"{shard}-{i}" for i in range(n)]}), day.shard("shards", shard))
    ids = [c for s in SHARDS if Path(day.shard("shards", s)).exists()
           for c in pq.read_table(day.shard("shards", s)).column("custom_id").to_pylist()]
    write_table(pa.table({"custom_id": ids}), day.table("prompts"))  # every row of the shards, all valid
    # What prompt_shards writes beside the shards: the day has these shards (the others are no-ops).
    write_shard_count(ShardCount(day.date, num_shards=len(SHARDS), rows=2 * len(SHARDS), max_rows_per_shard=2,
                                 max_shards=1024), day.table("shards", SHARD_COUNT_FILE))


def _resources(root: Path) -> dict:
    return pipeline_resources(default_pipeline().spec, {
        "object_store": ObjectStoreResource(url=str(root)), "decode_cluster": DecodeClusterResource(),
        "pricing": PricingResource(usd_per_device_hour={"cpu-host": 3.6})})


def _instance() -> dg.DagsterInstance:
    """An instance holding the day's shard keys (what prompt_shards adds when it shards the day)."""
    instance = dg.DagsterInstance.ephemeral()
    register_day_shards(instance, default_pipeline().spec.name, DATE, len(SHARDS))
    return instance


def _layout(tmp_path: Path) -> DayLayout:
    """The pipeline's day: its steps see the store rooted at ``<root>/<pipeline name>``."""
    return DayLayout(str(tmp_path / default_pipeline().spec.name), DATE)


def _slo(ttft: float, severity: str = "WARN") -> dict:
    return {"config": {"ttft_s_p95_max": ttft, "tpot_s_p95_max": 1.0, "slo_severity": severity}}


def _meter(resources: dict, shard: str, instance, ttft_slo: float = 1.0, severity: str = "WARN"):
    return dg.materialize([cost_metrics], resources=resources, partition_key=date_shard_key(DATE, shard),
                          instance=instance, run_config={"ops": {cost_metrics.op.name: _slo(ttft_slo, severity)}})


def _roll(resources: dict, instance, ttft_slo: float = 1.0, severity: str = "WARN"):
    return dg.materialize([cost_rollup], resources=resources, partition_key=DATE, instance=instance,
                          run_config={"ops": {cost_rollup.op.name: _slo(ttft_slo, severity)}},
                          raise_on_error=False)


def _shard_rows(day: DayLayout) -> pl.DataFrame:
    return pl.concat([pl.read_parquet(day.shard("cost_metrics", s)) for s in SHARDS])


def _assert_rollup_is_the_sum(day: DayLayout) -> dict:
    rolled = pq.read_table(day.table("cost_rollup")).to_pylist()[0]
    shards = _shard_rows(day)
    for col in ("requests", "billable_tokens", "output_tokens", "prompt_tokens_prefill_computed", "kv_tokens_hit_object",
                "kv_requests_put", "kv_requests_get", "device_s_prefill", "device_s_decode", "cost_usd",
                *(f"cost_{c}_usd" for c in CLASSES)):
        assert rolled[col] == pytest.approx(shards[col].sum(), abs=1e-12), col
    assert rolled["usd_per_mtok_blended"] == pytest.approx(shards["cost_usd"].sum() / shards["billable_tokens"].sum() * 1e6)
    results = pl.concat([pl.read_parquet(day.shard("results", s)) for s in SHARDS])
    assert rolled["ttft_s_p95"] == pytest.approx(results["ttft_s"].quantile(0.95, interpolation="linear"), abs=1e-6)
    return rolled


def test_rollup_equals_the_sum_of_its_shards_after_one_shard_is_rerun(tmp_path):
    day, resources, instance = _layout(tmp_path), _resources(tmp_path), _instance()
    for shard, n in zip(SHARDS, (3, 5)):
        _write_shard(day, shard, n=n, ttft_s=FAST, wall_s=10.0)
        assert _meter(resources, shard, instance).success
    assert _roll(resources, instance).success
    before = _assert_rollup_is_the_sum(day)
    assert before["requests"] == 8 and before["shards"] == 2

    # Shard 0001 re-run: fewer rows, slower; its cost row is replaced, then the day re-rolled.
    _write_shard(day, "0001", n=2, ttft_s=FAST, wall_s=40.0)
    assert _meter(resources, "0001", instance).success
    rerolled = _roll(resources, instance)
    after = _assert_rollup_is_the_sum(day)
    assert after["requests"] == 5 and after["cost_usd"] > before["cost_usd"]

    [mat] = rerolled.asset_materializations_for_node(cost_rollup.op.name)
    meta = mat.metadata
    # The page: the scorecard first (verdict at its top), then only the plotted figures as numbers.
    assert next(iter(meta)) == "scorecard" and isinstance(meta["scorecard"], dg.MarkdownMetadataValue)
    numbers = {k for k, v in meta.items() if isinstance(v, (dg.FloatMetadataValue, dg.IntMetadataValue))}
    assert numbers == set(PLOTTED)  # every request here has a TTFT and a TPOT, so all five
    assert meta["cost_usd"].value == float(f"{after['cost_usd']:.4g}")  # 4 significant digits
    assert meta["ttft_s_p95"].value == round(after["ttft_s_p95"], 4)
    assert [r.data["shard"] for r in meta["shard_figures"].records] == list(SHARDS)  # every shard, whole
    assert {r.data["verdict"] for r in meta["slo"].records} == {"PASS"}
    assert meta["shards_needing_a_look"].records == []  # an empty table, not a JSON blob
    columns = {k: [c.name for c in meta[k].schema.columns] for k in ("slo", "shards_needing_a_look", "shard_figures")}
    assert columns == {"slo": ["latency", "P95 (s)", "SLO (s)", "verdict"],
                       "shards_needing_a_look": ["shard", "rows", "results", "problem"],
                       "shard_figures": ["shard", "requests", "cost ($)", "TTFT p95 (s)", "TPOT p95 (s)"]}
    assert all(not isinstance(v, dg.JsonMetadataValue) for v in meta.values())
    report = meta["scorecard"].value
    assert report.startswith(f"# {DATE}: **PASS**") and "```" not in report and "█" not in report
    # The same figures beside the day's Parquet.
    doc = json.loads((Path(day.root) / "cost_rollup" / f"date={DATE}" / "scorecard.json").read_text())
    assert doc["cost_usd"] == pytest.approx(after["cost_usd"], abs=1e-12)
    assert doc["rows_in"] == doc["rows_done"] == after["requests"] and doc["passed"] is True
    assert (Path(day.root) / "cost_rollup" / f"date={DATE}" / "scorecard.md").read_text() == report
    assert meta["scorecard_md"].value.endswith(f"cost_rollup/date={DATE}/scorecard.md")
    assert meta["scorecard_json"].value.endswith(f"cost_rollup/date={DATE}/scorecard.json")


def test_slo_check_fails_on_slow_data_and_passes_on_fast(tmp_path):
    day, resources, instance = _layout(tmp_path), _resources(tmp_path), _instance()
    _write_shard(day, "0000", n=4, ttft_s=FAST, wall_s=1.0)
    _write_shard(day, "0001", n=4, ttft_s=SLOW, wall_s=1.0)
    fast = _meter(resources, "0000", instance)
    [check] = fast.get_asset_check_evaluations()
    assert check.passed and check.partition == str(date_shard_key(DATE, "0000"))
    slow = _meter(resources, "0001", instance, severity="ERROR")
    assert slow.success  # a failed check is not a failed run
    [check] = slow.get_asset_check_evaluations()
    assert not check.passed and check.severity == dg.AssetCheckSeverity.ERROR
    meta = {k: v.value for k, v in check.metadata.items()}
    assert meta["ttft_s_p95"] > 1.0 and meta["ttft_s_p95_max"] == 1.0 and "ttft_s_p95" in meta["breaches"]

    # The day: its P95 is over every request, so one slow shard breaks the day's SLO (WARN here).
    [day_check] = _roll(resources, instance).get_asset_check_evaluations()
    assert not day_check.passed and day_check.severity == dg.AssetCheckSeverity.WARN and day_check.partition == DATE
    [relaxed] = _roll(resources, instance, ttft_slo=60.0).get_asset_check_evaluations()
    assert relaxed.passed


def test_a_day_slo_breach_at_error_fails_the_run_after_writing_the_scorecard(tmp_path):
    """The day's SLO check blocks: at severity ERROR the rollup's run fails (red on the run and
    the job), yet the day's table, its scorecard and the materialization are there to read; at
    WARN the run succeeds and the scorecard still says FAIL at its top."""
    day, resources, instance = _layout(tmp_path), _resources(tmp_path), _instance()
    for shard in SHARDS:
        _write_shard(day, shard, n=4, ttft_s=SLOW, wall_s=1.0)
        assert _meter(resources, shard, instance).success
    warned = _roll(resources, instance, severity="WARN")
    assert warned.success
    red = _roll(resources, instance, severity="ERROR")
    assert not red.success
    [check] = red.get_asset_check_evaluations()
    assert not check.passed and check.severity == dg.AssetCheckSeverity.ERROR
    [mat] = red.asset_materializations_for_node(cost_rollup.op.name)
    assert mat.metadata["scorecard"].value.startswith(
        f"# {DATE}: **NEEDS A LOOK**\n\n- **Latency SLO: FAIL** — ttft_s_p95")
    page = "/assets/" + "/".join(cost_metrics.key.path)
    assert f"[0001]({page}?view=partitions&partition={DATE}%7C0001)" in mat.metadata["scorecard"].value
    doc = json.loads((Path(day.root) / "cost_rollup" / f"date={DATE}" / "scorecard.json").read_text())
    assert doc["slo_passed"] is False and doc["failed_shards"] == list(SHARDS)  # each shard breaches too
    assert pq.read_table(day.table("cost_rollup")).num_rows == 1


def test_a_finished_shard_run_asks_for_its_day_to_be_rerolled(tmp_path):
    day, resources, instance = _layout(tmp_path), _resources(tmp_path), _instance()
    _write_shard(day, "0001", n=2, ttft_s=FAST, wall_s=1.0)
    run = _meter(resources, "0001", instance)
    ctx = dg.build_run_status_sensor_context(sensor_name="kvbatch_rollup_after_shard", dagster_instance=instance,
                                             dagster_run=run.dagster_run, dagster_event=run.get_run_success_event())
    request = rollup_after_shard(ctx)
    assert request.partition_key == DATE and request.run_key == f"rollup-{run.run_id}"
    assert rollup_after_shard.job_name == "kvbatch_rollup"
    assert json.loads(json.dumps(request.tags)) == {"kvbatch/shard_run": run.run_id}
    # What `make demo` waits with between launched runs: the finished run, or a clear timeout.
    assert wait_for_run(run.run_id, instance).status == dg.DagsterRunStatus.SUCCESS
    with pytest.raises(TimeoutError, match="run nope not finished .* not in the instance"):
        wait_for_run("nope", instance, poll_s=0.01, timeout_s=0.05)


def test_which_checks_block():
    """pipelines/check_policy.py: the ingest and decode quality checks and the day's SLO block;
    a shard's SLO only warns, so the day's rollup still counts a slow shard."""
    from kvbatch.pipelines.default import decode_results, prompts

    def blocking(asset) -> dict[str, bool]:
        return {spec.name: spec.blocking for spec in asset.check_specs}

    assert blocking(prompts) == {"reject_rate_below_threshold": True, "unique_custom_ids": True}
    assert blocking(decode_results) == {"one_result_per_custom_id": True, "output_within_max_tokens": True}
    assert blocking(cost_metrics) == {"latency_p95_within_slo": False}
    assert blocking(cost_rollup) == {"latency_p95_within_slo": True}
    assert all("Blocking" in spec.description for spec in [*decode_results.check_specs, *cost_rollup.check_specs])


def test_a_failed_shard_run_also_asks_for_its_day_to_be_rerolled(tmp_path):
    """A shard run that failed (here: no decode stats to meter) re-rolls its day through the
    failure sensor, with the same request the success sensor makes, so the scorecard lists the
    shard as needing a look; the job launcher says how it ended and exits 1 (no check failed)."""
    from kvbatch.pipelines import automation
    from kvbatch.pipelines.default import PIPELINE

    day, resources, instance = _layout(tmp_path), _resources(tmp_path), _instance()
    _write_shard(day, "0001", n=2, ttft_s=FAST, wall_s=1.0)
    Path(day.shard("decode_stats", "0001", "stats.json")).unlink()
    run = dg.materialize([cost_metrics], resources=resources, partition_key=date_shard_key(DATE, "0001"),
                         instance=instance, raise_on_error=False)
    assert not run.success
    failed_sensor = PIPELINE.sensors["kvbatch_rollup_after_failed_shard"]
    assert failed_sensor.job_name == "kvbatch_rollup"
    ctx = dg.build_run_status_sensor_context(sensor_name=failed_sensor.name, dagster_instance=instance,
                                             dagster_run=run.dagster_run, dagster_event=run.get_run_failure_event())
    request = failed_sensor(ctx)
    assert request.partition_key == DATE and request.run_key == f"rollup-{run.run_id}"
    assert json.loads(json.dumps(request.tags)) == {"kvbatch/shard_run": run.run_id}
    assert automation.failed_checks(instance, run.run_id) == []
    assert automation.main([run.run_id], instance) == 1


def test_the_job_launcher_names_failed_checks_and_exits_3(tmp_path, capsys):
    """`make demo` waits on each run with automation.main: a run with a failed check (a WARN one
    here, so the run itself is green) prints the check and exits 3, as demo_report does for a
    day that did not pass; a run whose checks passed exits 0."""
    from kvbatch.pipelines import automation

    day, resources, instance = _layout(tmp_path), _resources(tmp_path), _instance()
    _write_shard(day, "0000", n=4, ttft_s=FAST, wall_s=1.0)
    _write_shard(day, "0001", n=4, ttft_s=SLOW, wall_s=1.0)
    fast, slow = _meter(resources, "0000", instance), _meter(resources, "0001", instance)
    assert fast.success and slow.success
    assert automation.main([fast.run_id], instance) == 0
    capsys.readouterr()
    assert automation.failed_checks(instance, slow.run_id) == ["kvbatch/cost_metrics latency_p95_within_slo (WARN)"]
    assert automation.main([slow.run_id], instance) == automation.CHECK_FAILED == 3
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == "  failed check: kvbatch/cost_metrics latency_p95_within_slo (WARN)"
    assert out[0].endswith(f"{DATE}|0001 SUCCESS")
