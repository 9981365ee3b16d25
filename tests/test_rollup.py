"""``cost_metrics`` and ``cost_rollup`` as Dagster runs them, on shard inputs written by hand (a
results table and the prefill/decode stats per shard: what prefill_kv and decode_results commit),
so no model runs: the day's rollup equals the sum of its shards' cost rows, also after one shard
is re-run with other figures; the P95 SLO check fails on slow data and passes on fast data, with
the configured severity, against its own partition; ``rollup_after_shard`` asks for the re-roll;
``wait_for_run`` (what ``make demo`` waits with) returns the finished run."""

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
from kvbatch.pipelines.assets import cost_metrics
from kvbatch.pipelines.automation import rollup_after_shard, wait_for_run
from kvbatch.pipelines.layout import DayLayout
from kvbatch.pipelines.partitions import date_shard_key
from kvbatch.pipelines.rollup import cost_rollup
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
    # What prompt_shards writes beside the shards: the day has these shards (the others are no-ops).
    write_shard_count(ShardCount(day.date, num_shards=len(SHARDS), rows=2 * len(SHARDS), max_rows_per_shard=2,
                                 max_shards=1024), day.table("shards", SHARD_COUNT_FILE))


def _resources(root: Path) -> dict:
    return {"object_store": ObjectStoreResource(url=str(root)), "decode_cluster": DecodeClusterResource(),
            "pricing": PricingResource(usd_per_device_hour={"cpu-host": 3.6})}


def _slo(ttft: float, severity: str = "WARN") -> dict:
    return {"config": {"ttft_s_p95_max": ttft, "tpot_s_p95_max": 1.0, "slo_severity": severity}}


def _meter(resources: dict, shard: str, instance, ttft_slo: float = 1.0, severity: str = "WARN"):
    return dg.materialize([cost_metrics], resources=resources, partition_key=date_shard_key(DATE, shard),
                          instance=instance, run_config={"ops": {"cost_metrics": _slo(ttft_slo, severity)}})


def _roll(resources: dict, instance, ttft_slo: float = 1.0, severity: str = "WARN"):
    return dg.materialize([cost_rollup], resources=resources, partition_key=DATE, instance=instance,
                          run_config={"ops": {"cost_rollup": _slo(ttft_slo, severity)}})


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
    day, resources, instance = DayLayout(str(tmp_path), DATE), _resources(tmp_path), dg.DagsterInstance.ephemeral()
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

    meta = rerolled.asset_materializations_for_node("cost_rollup")[0].metadata
    assert meta["requests"].value == 5 and meta["cost_usd"].value == float(f"{after['cost_usd']:.4g}")  # 4 digits
    assert isinstance(meta["shard_figures"], dg.TableMetadataValue)
    assert [r.data["shard"] for r in meta["shard_figures"].records] == list(SHARDS)
    assert "spec_acceptance_pct" not in meta and "expert_load_balancedness_pct" not in meta  # not applicable
    summary = meta["summary"].value
    assert "| token class | tokens | cost | $ per Mtok |" in summary and "█" not in summary and "```" not in summary


def test_slo_check_fails_on_slow_data_and_passes_on_fast(tmp_path):
    day, resources, instance = DayLayout(str(tmp_path), DATE), _resources(tmp_path), dg.DagsterInstance.ephemeral()
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


def test_a_finished_shard_run_asks_for_its_day_to_be_rerolled(tmp_path):
    day, resources, instance = DayLayout(str(tmp_path), DATE), _resources(tmp_path), dg.DagsterInstance.ephemeral()
    _write_shard(day, "0001", n=2, ttft_s=FAST, wall_s=1.0)
    run = _meter(resources, "0001", instance)
    ctx = dg.build_run_status_sensor_context(sensor_name="rollup_after_shard", dagster_instance=instance,
                                             dagster_run=run.dagster_run, dagster_event=run.get_run_success_event())
    request = rollup_after_shard(ctx)
    assert request.partition_key == DATE and request.run_key == f"rollup-{run.run_id}"
    assert rollup_after_shard.job_name == "kvbatch_rollup"
    assert json.loads(json.dumps(request.tags)) == {"kvbatch/shard_run": run.run_id}
    # What `make demo` waits with between launched runs: the finished run, or a clear timeout.
    assert wait_for_run(run.run_id, instance).status == dg.DagsterRunStatus.SUCCESS
    with pytest.raises(TimeoutError, match="run nope not finished .* not in the instance"):
        wait_for_run("nope", instance, poll_s=0.01, timeout_s=0.05)
