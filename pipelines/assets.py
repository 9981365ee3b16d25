"""The asset graph of one pipeline: prompts -> prompt_shards -> prefill_kv -> decode_results ->
cost_metrics (-> cost_rollup, the day's sum, in ``rollup``), each ``[<name>, asset]``.

The steps are plain functions (``prompts_step``...) taking their resources by kind;
:func:`build_assets` makes them one pipeline's assets (``factory.PipelineParts``: keys, group,
resource keys, config defaults). Tables are under the pipeline's folder of the object store.

Wiring only: each asset calls a plain-Python step in ``kvbatch.ops`` and reports metadata.
``prompts`` and ``prompt_shards`` are partitioned by date, the rest by date x shard (see
``partitions``). Tables live on the object store (``ObjectStoreResource.url``), hive-style
(see ``layout``), not in Dagster's IO managers:

    prompts/date=D/part.parquet, rejects/date=D/...            every input row, valid or rejected
    shards/date=D/shard=XXXX/part.parquet, shard_rejects/...   tokenized rows by hash of custom_id
    shards/date=D/_shard_count.json                            the date's shard count n and what chose it
    manifests/date=D/shard=XXXX/manifests.jsonl                prefill -> decode hand-off (KV in <kv url>)
    results/date=D/shard=XXXX/part.parquet                     one row per request
    decode_parts/date=D/shard=XXXX/part-*.parquet              decode's checkpoints, gone once results commit
    cost_metrics/date=D/shard=XXXX/part.parquet                one row per shard

A date has n shards (``prompt_shards`` chooses n from its row count and adds exactly the day's
n (date, shard) keys, ``partitions``): a (date, shard) of a shard >= n (a key a re-sharding
deleted, run anyway) does nothing (no materialization, no table, the run succeeds; downstream
steps are skipped) and says so in the log and in an observation of the asset. They are written
with ``output_required=False``, and the two with checks as single-asset ``multi_asset(can_subset=True)``: an ``@asset`` with check specs
fails its step when it yields nothing (its check outputs stay required), while a subsettable
one leaves the checks planned, which the UI shows as skipped.

Metadata: numbers under stable keys with their unit in the name (``_s``, ``_mib``, ``_pct``,
``_usd``, ``_per_s``) and at a readable precision, so the UI plots them across partitions;
per-shard figures as tables; a figure that does not apply (no speculation, no MoE) is left out
rather than recorded as 0.
"""


import os
from typing import TYPE_CHECKING, Literal

import dagster as dg
from pydantic import Field

from kvbatch.io.shard_tables import read_json, read_table, write_table
from kvbatch.ops.results.metrics import ProgressMeter
from kvbatch.ops.results.scorecard import fmt_usd
from kvbatch.ops.shards.routing import (
    DEFAULT_MAX_ROWS_PER_SHARD,
    SHARD_COUNT_FILE,
    ShardCount,
    read_shard_count,
    shards_for_rows,
    write_shard_count,
)
from kvbatch.pipelines.checks import SLOConfig, decode_checks, prompts_checks, shard_slo_check, slo_check_result
from kvbatch.pipelines.last_night import SUFFIX_LAST_NIGHT, resolve_last_night
from kvbatch.pipelines.layout import DayLayout
from kvbatch.pipelines.partitions import (
    MAX_SHARDS,
    check_date,
    date_partitions,
    register_day_shards,
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

if TYPE_CHECKING:
    from kvbatch.pipelines.factory import PipelineParts

IO_RETRY = dg.RetryPolicy(max_retries=3, delay=2, backoff=dg.Backoff.EXPONENTIAL, jitter=dg.Jitter.PLUS_MINUS)
STEP_RETRY = dg.RetryPolicy(max_retries=1, delay=5, backoff=dg.Backoff.EXPONENTIAL)
REJECTS_SHOWN = 20
RESULTS_SHOWN = 10
MIB = 2 ** 20


def mib(n_bytes: float) -> float:
    """Bytes as MiB, two decimals (a metadata value a person reads)."""
    return round(n_bytes / MIB, 2)


def pct(fraction: float) -> float:
    """A 0..1 fraction as a percentage, two decimals."""
    return round(100.0 * fraction, 2)


def usd(amount: float) -> float:
    """Dollars at four significant digits: cents for a night, micro-dollars for a tiny shard."""
    return float(f"{amount:.4g}")


def markdown_table(header: tuple[str, ...], rows: list[tuple]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def table_metadata(columns: dict[str, str], records: list[dict]) -> dg.MetadataValue:
    """Rows as a Dagster table (shown as a table, not a JSON blob); ``columns``: name -> type."""
    schema = dg.TableSchema(columns=[dg.TableColumn(n, t) for n, t in columns.items()])
    return dg.MetadataValue.table([dg.TableRecord(r) for r in records], schema=schema)


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
    """The run config's URL (an ad-hoc dataset, or the pipeline's ``input`` as its default), else
    ``KVBATCH_NIGHTLY_DATASET``; ``{date}`` in either is the partition's date."""
    template = config.url or os.environ.get(NIGHTLY_DATASET_ENV)
    if not template:
        raise ValueError(f"no dataset for {date}: give ops.<pipeline>__prompts.config.url in the run config, the "
                         f"pipeline's input, or set {NIGHTLY_DATASET_ENV} (e.g. s3://bucket/in/{{date}}.jsonl)")
    return template.replace("{date}", date)


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


def prompts_step(context: dg.AssetExecutionContext, config: PromptsConfig, object_store: ObjectStoreResource):
    """Every row of the day's dataset, validated and streamed (never held whole in memory): valid
    rows normalized to ``prompts/date=D/part.parquet``, the others to ``rejects/date=D/part.parquet``
    with (row, custom_id, field, reason). Nothing is dropped."""
    from kvbatch.ops.ingest.prompts import ingest

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
        "reject_rate_pct": pct(report.reject_rate),
        **({"rejects_by_field": table_metadata({"field": "string", "rejected_rows": "int"}, [
            {"field": f, "rejected_rows": n} for f, n in sorted(report.rejects_by_field.items())])}
           if report.rejects_by_field else {}),
        "dataset_url": dg.MetadataValue.path(url),
        "prompts_url": dg.MetadataValue.path(day.table("prompts")),
        "rejects_url": dg.MetadataValue.path(day.table("rejects")),
        **_rejects_metadata(_head(day.table("rejects"), opts, REJECTS_SHOWN)),
    })
    yield dg.AssetCheckResult(check_name="reject_rate_below_threshold",
                              passed=report.reject_rate <= config.max_reject_rate,
                              metadata={"reject_rate_pct": pct(report.reject_rate),
                                        "threshold_pct": pct(config.max_reject_rate)})
    yield dg.AssetCheckResult(check_name="unique_custom_ids", passed=dup == 0,
                              metadata={"duplicates": dup, "duplicate_ids_preview": dg.MetadataValue.json(dup_ids[:20])})


MAX_ROWS_PER_SHARD_ENV = "KVBATCH_MAX_ROWS_PER_SHARD"
# Every (date, shard) table: what a re-sharded day must not keep for shards it no longer has.
SHARD_TABLES = ("shards", "manifests", "prefill_stats", "decode_parts", "results", "decode_stats", "cost_metrics")


class ShardsConfig(dg.Config):
    """How ``prompt_shards`` splits and tokenizes. The shard count follows the data; the shard rows
    are the same whichever tokenize path is chosen."""

    max_rows_per_shard: int = Field(
        default=int(os.environ.get(MAX_ROWS_PER_SHARD_ENV, DEFAULT_MAX_ROWS_PER_SHARD)), ge=1, description=(
            "a date gets ceil(valid rows / this) shards (at most KVBATCH_MAX_SHARDS); hash routing makes a "
            f"shard about this size. Default: {MAX_ROWS_PER_SHARD_ENV}, else {DEFAULT_MAX_ROWS_PER_SHARD}"))

    tokenize_path: Literal["columnar", "rows"] = Field(default="columnar", description=(
        "columnar: whole record batches in the step's process (template rendered once per "
        "conversation shape, distinct pieces tokenized on every core); rows: row by row, with workers"))
    tokenize_workers: int | None = Field(default=None, ge=1, description=(
        "rows path only: tokenizer processes (1: tokenize in the step's own process). Default: "
        "min(4, CPUs); tables under 16384 rows are tokenized in-process anyway"))


def prompt_shards_step(context: dg.AssetExecutionContext, config: ShardsConfig, object_store: ObjectStoreResource,
                  model: ModelResource):
    """The day's valid prompts tokenized (exactly as a sequential run would) and split by a stable
    hash of ``custom_id`` into n shards, n = ceil(valid rows / max_rows_per_shard):
    ``shards/date=D/shard=XXXX/part.parquet`` with messages, sampling params, prompt token ids and
    prefix block keys, and n in ``shards/date=D/_shard_count.json``. Rows the chat template refuses
    or that exceed the context window go to ``shard_rejects/date=D/part.parquet``."""
    from kvbatch.ops.shards.build import build_shards, remove_shards_from

    day, opts = _day(context, object_store), object_store.storage_options()
    rows = _row_count(day.table("prompts"), opts)  # the valid rows
    count = ShardCount(day.date, shards_for_rows(rows, config.max_rows_per_shard, MAX_SHARDS), rows,
                       config.max_rows_per_shard, MAX_SHARDS)
    # The tokenizer and the kept fingerprint only: no weights are loaded to tokenize.
    report = build_shards(model.row_tokenizer(), day.table("prompts"), day.root, count.num_shards,
                          table=day.folder("shards"), rejects_url=day.table("shard_rejects"), storage_options=opts,
                          tokenize_workers=config.tokenize_workers, path=config.tokenize_path)
    # The count first, then the clean-up: a crash between them leaves higher shards that are
    # already outside the count (no-ops), and the re-run removes them.
    write_shard_count(count, day.table("shards", SHARD_COUNT_FILE), storage_options=opts)
    # The day's (date, shard) partitions: exactly its n shards (partitions.py).
    dropped = register_day_shards(context.instance, _pipeline(context), day.date, count.num_shards)
    stale = {t: remove_shards_from(day.root, day.folder(t), count.num_shards, storage_options=opts)
             for t in SHARD_TABLES}
    removed = sorted({k for keys in stale.values() for k in keys})
    if removed:
        context.log.info(f"{day.date} now has {count.num_shards} shards: removed the tables of shards "
                         f"{removed[0]}..{removed[-1]} left by an earlier run")
    return dg.MaterializeResult(metadata={
        "dagster/row_count": report.tokenized,
        "num_shards": count.num_shards,
        # The target, not a bound: hash routing puts about this many rows in a shard, some more.
        "rows_per_shard_target": count.max_rows_per_shard,
        "rows_largest_shard": max((int(n) for n in report.rows_by_shard.values()), default=0),
        "stale_shards_removed": len(removed),
        "shard_partitions_removed": len(dropped),
        "prompt_tokens": report.prompt_tokens,
        "rejected_rows": report.rejected,
        "shards": table_metadata({"shard": "string", "rows": "int", "prompt_tokens": "int"}, [
            {"shard": k, "rows": int(report.rows_by_shard.get(k, 0)),
             "prompt_tokens": int(report.prompt_tokens_by_shard.get(k, 0))}
            for k in sorted(set(report.rows_by_shard) | set(report.prompt_tokens_by_shard))]),
        "shards_url": dg.MetadataValue.path(day.root + "/" + day.folder("shards")),
        "shard_count_url": dg.MetadataValue.path(day.table("shards", SHARD_COUNT_FILE)),
        **_rejects_metadata(_head(day.table("shard_rejects"), opts, REJECTS_SHOWN)),
    })


def _pipeline(context: dg.AssetExecutionContext) -> str:
    """The pipeline of a step: its asset key is ``[pipeline, asset]``."""
    return context.asset_key.path[-2]


def _kv(object_store: ObjectStoreResource, model: ModelResource, kv_store: KVStoreResource):
    # The KV store's default is the deployment's root, shared by every pipeline (factory.py).
    return kv_store.open(object_store.shared_url, object_store.storage_options(), model.engine_spec())


def _beyond_its_day(context: dg.AssetExecutionContext, day: DayLayout, shard: str,
                    opts: dict) -> dg.AssetObservation | None:
    """None when ``shard`` is one of its date's n shards. Otherwise this (date, shard) has nothing
    to do: logged, and returned as an observation of the asset (its Events tab says why) for the
    step to yield instead of a materialization. Fails at once, naming the date, when that
    date has no shard count yet (its prompt_shards has not run)."""
    url = day.table("shards", SHARD_COUNT_FILE)
    count = read_shard_count(url, storage_options=opts)
    if count is None:
        raise dg.Failure(allow_retries=False, description=(
            f"date {day.date} has no shards yet ({url} does not exist): materialize prompts and prompt_shards "
            f"for {day.date} (the kvbatch_ingest job) before its (date, shard) partitions; a day sharded "
            "before shard counts were written needs its prompt_shards re-run"))
    if count.has(shard):
        return None
    reason = (f"shard {shard} is not one of the {count.num_shards} shards of {day.date} ({count.rows} rows at "
              f"max_rows_per_shard={count.max_rows_per_shard}): nothing to do, no table written")
    context.log.info(reason)
    return dg.AssetObservation(asset_key=context.asset_key, partition=context.partition_key,
                               metadata={"skipped": reason, "num_shards": count.num_shards})


def _selected(context: dg.AssetExecutionContext, asset: str, events):
    """The events of a subsettable asset's step that its run selected: the materialization always
    (the step refuses to run without it), a check result only when that check is selected."""
    if not context.selected_asset_keys:  # its checks alone (context.asset_key would raise)
        raise dg.Failure(allow_retries=False, description=(
            f"the checks of {asset} run inside its materialization: select the asset"))
    selected = {key.name for key in context.selected_asset_check_keys}
    for event in events:
        if not (isinstance(event, dg.AssetCheckResult) and event.check_name not in selected):
            yield event


def prefill_kv_step(context: dg.AssetExecutionContext, object_store: ObjectStoreResource, model: ModelResource,
               kv_store: KVStoreResource):
    """The (date, shard)'s prompt KV blocks in the tiered KV store (each block once, under its
    content key, shared across days) and the decode manifests, ``manifests/date=D/shard=XXXX/manifests.jsonl``.
    A shard beyond its date's shard count materializes nothing."""
    from kvbatch.ops.prefill.prefill import prefill_shard

    (day, shard), opts = _day_shard(context, object_store), object_store.storage_options()
    skipped = _beyond_its_day(context, day, shard, opts)
    if skipped is not None:
        yield skipped
        return
    llm = model.load(_kv(object_store, model, kv_store))
    rows = _row_count(day.shard("shards", shard), opts)
    stats = prefill_shard(llm, day.shard("shards", shard), day.shard("manifests", shard, "manifests.jsonl"),
                          stats_url=day.shard("prefill_stats", shard, "stats.json"), model_name=model.model,
                          storage_options=opts, progress=ProgressMeter("prefill", rows, context.log.info))
    conn = stats["connector"]
    wall = stats["wall_s"]
    yield dg.MaterializeResult(metadata={
        "requests": stats["requests"],
        "prompt_tokens": stats["prompt_tokens"],
        "prompt_tokens_computed": stats["prompt_tokens_computed"],
        "prompt_tokens_already_stored": stats["prompt_tokens_already_stored"],
        "kv_blocks_written": conn["blocks_written"],
        "kv_written_mib": mib(conn["kv_bytes_written"]),
        "prefill_wall_s": round(wall, 3),
        "prefill_tokens_per_s": round(stats["prompt_tokens_computed"] / wall, 1) if wall else 0.0,
    })


def _row_count(url: str, opts: dict) -> int:
    """Rows of a Parquet table from its footer (nothing else is read)."""
    import fsspec
    import pyarrow.parquet as pq

    with fsspec.open(url, "rb", **opts) as f:
        return pq.ParquetFile(f).metadata.num_rows


def _max_tokens_total(url: str, opts: dict) -> int:
    """The sum of a shard table's ``max_tokens`` column: the most tokens its decode can produce."""
    import fsspec
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    with fsspec.open(url, "rb", **opts) as f:
        return int(pc.sum(pq.read_table(f, columns=["max_tokens"]).column("max_tokens")).as_py() or 0)


def decode_results_step(context: dg.AssetExecutionContext, object_store: ObjectStoreResource, model: ModelResource,
                   kv_store: KVStoreResource, decode_cluster: DecodeClusterResource,
                   pipes_subprocess_client: dg.PipesSubprocessClient):
    """One row per request of the (date, shard), ``results/date=D/shard=XXXX/part.parquet``:
    custom_id, text, token ids, finish_reason, usage and timings; decoded from the stored prompt
    KV, in process, or by a worker group launched through Dagster Pipes (``decode_cluster``:
    a subprocess, ``world_size`` ranks under torchrun, or a Kubernetes pod).
    Written as it goes: every rank commits a part file every ``checkpoint_rows`` results
    (``decode_parts/...``), and a retry after a crash resumes from them; the shard's file is then
    committed whole: a re-run replaces the shard, a crash leaves the last good commit. A shard
    beyond its date's shard count materializes nothing (its checks are skipped)."""
    yield from _selected(context, "decode_results", _decode_results(
        context, object_store, model, kv_store, decode_cluster, pipes_subprocess_client))


def _decode_results(context: dg.AssetExecutionContext, object_store: ObjectStoreResource, model: ModelResource,
                    kv_store: KVStoreResource, decode_cluster: DecodeClusterResource,
                    pipes_subprocess_client: dg.PipesSubprocessClient):
    from kvbatch.ops.decode.shard import decode_shard

    (day, shard), opts = _day_shard(context, object_store), object_store.storage_options()
    skipped = _beyond_its_day(context, day, shard, opts)
    if skipped is not None:
        yield skipped
        return
    manifests = day.shard("manifests", shard, "manifests.jsonl")
    results_url = day.shard("results", shard)
    stats_url = day.shard("decode_stats", shard, "stats.json")
    # Each rank's part files, committed every checkpoint_rows results; a retry resumes from them.
    parts_url = day.shard("decode_parts", shard, "")
    piped = decode_cluster.launcher != "in_process"
    engine_spec, drafts_from = resolve_last_night(model.engine_spec(), day, opts)
    if model.spec == SUFFIX_LAST_NIGHT:
        context.log.info(f"speculative decoding: {drafts_from}")
    if piped:
        spec = {"engine_spec": engine_spec.to_json(),
                "kv_store": kv_store.store_config(object_store.shared_url, opts).model_dump(),
                "manifests_url": manifests,
                "results_url": results_url, "stats_url": stats_url, "parts_url": parts_url, "storage_options": opts,
                "rows": _row_count(day.shard("shards", shard), opts)}
        cache_options = kv_store.response_cache_options(object_store.shared_url, opts)
        if cache_options is not None:  # every rank opens it (ops/decode/worker_commands.py)
            spec["response_cache"] = cache_options
        yield from decode_cluster.run(context, spec, pipes_subprocess_client)
        stats = read_json(stats_url, storage_options=opts)
    else:
        llm = model.load(_kv(object_store, model, kv_store), decode=True, engine_spec=engine_spec)
        progress = ProgressMeter("decode", _row_count(day.shard("shards", shard), opts), context.log.info)
        # Rows finish in bursts (a batch ends together), so rows alone misjudge the ETA; tokens
        # decoded against the shard's max_tokens budget (an upper bound of the work) track it.
        out0 = llm.stats["output_tokens"]
        progress.track(lambda: llm.stats["output_tokens"] - out0,
                       total=_max_tokens_total(day.shard("shards", shard), opts))
        cache = kv_store.open_response_cache(object_store.shared_url, opts, llm)
        try:
            stats = decode_shard(llm, manifests, results_url, stats_url=stats_url, parts_url=parts_url,
                                 checkpoint_rows=decode_cluster.checkpoint_rows, storage_options=opts,
                                 progress=progress, response_cache=cache)
        finally:
            if cache is not None:
                cache.close()
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
        "decode_wall_s": round(stats["wall_s"], 3),
        "output_tokens_per_s": round(stats["output_tokens_per_s"], 1),
        # A latency no request measured (none decoded past its first token) is left out, not 0.
        **{k: stats[k] for k in ("ttft_s_p50", "tpot_s_p50") if stats.get(k) is not None},
        "results_url": dg.MetadataValue.path(results_url),
        "decode_world_size": decode_cluster.world_size,
        **({"spec": drafts_from} if model.spec else {}),  # what drafted (suffix:last-night resolved)
        # The response cache's rows served, looked up and not found, and written (when it is on).
        **({f"response_cache_{k}": stats["response_cache"][k] for k in ("hits", "misses", "writes")}
           if "response_cache" in stats else {}),
        "results_preview": _results_preview(results),
    })
    yield from _decode_checks(problems)


def _results_preview(results) -> dg.MetadataValue:
    """The first results of the shard as a table: what a person checks first."""
    rows = results.slice(0, RESULTS_SHOWN).select(
        ["custom_id", "finish_reason", "prompt_tokens", "completion_tokens", "text"]).to_pylist()
    for r in rows:
        text = r["text"] or ""
        r["text"] = text if len(text) <= 120 else text[:119] + "…"
    return table_metadata({"custom_id": "string", "finish_reason": "string", "prompt_tokens": "int",
                           "completion_tokens": "int", "text": "string"}, rows)


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


def cost_metrics_step(context: dg.AssetExecutionContext, config: SLOConfig, object_store: ObjectStoreResource,
                 pricing: PricingResource, decode_cluster: DecodeClusterResource):
    """One row per (date, shard), ``cost_metrics/date=D/shard=XXXX/part.parquet``: tokens by class,
    dollars and $/Mtok by class and blended, KV cache hits by tier, TTFT/TPOT p50/p95/p99,
    speculative acceptance, expert-load balancedness, device-seconds by stage. The check holds
    the shard's P95 latencies against the SLO. A shard beyond its date's shard count
    materializes nothing (its check is skipped)."""
    yield from _selected(context, "cost_metrics", _cost_metrics(context, config, object_store, pricing, decode_cluster))


def _cost_metrics(context: dg.AssetExecutionContext, config: SLOConfig, object_store: ObjectStoreResource,
                  pricing: PricingResource, decode_cluster: DecodeClusterResource):
    from kvbatch.ops.results.cost import metrics_table, shard_metrics

    (day, shard), opts = _day_shard(context, object_store), object_store.storage_options()
    skipped = _beyond_its_day(context, day, shard, opts)
    if skipped is not None:
        yield skipped
        return
    row = shard_metrics(read_table(day.shard("results", shard), storage_options=opts),
                        read_json(day.shard("prefill_stats", shard, "stats.json"), storage_options=opts),
                        read_json(day.shard("decode_stats", shard, "stats.json"), storage_options=opts),
                        pricing.pricing(decode_devices=decode_cluster.world_size))
    write_table(metrics_table(row), day.shard("cost_metrics", shard), storage_options=opts)
    yield dg.MaterializeResult(metadata=cost_metadata(row))
    yield slo_check_result(row, config)


# Plotted keys: the same on every partition, units in the names, figures that do not apply left out.
_COUNT_KEYS = ("requests", "prompt_tokens", "output_tokens", "billable_tokens", "prompt_tokens_prefill_computed",
               "prompt_tokens_decode_loaded", "prompt_tokens_decode_cached", "prompt_tokens_decode_computed")
_LATENCY_KEYS = tuple(f"{n}_p{p}" for n in ("ttft_s", "tpot_s") for p in (50, 95, 99))
_CLASS_LABELS = (("prefill_computed", "prompt, computed at prefill"),
                 ("store_memory", "prompt, served by the KV store: memory"),
                 ("store_disk", "prompt, served by the KV store: disk"),
                 ("store_object", "prompt, served by the KV store: object store"),
                 ("prefix_cache", "prompt, engine prefix-cache hit at decode"),
                 ("response_cache", "prompt + output, answered by the response cache (no compute)"),
                 ("decode_computed", "prompt, computed at decode"),
                 ("output", "output"))
# Why a token class can cost dollars with no tokens (cost_markdown).
_NO_TOKEN_NOTES = {"prefill_computed": "prefill computed nothing (every block was already stored): the $ is its "
                                       "store lookups and manifests"}


def cost_metadata(row: dict) -> dict:
    """The metadata of a shard's (or a day's) cost row: numbers to plot and a readable summary."""
    from kvbatch.ops.results.cost import TIERS, class_tokens

    # The summary first: it is what the UI shows at the top of the metadata, with units in the values.
    meta: dict = {"summary": dg.MetadataValue.md(cost_markdown(row, class_tokens(row)))}
    meta.update({k: int(row[k]) for k in _COUNT_KEYS})
    meta["cost_usd"] = usd(row["cost_usd"])
    meta.update({f"usd_per_mtok_{c}": usd(row[f"usd_per_mtok_{c}"]) for c, _ in _CLASS_LABELS
                 if row.get(f"usd_per_mtok_{c}") is not None})
    if row.get("usd_per_mtok_blended") is not None:
        meta["usd_per_mtok_blended"] = usd(row["usd_per_mtok_blended"])
    if row.get("response_cache_hits"):  # rows the response cache answered, and what they did not spend
        meta["response_cache_hits"] = int(row["response_cache_hits"])
        if row.get("response_cache_saved_usd") is not None:
            meta["response_cache_saved_usd"] = usd(row["response_cache_saved_usd"])
    if row.get("savings_usd") is not None:
        meta["savings_usd"] = usd(row["savings_usd"])
        meta["reference_cost_usd"] = usd(row["reference_cost_usd"])
    meta.update({k: round(row[k], 4) for k in _LATENCY_KEYS if row.get(k) is not None})
    meta["device_s_prefill"], meta["device_s_decode"] = round(row["device_s_prefill"], 3), round(row["device_s_decode"], 3)
    meta["kv_written_mib"], meta["kv_read_mib"] = mib(row["kv_bytes_written"]), mib(row["kv_bytes_read"])
    if row["prompt_tokens"]:
        meta.update({f"kv_hit_rate_{t}_pct": pct(row[f"kv_tokens_hit_{t}"] / row["prompt_tokens"]) for t in TIERS})
    if row.get("spec_acceptance_rate") is not None:  # speculative decoding ran
        meta["spec_acceptance_pct"] = pct(row["spec_acceptance_rate"])
    if row.get("expert_load_balancedness") is not None:  # a MoE model on a worker group
        meta["expert_load_balancedness_pct"] = pct(row["expert_load_balancedness"])
    return meta


def cost_markdown(row: dict, tokens: dict[str, int]) -> str:
    """Tokens, dollars and $/Mtok by class, then the shard's other figures, as markdown tables."""
    classes, notes = [], []
    rc = int(row.get("prompt_tokens_response_cache") or 0)  # within prompt_tokens_decode_cached
    for c, label in _CLASS_LABELS:
        if not (tokens[c] or row[f"cost_{c}_usd"]):
            continue  # no tokens, no dollars: left out
        # Dollars without tokens (a store lookup, a manifest write): "0 tokens, $x" reads as a bug,
        # so the tokens show as "–" and a note says what the dollars paid for.
        shown = f"{tokens[c]:,}" if tokens[c] else "–"
        if not tokens[c]:
            notes.append(_NO_TOKEN_NOTES.get(c, f"{label}: no tokens; the $ is its store requests, writes and "
                                                "transfer"))
        classes.append((label, shown, fmt_usd(row[f"cost_{c}_usd"]),
                        fmt_usd(row.get(f"usd_per_mtok_{c}")) if row.get(f"usd_per_mtok_{c}") is not None else "–"))
    blended = row.get("usd_per_mtok_blended")
    classes.append(("**total** (billable: prompt + output tokens)", f"{row['billable_tokens']:,}",
                    fmt_usd(row["cost_usd"]), fmt_usd(blended) if blended is not None else "–"))
    out = [markdown_table(("token class", "tokens", "cost", "$ per Mtok"), classes), "",
           *[f"Note: {n}." for n in notes], *([""] if notes else []),
           (f"Prompt tokens {row['prompt_tokens']:,} = served by the KV store "
           f"{row['prompt_tokens_decode_loaded']:,} + prefix-cache hits {row['prompt_tokens_decode_cached'] - rc:,} "
           + (f"+ answered by the response cache {rc:,} " if rc else "") +
           f"+ computed at decode {row['prompt_tokens_decode_computed']:,}. The "
           f"{row['prompt_tokens_prefill_computed']:,} tokens computed at prefill are the blocks the store "
           "then served, so they are not added again."), ""]
    figures = [("requests", f"{row['requests']:,}"), ("output tokens", f"{row['output_tokens']:,}")]
    for name, label in (("ttft_s", "time to first token"), ("tpot_s", "time per output token")):
        if row.get(f"{name}_p50") is not None:
            figures.append((f"{label} p50 / p95 / p99", " / ".join(
                f"{row[f'{name}_p{p}']:.3f} s" for p in (50, 95, 99))))
    figures += [("device-seconds, prefill / decode", f"{row['device_s_prefill']:.2f} s / {row['device_s_decode']:.2f} s"),
                ("KV written / read", f"{mib(row['kv_bytes_written']):,.2f} MiB / {mib(row['kv_bytes_read']):,.2f} MiB"),
                ("compute / storage / requests / egress", " / ".join(
                    fmt_usd(row[k]) for k in ("cost_compute_usd", "cost_storage_usd", "cost_requests_usd",
                                              "cost_transfer_usd")))]
    if row.get("reference_cost_usd") is not None:
        figures.append(("reference (hosted batch API) / saved",
                        f"{fmt_usd(row['reference_cost_usd'])} / {fmt_usd(row['savings_usd'])}"))
    if row.get("spec_acceptance_rate") is not None:
        figures.append(("speculative acceptance", f"{pct(row['spec_acceptance_rate']):.1f} %"))
    if row.get("expert_load_balancedness") is not None:
        figures.append(("expert load balancedness (mean / max)", f"{pct(row['expert_load_balancedness']):.1f} %"))
    out.append(markdown_table(("figure", "value"), figures))
    return "\n".join(out)


def build_assets(p: "PipelineParts") -> list[dg.AssetsDefinition]:
    """One pipeline's assets, ``[name, asset]`` each, from the step bodies above."""
    prompts = p.asset(prompts_step, name="prompts", config=p.prompts_config, partitions_def=date_partitions,
                      retry_policy=IO_RETRY, check_specs=prompts_checks(p.name), kinds={"python", "polars", "parquet"})
    prompt_shards = p.asset(prompt_shards_step, name="prompt_shards", config=p.shards_config, deps=[prompts],
                            partitions_def=date_partitions, retry_policy=IO_RETRY, kinds={"python", "parquet"})
    prefill_kv = p.asset(prefill_kv_step, name="prefill_kv",
                         deps=[dg.AssetDep(prompt_shards, partition_mapping=shard_to_date)],
                         partitions_def=p.shards, retry_policy=STEP_RETRY, pool="gpu", kinds={"pytorch", "python"},
                         output_required=False)
    decode_results = p.multi_asset(decode_results_step, name="decode_results", deps=[prefill_kv],
                                   partitions_def=p.shards, check_specs=decode_checks(p.name, p.shards),
                                   kinds={"pytorch", "python", "parquet"}, retry_policy=STEP_RETRY, pool="gpu")
    cost_metrics = p.multi_asset(cost_metrics_step, name="cost_metrics", config=p.slo_config, deps=[decode_results],
                                 partitions_def=p.shards, check_specs=[shard_slo_check(p.name, p.shards)],
                                 kinds={"python", "parquet"}, retry_policy=IO_RETRY)
    return [prompts, prompt_shards, prefill_kv, decode_results, cost_metrics]
