"""The asset graph: prompts -> prompt_shards -> prefill_kv -> decode_results -> cost_metrics.

Wiring only: each asset calls a plain-Python step in ``kvbatch.ops`` and reports metadata.
``prompts`` and ``prompt_shards`` are partitioned by date, the rest by date x shard (see
``partitions``). Tables live on the object store (``ObjectStoreResource.url``), hive-style
(see ``layout``), not in Dagster's IO managers:

    prompts/date=D/part.parquet, rejects/date=D/...            every input row, valid or rejected
    shards/date=D/shard=XXXX/part.parquet, shard_rejects/...   tokenized rows by hash of custom_id
    manifests/date=D/shard=XXXX/manifests.jsonl                prefill -> decode hand-off (KV in <kv url>)
    results/date=D/shard=XXXX/part.parquet                     one row per request
    cost_metrics/date=D/shard=XXXX/part.parquet                one row per shard
"""


import os
from typing import Literal

import dagster as dg
from pydantic import Field

from kvbatch.io.shard_tables import read_json, read_table, write_table
from kvbatch.pipelines.layout import DayLayout
from kvbatch.pipelines.partitions import (
    NUM_SHARDS,
    check_date,
    date_partitions,
    date_shard_partitions,
    shard_to_date,
    split_date_shard,
)
from kvbatch.resources import (
    DecodeClusterResource,
    KVStoreResource,
    ModelResource,
    ObjectStoreResource,
    PricingResource,
)

IO_RETRY = dg.RetryPolicy(max_retries=3, delay=2, backoff=dg.Backoff.EXPONENTIAL, jitter=dg.Jitter.PLUS_MINUS)
STEP_RETRY = dg.RetryPolicy(max_retries=1, delay=5, backoff=dg.Backoff.EXPONENTIAL)
REJECTS_SHOWN = 20


NIGHTLY_DATASET_ENV = "KVBATCH_NIGHTLY_DATASET"


class PromptsConfig(dg.Config):
    """Which dataset to ingest into the run's date partition, launch by launch."""

    url: str | None = Field(default=None, description=(
        "dataset: s3://..., file://... or a local path; .jsonl(.gz) or .parquet. Default: the nightly "
        "dataset, KVBATCH_NIGHTLY_DATASET with {date} replaced by the partition's date"))
    format: Literal["auto", "jsonl", "parquet"] = Field(default="auto", description="auto: from the extension")
    columns: dict[str, str] = Field(default_factory=dict,
                                    description="Parquet only: field -> column, e.g. {custom_id: id, prompt: text}")
    default_max_tokens: int = Field(default=256, ge=1, description="max_tokens for rows that give none")
    max_reject_rate: float = Field(default=0.05, ge=0, le=1, description="the reject-rate check fails above this")


def dataset_url(config: PromptsConfig, date: str) -> str:
    """The run config's URL (an ad-hoc dataset), else the nightly dataset of ``date``."""
    if config.url:
        return config.url
    template = os.environ.get(NIGHTLY_DATASET_ENV)
    if not template:
        raise ValueError(f"no dataset for {date}: give ops.prompts.config.url in the run config, "
                         f"or set {NIGHTLY_DATASET_ENV} (e.g. s3://bucket/in/{{date}}.jsonl)")
    return template.format(date=date)


def _day(context: dg.AssetExecutionContext, object_store: ObjectStoreResource) -> DayLayout:
    return DayLayout(object_store.url, check_date(context.partition_key))


def _day_shard(context: dg.AssetExecutionContext, object_store: ObjectStoreResource) -> tuple[DayLayout, str]:
    date, shard = split_date_shard(context.partition_key)
    return DayLayout(object_store.url, date), shard


def _head(url: str, opts: dict, rows: int, columns: list[str] | None = None):
    """The first ``rows`` rows of a Parquet table (tables can be large: never read them whole here)."""
    import fsspec
    import pyarrow as pa
    import pyarrow.parquet as pq

    with fsspec.open(url, "rb", **opts) as f:
        pf = pq.ParquetFile(f)
        batch = next(pf.iter_batches(batch_size=rows, columns=columns), None)
        return pa.Table.from_batches([batch]) if batch is not None else pf.schema_arrow.empty_table()


def _duplicates(url: str, opts: dict) -> tuple[int, list[str]]:
    """(rows beyond the first of each custom_id, the repeated ids) of a table, reading only that column."""
    import fsspec
    import polars as pl
    import pyarrow.parquet as pq

    with fsspec.open(url, "rb", **opts) as f:
        ids = pl.from_arrow(pq.read_table(f, columns=["custom_id"]))
    counts = ids.group_by("custom_id").len().filter(pl.col("len") > 1).sort("custom_id")
    return int((counts["len"] - 1).sum()), counts["custom_id"].to_list()


def _rejects_metadata(table) -> dict[str, dg.MetadataValue]:
    schema = dg.TableSchema(columns=[dg.TableColumn("row", "int"), dg.TableColumn("custom_id", "string"),
                                     dg.TableColumn("field", "string"), dg.TableColumn("reason", "string")])
    records = [dg.TableRecord({k: ("" if v is None else v) for k, v in r.items()})
               for r in table.slice(0, REJECTS_SHOWN).to_pylist()]
    return {"rejects_preview": dg.MetadataValue.table(records, schema=schema)}


@dg.asset(
    group_name="kvbatch",
    partitions_def=date_partitions,
    retry_policy=IO_RETRY,
    check_specs=[dg.AssetCheckSpec("reject_rate_below_threshold", asset="prompts"),
                 dg.AssetCheckSpec("unique_custom_ids", asset="prompts")],
)
def prompts(context: dg.AssetExecutionContext, config: PromptsConfig, object_store: ObjectStoreResource):
    """Every row of the day's dataset, validated and streamed (never held whole in memory): valid
    rows normalized to ``prompts/date=D/part.parquet``, the others to ``rejects/date=D/part.parquet``
    with (row, custom_id, field, reason). Nothing is dropped."""
    from kvbatch.ops.ingest import ingest

    day, opts = _day(context, object_store), object_store.storage_options()
    url = dataset_url(config, day.date)
    report = ingest(url, day.table("prompts"), day.table("rejects"), fmt=config.format,
                    columns=config.columns or None, default_max_tokens=config.default_max_tokens,
                    storage_options=object_store.options_for(url), output_storage_options=opts)
    # Ingest rejects a repeated custom_id (it is in the rejects table); this guards that the
    # table every later step reads holds each id once.
    dup, dup_ids = _duplicates(day.table("prompts"), opts)
    yield dg.MaterializeResult(metadata={
        "dagster/row_count": report.valid,
        "input_rows": report.rows,
        "rejected_rows": report.rejected,
        "reject_rate": report.reject_rate,
        "rejects_by_field": dg.MetadataValue.json(report.rejects_by_field),
        "dataset_url": dg.MetadataValue.path(url),
        "prompts_url": dg.MetadataValue.path(day.table("prompts")),
        "rejects_url": dg.MetadataValue.path(day.table("rejects")),
        **_rejects_metadata(_head(day.table("rejects"), opts, REJECTS_SHOWN)),
    })
    yield dg.AssetCheckResult(check_name="reject_rate_below_threshold",
                              passed=report.reject_rate <= config.max_reject_rate,
                              metadata={"reject_rate": report.reject_rate, "threshold": config.max_reject_rate})
    yield dg.AssetCheckResult(check_name="unique_custom_ids", passed=dup == 0,
                              metadata={"duplicates": dup, "duplicate_ids_preview": dg.MetadataValue.json(dup_ids[:20])})


class ShardsConfig(dg.Config):
    """How ``prompt_shards`` tokenizes; the shard files are the same whatever is chosen."""

    tokenize_workers: int | None = Field(default=None, ge=1, description=(
        "tokenizer processes (1: tokenize in the step's own process). Default: min(4, CPUs); "
        "tables under 16384 rows are tokenized in-process anyway"))


@dg.asset(group_name="kvbatch", deps=[prompts], partitions_def=date_partitions, retry_policy=IO_RETRY)
def prompt_shards(context: dg.AssetExecutionContext, config: ShardsConfig, object_store: ObjectStoreResource,
                  model: ModelResource):
    """The day's valid prompts tokenized (exactly as a sequential run would) and split by a stable
    hash of ``custom_id`` into the shard partitions: ``shards/date=D/shard=XXXX/part.parquet`` with
    messages, sampling params, prompt token ids and prefix block keys. Rows the chat template
    refuses or that exceed the context window go to ``shard_rejects/date=D/part.parquet``."""
    from kvbatch.ops.shards import build_shards

    day, opts = _day(context, object_store), object_store.storage_options()
    report = build_shards(model.load(), day.table("prompts"), day.root, NUM_SHARDS, table=day.folder("shards"),
                          rejects_url=day.table("shard_rejects"), storage_options=opts,
                          tokenize_workers=config.tokenize_workers)
    return dg.MaterializeResult(metadata={
        "dagster/row_count": report.tokenized,
        "num_shards": NUM_SHARDS,
        "prompt_tokens": report.prompt_tokens,
        "rejected_rows": report.rejected,
        "rows_by_shard": dg.MetadataValue.json(report.rows_by_shard),
        "prompt_tokens_by_shard": dg.MetadataValue.json(report.prompt_tokens_by_shard),
        "shards_url": dg.MetadataValue.path(day.root + "/" + day.folder("shards")),
        **_rejects_metadata(_head(day.table("shard_rejects"), opts, REJECTS_SHOWN)),
    })


def _kv(object_store: ObjectStoreResource, model: ModelResource, kv_store: KVStoreResource):
    return kv_store.open(object_store.url, object_store.storage_options(), model.kv_fingerprint())


SHARD_DEPS_ON_DAY = dg.AssetDep(prompt_shards, partition_mapping=shard_to_date)


@dg.asset(group_name="kvbatch", deps=[SHARD_DEPS_ON_DAY], partitions_def=date_shard_partitions,
          retry_policy=STEP_RETRY, pool="gpu")
def prefill_kv(context: dg.AssetExecutionContext, object_store: ObjectStoreResource, model: ModelResource,
               kv_store: KVStoreResource):
    """The (date, shard)'s prompt KV blocks in the tiered KV store (each block once, under its
    content key, shared across days) and the decode manifests, ``manifests/date=D/shard=XXXX/manifests.jsonl``."""
    from kvbatch.ops.results import prefill_shard

    (day, shard), opts = _day_shard(context, object_store), object_store.storage_options()
    llm = model.load(_kv(object_store, model, kv_store))
    stats = prefill_shard(llm, day.shard("shards", shard), day.shard("manifests", shard, "manifests.jsonl"),
                          stats_url=day.shard("prefill_stats", shard, "stats.json"), model_name=model.model,
                          storage_options=opts)
    conn = stats["connector"]
    return dg.MaterializeResult(metadata={
        "requests": stats["requests"],
        "prompt_tokens": stats["prompt_tokens"],
        "prompt_tokens_computed": stats["prompt_tokens_computed"],
        "prompt_tokens_already_stored": stats["prompt_tokens_already_stored"],
        "kv_blocks_written": conn["blocks_written"],
        "kv_bytes_written": conn["kv_bytes_written"],
        "prefill_wall_s": stats["wall_s"],
    })


@dg.asset(
    group_name="kvbatch", deps=[prefill_kv], partitions_def=date_shard_partitions, retry_policy=STEP_RETRY,
    pool="gpu",
    check_specs=[dg.AssetCheckSpec("one_result_per_custom_id", asset="decode_results"),
                 dg.AssetCheckSpec("output_within_max_tokens", asset="decode_results")],
)
def decode_results(context: dg.AssetExecutionContext, object_store: ObjectStoreResource, model: ModelResource,
                   kv_store: KVStoreResource, decode_cluster: DecodeClusterResource,
                   pipes_subprocess_client: dg.PipesSubprocessClient):
    """One row per request of the (date, shard), ``results/date=D/shard=XXXX/part.parquet``:
    custom_id, text, token ids, finish_reason, usage and timings; decoded from the stored prompt
    KV, in process, or by a worker group launched through Dagster Pipes (``decode_cluster``:
    a subprocess, ``world_size`` ranks under torchrun, or a Kubernetes pod).
    Committed whole: a re-run replaces the shard, a crash leaves the last good commit."""
    from kvbatch.ops.results import decode_shard

    (day, shard), opts = _day_shard(context, object_store), object_store.storage_options()
    manifests = day.shard("manifests", shard, "manifests.jsonl")
    results_url = day.shard("results", shard)
    stats_url = day.shard("decode_stats", shard, "stats.json")
    piped = decode_cluster.launcher != "in_process"
    if piped:
        import dataclasses

        spec = {"model": model.model, "dtype": model.dtype, "seed": model.seed, "threads": model.threads,
                "engine": dataclasses.asdict(model.engine_config()), "kv_fingerprint": model.kv_fingerprint(),
                "kv_store": kv_store.store_config(day.root, opts).model_dump(), "manifests_url": manifests,
                "results_url": results_url, "stats_url": stats_url, "storage_options": opts,
                "speculative": model.speculative()}
        yield from decode_cluster.run(context, spec, pipes_subprocess_client)
        stats = read_json(stats_url, storage_options=opts)
    else:
        llm = model.load(_kv(object_store, model, kv_store), decode=True)
        stats = decode_shard(llm, manifests, results_url, stats_url=stats_url, storage_options=opts)
    results = read_table(results_url, storage_options=opts)
    problems = _result_problems(results, read_table(day.shard("shards", shard), storage_options=opts))
    if piped:  # the worker's rank 0 reported the materialization through Pipes
        yield from _decode_checks(problems)
        return
    yield dg.MaterializeResult(metadata={
        "dagster/row_count": results.num_rows,
        "output_tokens": stats["output_tokens"],
        "prompt_tokens": stats["prompt_tokens"],
        "loaded_prompt_tokens": stats["loaded_prompt_tokens"],
        "decode_wall_s": stats["wall_s"],
        "output_tokens_per_s": stats["output_tokens_per_s"],
        "ttft_s_p50": stats["ttft_s_p50"] or 0.0,
        "tpot_s_p50": stats["tpot_s_p50"] or 0.0,
        "results_url": dg.MetadataValue.path(results_url),
        "decode_world_size": decode_cluster.world_size,
    })
    yield from _decode_checks(problems)


def _result_problems(results, shard) -> dict[str, list[str] | int]:
    """What the decode checks look for, results against the shard's rows: ids with no result,
    results of no shard row, ids answered more than once (rows beyond the first), and results
    longer than the request's own ``max_tokens``. The limit is the shard's, not the one the
    results carry: those come from the manifest, so a hand-off that loosened it would pass."""
    import polars as pl

    got = pl.from_arrow(results.select(["custom_id", "completion_tokens"]))
    want = pl.from_arrow(shard.select(["custom_id", "max_tokens"]))
    counts = got.group_by("custom_id").len().filter(pl.col("len") > 1)
    over = got.join(want, on="custom_id").filter(pl.col("completion_tokens") > pl.col("max_tokens"))
    return {
        "missing": want.join(got, on="custom_id", how="anti")["custom_id"].sort().to_list(),
        "unexpected": got.join(want, on="custom_id", how="anti")["custom_id"].unique().sort().to_list(),
        "duplicated": counts["custom_id"].sort().to_list(),
        "duplicates": int((counts["len"] - 1).sum()),
        "over_limit": over["custom_id"].unique().sort().to_list(),
    }


def _decode_checks(p: dict):
    def preview(key: str) -> dg.MetadataValue:
        return dg.MetadataValue.json(p[key][:20])

    yield dg.AssetCheckResult(
        check_name="one_result_per_custom_id", passed=not (p["missing"] or p["unexpected"] or p["duplicates"]),
        metadata={"missing": len(p["missing"]), "unexpected": len(p["unexpected"]), "duplicates": p["duplicates"],
                  "missing_ids_preview": preview("missing"), "unexpected_ids_preview": preview("unexpected"),
                  "duplicate_ids_preview": preview("duplicated")})
    yield dg.AssetCheckResult(check_name="output_within_max_tokens", passed=not p["over_limit"],
                              metadata={"over_limit": len(p["over_limit"]), "ids_preview": preview("over_limit")})


@dg.asset(group_name="kvbatch", deps=[decode_results], partitions_def=date_shard_partitions, retry_policy=IO_RETRY)
def cost_metrics(context: dg.AssetExecutionContext, object_store: ObjectStoreResource, pricing: PricingResource,
                 decode_cluster: DecodeClusterResource):
    """One row per (date, shard), ``cost_metrics/date=D/shard=XXXX/part.parquet``: tokens by class,
    KV cache hits by tier, TTFT/TPOT p50/p95, speculative acceptance, expert-load balancedness,
    prefill/decode wall seconds, device seconds and dollars."""
    from kvbatch.ops.cost import metrics_table, shard_metrics

    (day, shard), opts = _day_shard(context, object_store), object_store.storage_options()
    row = shard_metrics(read_table(day.shard("results", shard), storage_options=opts),
                        read_json(day.shard("prefill_stats", shard, "stats.json"), storage_options=opts),
                        read_json(day.shard("decode_stats", shard, "stats.json"), storage_options=opts),
                        pricing.pricing(decode_cluster.world_size))
    write_table(metrics_table(row), day.shard("cost_metrics", shard), storage_options=opts)
    # Stable numeric keys: the UI plots them over time; plus a readable table and a token chart.
    metadata: dict = {k: (0.0 if v is None else v) for k, v in row.items()}
    metadata["summary"] = dg.MetadataValue.md(_cost_markdown(row))
    return dg.MaterializeResult(metadata=metadata)


_SUMMARY_KEYS = ("requests", "prompt_tokens", "output_tokens", "ttft_s_p50", "ttft_s_p95", "tpot_s_p50",
                 "tpot_s_p95", "spec_acceptance_rate", "spec_tokens_per_target_step", "spec_drafter_time_share",
                 "expert_load_balancedness",
                 "prefill_wall_s", "decode_wall_s", "device_s", "kv_bytes_written", "kv_bytes_read",
                 "cost_compute_usd", "cost_storage_usd", "cost_transfer_usd", "cost_usd")
_TOKEN_CLASSES = (("computed at prefill", "prompt_tokens_prefill_computed"),
                  ("already stored", "prompt_tokens_prefill_already_stored"),
                  ("loaded at decode", "prompt_tokens_decode_loaded"),
                  ("prefix-cache hits at decode", "prompt_tokens_decode_cached"),
                  ("computed at decode", "prompt_tokens_decode_computed"),
                  ("output", "output_tokens"))


def _cost_markdown(row: dict) -> str:
    """The shard's figures as a markdown table, and its tokens by class as a bar chart."""
    lines = ["| metric | value |", "|---|---|"]
    lines += [f"| {k} | {'–' if row.get(k) is None else row[k]} |" for k in _SUMMARY_KEYS if k in row]
    counts = [(label, int(row.get(key) or 0)) for label, key in _TOKEN_CLASSES]
    top = max((c for _, c in counts), default=0) or 1
    lines += ["", "Tokens by class:", "", "```"]
    lines += [f"{label:<28} {'█' * max(0, round(30 * c / top)):<30} {c}" for label, c in counts]
    lines.append("```")
    return "\n".join(lines)


ASSETS = [prompts, prompt_shards, prefill_kv, decode_results, cost_metrics]
