"""``cost_rollup``: one row per day, the sum of the day's ``cost_metrics`` shards.

It reads the per-shard cost rows (and the day's per-request latencies from the results), never
anything the shards' steps held in memory, so a re-run of one shard followed by a re-run of the
rollup (``rollup_after_shard`` starts it) gives the day's figures with that shard replaced.
Its numeric metadata uses the same stable keys as ``cost_metrics``, so the asset's plots are the
night-by-night history of $/Mtok, P95s and hit rates.
"""


import dagster as dg

from kvbatch.io.shard_tables import write_table
from kvbatch.pipelines.assets import IO_RETRY, OWNERS, cost_metadata, cost_metrics, fmt_usd, table_metadata
from kvbatch.pipelines.checks import DAY_SLO_CHECK, SLOConfig, slo_check_result
from kvbatch.pipelines.layout import DayLayout
from kvbatch.pipelines.partitions import check_date, date_partitions, shard_to_date
from kvbatch.resources import ObjectStoreResource

ROLLUP_SHARD_COLUMNS = ("requests", "billable_tokens", "cost_usd", "usd_per_mtok_blended", "ttft_s_p95", "tpot_s_p95")


@dg.asset(group_name="kvbatch", partitions_def=date_partitions, retry_policy=IO_RETRY,
          deps=[dg.AssetDep(cost_metrics, partition_mapping=shard_to_date)], check_specs=[DAY_SLO_CHECK],
          kinds={"polars", "parquet"}, owners=OWNERS)
def cost_rollup(context: dg.AssetExecutionContext, config: SLOConfig, object_store: ObjectStoreResource):
    """The day's cost in one row, ``cost_rollup/date=D/part.parquet``: tokens and dollars by class,
    total, $/Mtok by class and blended, cache hit rate by tier, speculative acceptance, and TTFT/TPOT
    p50/p95/p99 over every request of the day; summed with polars from the committed
    ``cost_metrics`` shards. The check holds the day's P95s against the SLO."""
    import polars as pl
    import pyarrow as pa

    from kvbatch.io.shard_tables import read_shards
    from kvbatch.ops.results.cost import ROLLUP_SCHEMA, day_rollup

    day, opts = DayLayout(object_store.url, check_date(context.partition_key)), object_store.storage_options()
    metrics = pl.from_arrow(read_shards(day.root, day.folder("cost_metrics"), storage_options=opts))
    latencies = read_shards(day.root, day.folder("results"), storage_options=opts, columns=["ttft_s", "tpot_s"])
    if not latencies.num_columns:  # no shard decoded yet
        latencies = pa.table({c: pa.array([], pa.float64()) for c in ("ttft_s", "tpot_s")})
    latencies = pl.from_arrow(latencies)
    row = day_rollup(metrics, latencies)
    write_table(pa.Table.from_pylist([row], ROLLUP_SCHEMA), day.table("cost_rollup"), storage_options=opts)
    meta = cost_metadata(row)
    meta["shards"] = row["shards"]
    meta["shard_figures"] = _shard_table(metrics)
    meta["dagster/row_count"] = 1
    yield dg.MaterializeResult(metadata=meta)
    yield slo_check_result(row, config)


def _shard_table(metrics) -> dg.MetadataValue:
    """The day's shards side by side (a table, not a JSON blob), with units in the headers."""
    rows = []
    for r in metrics.sort("shard").select(["shard", *ROLLUP_SHARD_COLUMNS]).to_dicts():
        rows.append({"shard": r["shard"], "requests": int(r["requests"]), "billable tokens": int(r["billable_tokens"]),
                     "cost ($)": fmt_usd(r["cost_usd"]),
                     "$ per Mtok (blended)": fmt_usd(r["usd_per_mtok_blended"]),
                     "TTFT p95 (s)": "–" if r["ttft_s_p95"] is None else f"{r['ttft_s_p95']:.3f}",
                     "TPOT p95 (s)": "–" if r["tpot_s_p95"] is None else f"{r['tpot_s_p95']:.3f}"})
    return table_metadata({"shard": "string", "requests": "int", "billable tokens": "int", "cost ($)": "string",
                           "$ per Mtok (blended)": "string", "TTFT p95 (s)": "string", "TPOT p95 (s)": "string"},
                          rows)


ROLLUP_ASSETS = [cost_rollup]
