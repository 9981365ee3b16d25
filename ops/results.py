"""Prefill and decode one shard: shard table in, KV blocks + manifests, then a results table.

Plain Python (no Dagster); the pipeline's ``prefill_kv`` and ``decode_results`` assets call
:func:`prefill_shard` and :func:`decode_shard`. The hand-off between them is the manifest
format of :mod:`kvbatch.ops.kv_handoff` (one JSONL line per request), so a shard prefilled here
can also be decoded by ``kvbatch decode`` and the other way round.

Results table (one row per request of the shard, ordered by input row): ``row, custom_id,
text, output_token_ids, finish_reason, prompt_tokens, completion_tokens, cached_prompt_tokens,
loaded_prompt_tokens, max_tokens, ttft_s, tpot_s`` and, null unless the engine speculated,
``spec_draft_tokens, spec_accepted_tokens, spec_target_steps``. Decode writes as it goes: each
rank commits its results as part files every ``checkpoint_rows`` results, and a re-run after a
crash resumes from them (:mod:`kvbatch.ops.decode_checkpoint`); the shard's ``part.parquet`` is
then committed whole, atomically, from the parts (merged in manifest order, which is the shard's
row order): a crash leaves the previous commit, a re-run replaces it.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator, Mapping
from typing import Any

import pyarrow as pa

from kvbatch.engine.runtime.llm import LLM, GenerationRequest
from kvbatch.io.batch_output import JsonlWriter
from kvbatch.io.prompt_table import record_request
from kvbatch.io.shard_tables import read_table, write_json
from kvbatch.ops.batch_report import BatchReport
from kvbatch.ops.decode_checkpoint import (
    DEFAULT_CHECKPOINT_ROWS,
    PartWriter,
    compact_parts,
    default_parts_url,
    done_indexes,
    manifests_key,
    prepare_parts,
)
from kvbatch.ops.jobs import Job, Rejected, to_engine_sampling
from kvbatch.ops.manifests import (
    MANIFEST_VERSION,
    attach_locations,
    manifest_jobs,
    manifest_line,
    read_manifests,
)
from kvbatch.ops.metrics import ProgressMeter

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
    progress: ProgressMeter | None = None,
) -> dict[str, Any]:
    """Store the KV of every prompt's full blocks that the store lacks; write the manifests.
    ``progress`` (rows done, tokens/s, ETA) advances by a row as each prompt is stored or found."""
    if llm.connector is None:
        raise ValueError("prefill needs an LLM with a kv_store")
    store = llm.connector.store
    bs = llm.engine_config.block_size
    table = read_table(shard_table_url, storage_options=storage_options)
    stats: dict[str, Any] = {"requests": 0, "prompt_tokens": 0, "prompt_tokens_already_stored": 0}
    started = time.perf_counter()
    computed_before = llm.stats["computed_prompt_tokens"]
    lines: list[dict[str, Any]] = []  # written once the blocks are durable, with their locations
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
                    if progress is not None:
                        progress.advance(1, 0)
                lines.append(manifest)

        for result in llm.stream(engine_requests()):
            if progress is not None:
                progress.advance(1, len(result.prompt_token_ids))
        # Blocks durable first: a crash here commits no manifest naming blocks that are not stored.
        llm.connector.flush()
        for line in attach_locations(llm, lines):
            out.write(line)
    if progress is not None:
        progress.finish()
    stats["wall_s"] = round(time.perf_counter() - started, 6)
    stats["prompt_tokens_computed"] = llm.stats["computed_prompt_tokens"] - computed_before
    stats["manifest_version"] = MANIFEST_VERSION
    stats["connector"] = llm.connector.stats.to_json()
    stats["store"] = store.stats()  # per tier: retries, failures, timeouts, breaker opens (outages show here)
    if stats_url:
        write_json(stats, stats_url, storage_options=storage_options)
    return stats


def decode_rank(
    llm: LLM,
    manifests_url: str,
    parts_url: str,
    *,
    key: str,
    attempt: str,
    storage_options: Mapping[str, Any] | None = None,
    rank: int = 0,
    world_size: int = 1,
    checkpoint_rows: int = DEFAULT_CHECKPOINT_ROWS,
    progress: ProgressMeter | None = None,
) -> dict[str, Any]:
    """Generate the requests of a shard's manifests that belong to ``rank`` (the i-th request goes
    to rank ``i mod world_size``) and are in no committed part yet, loading the stored prompt KV;
    commit this rank's results as part files every ``checkpoint_rows`` results
    (:mod:`kvbatch.ops.decode_checkpoint`). Returns this rank's stats (:func:`decode_stats`, with
    ``resumed_rows``: requests skipped because an earlier run had committed them).
    ``progress`` advances by a row and its output tokens as each request finishes."""
    report = BatchReport.start(llm)
    done = done_indexes(parts_url, storage_options)
    writer = PartWriter(parts_url, RESULTS_SCHEMA, rank, key, checkpoint_rows, storage_options, attempt)
    jobs: dict[str, Job] = {}
    resumed = 0

    def snapshot() -> dict[str, Any]:
        stats = dict(decode_stats(llm, report), resumed_rows=resumed)
        stats["wall_s"] = round(time.perf_counter() - report._since[0], 4)  # the run so far
        return stats

    def engine_requests() -> Iterator[GenerationRequest]:
        nonlocal resumed
        for i, job in enumerate(manifest_jobs(llm, read_manifests(manifests_url, dict(storage_options or {})))):
            if i % world_size != rank:
                continue
            if i in done:  # committed by an earlier run of this shard
                resumed += 1
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
        writer.add(job.index, {
            "row": job.line_no, "custom_id": job.custom_id, "text": result.text,
            "output_token_ids": result.output_token_ids, "finish_reason": result.finish_reason,
            "prompt_tokens": len(result.prompt_token_ids), "completion_tokens": len(result.output_token_ids),
            "cached_prompt_tokens": result.num_cached_tokens, "loaded_prompt_tokens": result.num_loaded_tokens,
            "max_tokens": job.sampling.max_tokens, "ttft_s": result.ttft_s, "tpot_s": result.tpot_s,
            **{f: getattr(result, f, None) for f in SPEC_FIELDS},
        }, snapshot)
        if progress is not None:
            progress.advance(1, len(result.output_token_ids))
    report.finish(llm)
    stats = dict(decode_stats(llm, report), resumed_rows=resumed, attempt=attempt, rank=rank)
    writer.flush(stats)
    if progress is not None:
        progress.finish()
    return stats


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


# Counters of the requests each run decoded: summed over every (attempt, rank) that committed.
_DECODED_COUNTERS = ("succeeded", "prompt_tokens", "cached_prompt_tokens", "loaded_prompt_tokens", "output_tokens",
                     "preemptions")


def merge_stats(final: list[dict[str, Any]], earlier: list[dict[str, Any]], ttft_s: list[float],
                tpot_s: list[float]) -> dict[str, Any]:
    """One stats document for the shard. ``final``: every rank's stats of the run that finished;
    ``earlier``: the last checkpointed stats of each rank of runs that died (their committed
    work is in the results, so it is counted; what they lost is not). Counters of decoded
    requests are summed over all of them; rejects come from the final run alone (every run meets
    them again); wall time is the slowest rank's per run, summed over runs; percentiles are over
    every committed request. Each rank's own figures are kept under ``by_rank``."""
    merged = BatchReport()
    every = final + earlier
    for name in _DECODED_COUNTERS:
        setattr(merged, name, sum(int(s.get(name, 0) or 0) for s in every))
    merged.rejected = sum(int(s.get("rejected", 0)) for s in final)
    for s in final:
        for field_name, n in s.get("rejects_by_field", {}).items():
            merged.rejects_by_field[field_name] = merged.rejects_by_field.get(field_name, 0) + n
    merged.requests = merged.succeeded + merged.rejected
    walls: dict[str, float] = {}
    for s in every:
        run = str(s.get("attempt", ""))
        walls[run] = max(walls.get(run, 0.0), float(s.get("wall_s", 0.0)))
    merged.wall_s = sum(walls.values())
    merged.ttft_s, merged.tpot_s = list(ttft_s), list(tpot_s)
    out = merged.to_json()
    connectors = [s["connector"] for s in every if "connector" in s]
    if connectors:
        out["connector"] = _sum_numbers(connectors)
    specs = [s["speculative"] for s in every if "speculative" in s]
    if specs:
        out["speculative"] = _merge_speculative(specs)
    stores = [s["store"] for s in final if "store" in s]
    if stores:
        out["store"] = _sum_numbers(stores)
    if final and all("expert_rows_computed" in s for s in final):
        out["expert_load_balancedness"] = balancedness([s["expert_rows_computed"] for s in final])
    elif len(final) == 1 and "expert_load_balancedness" in final[0]:
        out["expert_load_balancedness"] = final[0]["expert_load_balancedness"]
    out["resumed_rows"] = sum(int(s.get("resumed_rows", 0)) for s in final)
    out["runs"] = len(walls)
    if len(every) > 1:
        out["by_rank"] = every
    return out


def _merge_speculative(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """Speculative-decoding figures of several runs/ranks: counts summed, rates recomputed, the
    drafter's time share averaged (each rank's share of its own step time)."""
    out = _sum_numbers(docs)
    drafted, accepted, steps = out.get("draft_tokens", 0), out.get("accepted_tokens", 0), out.get("target_steps", 0)
    out["acceptance_rate"] = round(accepted / drafted, 4) if drafted else 0.0
    out["mean_accepted_per_step"] = round(accepted / steps, 4) if steps else 0.0
    out["drafter_time_share"] = round(sum(d.get("drafter_time_share", 0.0) for d in docs) / len(docs), 4)
    return out


def balancedness(rows_by_rank: list[dict[str, int]]) -> float | None:
    """Mean over MoE layers of mean / max expert rows computed per rank (1 is perfect balance)."""
    ratios = []
    for layer in sorted({k for rows in rows_by_rank for k in rows}):
        loads = [rows.get(layer, 0) for rows in rows_by_rank]
        if max(loads) > 0:
            ratios.append(sum(loads) / len(loads) / max(loads))
    return round(sum(ratios) / len(ratios), 6) if ratios else None


def _sum_numbers(docs: list[Any]) -> Any:
    """Numeric leaves summed across documents of the same shape (per-rank connector counters)."""
    first = docs[0]
    if isinstance(first, dict):
        keys = {k for d in docs if isinstance(d, dict) for k in d}
        return {k: _sum_numbers([d[k] for d in docs if isinstance(d, dict) and k in d]) for k in sorted(keys)}
    if isinstance(first, (int, float)) and not isinstance(first, bool):
        return sum(d for d in docs if isinstance(d, (int, float)))
    return first


def commit_parts(
    final: list[dict[str, Any]],
    parts_url: str,
    results_url: str,
    *,
    stats_url: str | None = None,
    storage_options: Mapping[str, Any] | None = None,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """After every rank finished (``final``: their stats): merge the parts into the shard's
    results file, commit it, then its stats (with ``extra``), each atomically (rank 0 only)."""
    done = compact_parts(parts_url, results_url, RESULTS_SCHEMA, storage_options)
    runs = {str(s.get("attempt")) for s in final}
    earlier = [s for (attempt, _), s in sorted(done.stats_by_attempt_rank.items()) if attempt not in runs]
    stats = dict(merge_stats(final, earlier, done.ttft_s, done.tpot_s), results_bytes=done.results_bytes,
                 **dict(extra or {}))
    if stats_url:
        write_json(stats, stats_url, storage_options=storage_options)
    return stats


def start_decode(manifests_url: str, parts_url: str, storage_options: Mapping[str, Any] | None) -> str:
    """Before any rank decodes (rank 0, once): drop parts of other manifests; the manifests' key."""
    key = manifests_key(manifests_url, storage_options)
    prepare_parts(parts_url, key, storage_options)
    return key


def decode_shard(
    llm: LLM,
    manifests_url: str,
    results_url: str,
    *,
    stats_url: str | None = None,
    parts_url: str | None = None,
    checkpoint_rows: int = DEFAULT_CHECKPOINT_ROWS,
    storage_options: Mapping[str, Any] | None = None,
    progress: ProgressMeter | None = None,
) -> dict[str, Any]:
    """Generate every request of a shard's manifests, loading the stored prompt KV, committing a
    part every ``checkpoint_rows`` results into ``parts_url`` (default: a dot folder beside the
    results); a re-run after a crash resumes from the last part. Then commit the results."""
    parts_url = parts_url or default_parts_url(results_url)
    key = start_decode(manifests_url, parts_url, storage_options)
    stats = decode_rank(llm, manifests_url, parts_url, key=key, attempt=uuid.uuid4().hex[:12],
                        storage_options=storage_options, checkpoint_rows=checkpoint_rows, progress=progress)
    return commit_parts([stats], parts_url, results_url, stats_url=stats_url, storage_options=storage_options)
