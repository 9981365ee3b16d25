"""Prefill and decode one shard: shard table in, KV blocks + manifests, then a results table.

Plain Python (no Dagster); the pipeline's ``prefill_kv`` and ``decode_results`` assets call
:func:`prefill_shard` and :func:`decode_shard`. The hand-off between them is the manifest
format of :mod:`kvbatch.ops.kv_handoff` (one JSONL line per request), so a shard prefilled here
can also be decoded by ``kvbatch decode`` and the other way round.

Results table (one row per request of the shard, ordered by input row): ``row, custom_id,
text, output_token_ids, finish_reason, prompt_tokens, completion_tokens, cached_prompt_tokens,
loaded_prompt_tokens, max_tokens, ttft_s, tpot_s`` and, null unless the engine speculated,
``spec_draft_tokens, spec_accepted_tokens, spec_target_steps``. It is written whole, atomically, at the end:
a crash leaves the previous commit, a re-run replaces it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from typing import Any

import pyarrow as pa

from kvbatch.engine.runtime.llm import LLM, GenerationRequest
from kvbatch.io.batch_output import JsonlWriter
from kvbatch.io.prompt_table import record_request
from kvbatch.io.shard_tables import read_table, write_json, write_table
from kvbatch.ops.batch_report import BatchReport
from kvbatch.ops.jobs import Job, Rejected, to_engine_sampling
from kvbatch.ops.manifests import (
    MANIFEST_VERSION,
    manifest_jobs,
    manifest_line,
    read_manifests,
)

RESULTS_SCHEMA = pa.schema([
    ("row", pa.int64()),
    ("custom_id", pa.string()),
    ("text", pa.string()),
    ("output_token_ids", pa.list_(pa.int32())),
    ("finish_reason", pa.string()),
    ("prompt_tokens", pa.int64()),
    ("completion_tokens", pa.int64()),
    ("cached_prompt_tokens", pa.int64()),  # served by the engine's in-memory prefix cache
    ("loaded_prompt_tokens", pa.int64()),  # served by the KV store
    ("max_tokens", pa.int64()),
    ("ttft_s", pa.float64()),
    ("tpot_s", pa.float64()),
    # Speculative decoding, null when the engine did not speculate for this request.
    ("spec_draft_tokens", pa.int64()),
    ("spec_accepted_tokens", pa.int64()),
    ("spec_target_steps", pa.int64()),
])
SPEC_FIELDS = ("spec_draft_tokens", "spec_accepted_tokens", "spec_target_steps")


class ShardModelMismatch(ValueError):
    """The shard was tokenized for another model or KV layout than the one prefilling it."""


def shard_jobs(table: pa.Table) -> Iterator[tuple[Job, list[str]]]:
    """(engine job, block keys recorded at sharding) for every row of a shard table."""
    index = 0
    for batch in table.to_batches(max_chunksize=4096):
        for rec in batch.to_pylist():
            req = record_request(rec)
            yield (Job(index, req.custom_id, req.line_no, list(rec["prompt_token_ids"]), to_engine_sampling(req),
                       req.model), list(rec["block_keys"]))
            index += 1


def prefill_shard(
    llm: LLM,
    shard_table_url: str,
    manifests_url: str,
    *,
    stats_url: str | None = None,
    model_name: str = "kvbatch",
    storage_options: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Store the KV of every prompt's full blocks that the store lacks; write the manifests."""
    if llm.connector is None:
        raise ValueError("prefill needs an LLM with a kv_store")
    store = llm.connector.store
    bs = llm.engine_config.block_size
    table = read_table(shard_table_url, storage_options=storage_options)
    stats: dict[str, Any] = {"requests": 0, "prompt_tokens": 0, "prompt_tokens_already_stored": 0}
    started = time.perf_counter()
    computed_before = llm.stats["computed_prompt_tokens"]
    with JsonlWriter(manifests_url, storage_options=storage_options) as out:

        def engine_requests() -> Iterator[GenerationRequest]:
            for job, shard_keys in shard_jobs(table):
                manifest = manifest_line(llm, job, model_name)
                keys = manifest["block_keys"]
                if keys != shard_keys:
                    raise ShardModelMismatch(
                        f"{job.custom_id!r}: the shard's block keys differ from this model's; the shards were "
                        f"made for another model, dtype or block size: re-run prompt_shards")
                stats["requests"] += 1
                stats["prompt_tokens"] += len(job.prompt_token_ids)
                if keys and not all(store.contains(keys)):
                    yield GenerationRequest(str(job.index), job.sampling, prompt_token_ids=job.prompt_token_ids,
                                            prefill_only=True)
                else:
                    stats["prompt_tokens_already_stored"] += len(keys) * bs
                out.write(manifest)

        for _ in llm.stream(engine_requests()):
            pass
    stats["wall_s"] = round(time.perf_counter() - started, 6)
    stats["prompt_tokens_computed"] = llm.stats["computed_prompt_tokens"] - computed_before
    stats["manifest_version"] = MANIFEST_VERSION
    stats["connector"] = llm.connector.stats.to_json()
    stats["store"] = store.stats()  # per tier: retries, failures, timeouts, breaker opens (outages show here)
    if stats_url:
        write_json(stats, stats_url, storage_options=storage_options)
    return stats


def decode_rows(
    llm: LLM,
    manifests_url: str,
    *,
    storage_options: Mapping[str, Any] | None = None,
    rank: int = 0,
    world_size: int = 1,
) -> tuple[list[dict[str, Any]], BatchReport]:
    """Generate the requests of a shard's manifests that belong to ``rank`` (the i-th request goes
    to rank ``i mod world_size``), loading the stored prompt KV. Returns (result rows, report)."""
    report = BatchReport.start(llm)
    jobs: dict[str, Job] = {}
    rows: list[dict[str, Any]] = []

    def engine_requests() -> Iterator[GenerationRequest]:
        for i, job in enumerate(manifest_jobs(llm, read_manifests(manifests_url, dict(storage_options or {})))):
            if i % world_size != rank:
                continue
            report.requests += 1
            if isinstance(job, Rejected):  # manifests written by `kvbatch prefill` may hold rejects
                report.rejected += 1
                continue
            jobs[str(job.index)] = job
            yield GenerationRequest(str(job.index), job.sampling, prompt_token_ids=job.prompt_token_ids)

    for result in llm.stream(engine_requests()):
        job = jobs.pop(result.request_id)
        report.add_result(result)
        rows.append({
            "row": job.line_no, "custom_id": job.custom_id, "text": result.text,
            "output_token_ids": result.output_token_ids, "finish_reason": result.finish_reason,
            "prompt_tokens": len(result.prompt_token_ids), "completion_tokens": len(result.output_token_ids),
            "cached_prompt_tokens": result.num_cached_tokens, "loaded_prompt_tokens": result.num_loaded_tokens,
            "max_tokens": job.sampling.max_tokens, "ttft_s": result.ttft_s, "tpot_s": result.tpot_s,
            **{f: getattr(result, f, None) for f in SPEC_FIELDS},
        })
    report.finish(llm)
    return rows, report


def decode_stats(llm: LLM, report: BatchReport) -> dict[str, Any]:
    """The stats a decode commits beside its results (one rank's view)."""
    stats = report.to_json()
    if llm.connector is not None:
        stats["connector"] = llm.connector.stats.to_json()
        stats["store"] = llm.connector.store.stats()  # per tier: retries, failures, breaker opens
    balance = llm.stats.get("expert_load_balancedness")  # MoE engines only
    if balance is not None:
        stats["expert_load_balancedness"] = float(balance)
    return stats


def commit_results(
    rows: list[dict[str, Any]],
    stats: dict[str, Any],
    results_url: str,
    *,
    stats_url: str | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Write the shard's results table (ordered by input row) and then its stats, each atomically."""
    rows = sorted(rows, key=lambda r: r["row"])
    stats = dict(stats, results_bytes=write_table(pa.Table.from_pylist(rows, RESULTS_SCHEMA), results_url,
                                                  storage_options=storage_options))
    if stats_url:
        write_json(stats, stats_url, storage_options=storage_options)
    return stats


def decode_shard(
    llm: LLM,
    manifests_url: str,
    results_url: str,
    *,
    stats_url: str | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Generate every request of a shard's manifests, loading the stored prompt KV; write results."""
    rows, report = decode_rows(llm, manifests_url, storage_options=storage_options)
    return commit_results(rows, decode_stats(llm, report), results_url, stats_url=stats_url,
                          storage_options=storage_options)
