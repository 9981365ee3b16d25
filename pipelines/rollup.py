"""``cost_rollup``: one row per day, the sum of the day's ``cost_metrics`` shards.

It reads the day's committed tables (cost rows, results, shard and reject counts), never
anything the shards' steps held in memory, so a re-run of one shard followed by a re-run of the
rollup (``rollup_after_shard`` starts it) gives the day's figures with that shard replaced.
The page shows the day's scorecard (``kvbatch.ops.results.scorecard``); only the curated figures
are numeric metadata (``scorecard_metadata.PLOTTED``), so the asset's plots are the night-by-night
history of cost, tokens/s, KV hit rate and the P95s.
"""


from typing import TYPE_CHECKING

import dagster as dg

from kvbatch.io.shard_tables import write_table
from kvbatch.pipelines.assets import IO_RETRY
from kvbatch.pipelines.checks import SLOConfig, day_slo_check, slo_check_result
from kvbatch.pipelines.layout import DayLayout
from kvbatch.pipelines.partitions import check_date, date_partitions, shard_to_date
from kvbatch.resources import ObjectStoreResource

if TYPE_CHECKING:
    from kvbatch.pipelines.factory import PipelineParts


def cost_rollup_step(context: dg.AssetExecutionContext, config: SLOConfig, object_store: ObjectStoreResource):
    """The night at a glance: the day's scorecard (SLO pass/fail and the shards that need a look at
    the top; rows, tokens, cache hit rate by tier, tokens/s, wall time, $ and $/Mtok against the
    hosted batch price), also written as `scorecard.md` and `scorecard.json` beside
    `cost_rollup/date=D/part.parquet`, the day's cost in one row summed with polars from the
    committed `cost_metrics` shards. Plotted night by night: cost_usd, tokens_per_s,
    kv_hit_rate_pct, ttft_s_p95, tpot_s_p95. The check holds the day's P95s against the SLO."""
    import pyarrow as pa

    from kvbatch.io.shard_tables import join
    from kvbatch.ops.results.cost import ROLLUP_SCHEMA, day_rollup
    from kvbatch.ops.results.day_tables import read_day
    from kvbatch.ops.results.metrics import LatencySLO
    from kvbatch.ops.results.scorecard import build_scorecard, write_scorecard
    from kvbatch.pipelines.scorecard_metadata import scorecard_metadata, shard_link

    day, opts = DayLayout(object_store.url, check_date(context.partition_key)), object_store.storage_options()
    tables = read_day(day.root, day.date, storage_options=opts)
    row = day_rollup(tables.metrics, tables.results.select(["ttft_s", "tpot_s"]))
    write_table(pa.Table.from_pylist([row], ROLLUP_SCHEMA), day.table("cost_rollup"), storage_options=opts)
    # The scorecard beside the day's Parquet (scorecard.md, scorecard.json) and on this page.
    card = build_scorecard(tables, LatencySLO(config.ttft_s_p95_max, config.tpot_s_p95_max))
    link = shard_link(_shard_asset_path(context), day.date)
    md_url, json_url = write_scorecard(card, join(day.root, day.folder("cost_rollup")), storage_options=opts,
                                       shard_link=link)
    if not card.passed:
        context.log.warning(card.headline())
    yield dg.MaterializeResult(metadata=scorecard_metadata(card, tables.metrics, link=link, md_url=md_url,
                                                           json_url=json_url))
    yield slo_check_result(row, config)


def _shard_asset_path(context: dg.AssetExecutionContext) -> list[str]:
    """The key of the (date, shard) cost asset this rollup reads, whatever prefix the pipeline
    gives its keys: the dependency named ``cost_metrics``."""
    deps = [k.path for k in context.assets_def.dependency_keys if k.path[-1] == "cost_metrics"]
    return list(deps[0]) if deps else [*context.asset_key.path[:-1], "cost_metrics"]


def build_rollup_assets(p: "PipelineParts") -> list[dg.AssetsDefinition]:
    """One pipeline's ``[name, "cost_rollup"]`` (the body above, its resources under the pipeline's keys)."""
    return [p.asset(cost_rollup_step, name="cost_rollup", config=p.slo_config, partitions_def=date_partitions,
                    retry_policy=IO_RETRY, deps=[dg.AssetDep(p.key("cost_metrics"), partition_mapping=shard_to_date)],
                    check_specs=[day_slo_check(p.name)], kinds={"polars", "parquet"})]
