"""Decode one shard: its manifests in, a results table out (the one decode loop,
:class:`~kvbatch.ops.decode.loop.DecodeLoop`, over the shard's stored prompt KV).

Plain Python (no Dagster); the pipeline's ``decode_results`` asset and the worker's ``shard``
command call :func:`decode_shard` / :func:`decode_rank`. The manifests are
:mod:`kvbatch.ops.prefill.manifests`' format, written by
:func:`~kvbatch.ops.prefill.prefill.prefill_shard` or ``kvbatch prefill`` alike.

Results table (one row per request of the shard, ordered by input row): ``row, custom_id,
text, output_token_ids, finish_reason, prompt_tokens, completion_tokens, cached_prompt_tokens,
loaded_prompt_tokens, cached, max_tokens, ttft_s, tpot_s`` and, null unless the engine speculated,
``spec_draft_tokens, spec_accepted_tokens, spec_target_steps``, then ``choices``. A row of ``n``
choices (:func:`results_row`) stays one row, so every reader that counts rows counts requests and
the prompt once: ``text``, ``output_token_ids`` and ``finish_reason`` are choice 0's,
``completion_tokens`` (and the speculative counts) sum every choice, the prompt-cache counts and
latencies are the lead choice's (:meth:`~kvbatch.ops.decode.loop.Answered.lead`), and ``choices``
lists every choice in order (null for a row of one). ``tool_calls`` (a row with tools whose answer
called them, docs/tools.md; null otherwise) holds choice 0's calls as its output line's
``message.tool_calls`` has them (:func:`tool_calls_column`), ``text`` the answer as generated; each
entry of ``choices`` has its own choice's ``tool_calls`` the same way (the ids of that choice's
``choices[i].message.tool_calls``), so a row of n choices keeps every choice's calls.
Decode writes as it goes: each rank commits its results as part files every ``checkpoint_rows`` results, and a re-run after a
crash resumes from them (:mod:`kvbatch.ops.decode.checkpoint`); the shard's ``part.parquet`` is
then committed whole, atomically, from the parts (merged in manifest order, which is the shard's
row order): a crash leaves the previous commit, a re-run replaces it.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from typing import Any

import pyarrow as pa

from kvbatch.engine.runtime.llm import LLM
from kvbatch.engine.text.tool_calls import is_tools_spec
from kvbatch.io.batch_output import result_line
from kvbatch.io.shard_tables import write_json
from kvbatch.ops.decode.checkpoint import (
    DEFAULT_CHECKPOINT_ROWS,
    PartWriter,
    compact_parts,
    default_parts_url,
    done_indexes,
    manifests_key,
    prepare_parts,
)
from kvbatch.ops.decode.loop import Answered, DecodeLoop, Refused
from kvbatch.ops.decode.report import BatchReport, sum_counters
from kvbatch.ops.jobs import Job, Rejected
from kvbatch.ops.prefill.manifests import manifest_jobs, read_manifests
from kvbatch.ops.results.metrics import ProgressMeter

# A tools row's calls in one answer: each call (id, name, arguments as JSON text); null: none.
TOOL_CALLS_TYPE = pa.list_(pa.struct([("id", pa.string()), ("name", pa.string()), ("arguments", pa.string())]))
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
    ("cached", pa.bool_()),  # answered by the response cache: no engine work (docs/response-cache.md)
    ("max_tokens", pa.int64()),
    ("ttft_s", pa.float64()),
    ("tpot_s", pa.float64()),
    # Speculative decoding, null when the engine did not speculate for this request.
    ("spec_draft_tokens", pa.int64()),
    ("spec_accepted_tokens", pa.int64()),
    ("spec_target_steps", pa.int64()),
    # A row of n > 1 choices: each choice in order (null for a row of one choice), its calls too.
    ("choices", pa.list_(pa.struct([("text", pa.string()), ("output_token_ids", pa.list_(pa.int32())),
                                    ("finish_reason", pa.string()), ("tool_calls", TOOL_CALLS_TYPE)]))),
    # A row with tools whose answer called them: choice 0's calls.
    ("tool_calls", TOOL_CALLS_TYPE),
])
SPEC_FIELDS = ("spec_draft_tokens", "spec_accepted_tokens", "spec_target_steps")


def results_row(answered: Answered) -> dict[str, Any]:
    """The results-table row of an answered request (see the module docstring for a row of n choices)."""
    job, first, lead, totals = answered.job, answered.result, answered.lead(), answered.totals()
    return {
        "row": job.line_no, "custom_id": job.custom_id, "text": first.text,
        "output_token_ids": first.output_token_ids, "finish_reason": first.finish_reason,
        "prompt_tokens": answered.prompt_tokens, "completion_tokens": answered.completion_tokens,
        "cached_prompt_tokens": lead.num_cached_tokens, "loaded_prompt_tokens": lead.num_loaded_tokens,
        "cached": answered.cached,
        "max_tokens": job.sampling.max_tokens, "ttft_s": lead.ttft_s, "tpot_s": lead.tpot_s,
        **{f: getattr(totals, f, None) for f in SPEC_FIELDS},
        "choices": None if len(answered.choices) == 1 else [
            {"text": r.text, "output_token_ids": r.output_token_ids, "finish_reason": r.finish_reason,
             "tool_calls": tool_calls_column(job, r.text, r.finish_reason, choice=i)}
            for i, r in enumerate(answered.choices)],
        "tool_calls": tool_calls_column(job, first.text, first.finish_reason),
    }


def tool_calls_column(job: Job, text: str, finish_reason: str, choice: int = 0) -> list[dict[str, str]] | None:
    """The calls of a tools row's answer (its choice ``choice``) as its output line gives them (the
    same ids, names and arguments: :func:`~kvbatch.io.batch_output.result_line` parses them, and
    hashes the choice into the ids), or None (no tools, no calls)."""
    if not is_tools_spec(job.sampling.response_format):
        return None
    line = result_line(job.custom_id, job.line_no, text=text, finish_reason=finish_reason, prompt_tokens=0,
                       completion_tokens=0, model="", response_format=job.sampling.response_format,
                       choice=choice)
    calls = line["response"]["body"]["choices"][0]["message"].get("tool_calls")
    return None if calls is None else [
        {"id": c["id"], "name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in calls]


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
    response_cache: Any = None,
) -> dict[str, Any]:
    """Generate the requests of a shard's manifests that belong to ``rank`` (the i-th request goes
    to rank ``i mod world_size``) and are in no committed part yet, loading the stored prompt KV;
    commit this rank's results as part files every ``checkpoint_rows`` results
    (:mod:`kvbatch.ops.decode.checkpoint`). Returns this rank's stats (:func:`decode_stats`, with
    ``resumed_rows``: requests skipped because an earlier run had committed them).
    ``progress`` advances by a row and its output tokens as each request finishes.
    ``response_cache``: a :class:`~kvbatch.ops.decode.response_cache.ResponseCache`; its counters
    go into the stats (``response_cache``)."""
    report = BatchReport.start(llm)
    done = done_indexes(parts_url, storage_options)
    writer = PartWriter(parts_url, RESULTS_SCHEMA, rank, key, checkpoint_rows, storage_options, attempt)
    resumed = 0

    def snapshot() -> dict[str, Any]:
        stats = dict(decode_stats(llm, report), resumed_rows=resumed)
        stats["wall_s"] = round(time.perf_counter() - report._since[0], 4)  # the run so far
        return stats

    def skip(job: Job | Rejected) -> bool:
        nonlocal resumed
        if job.index % world_size != rank:
            return True
        if job.index in done:  # committed by an earlier run of this shard
            resumed += 1
            return True
        return False

    jobs = manifest_jobs(llm, read_manifests(manifests_url, dict(storage_options or {})))
    # Rejected rows (manifests written by `kvbatch prefill` may hold some) are counted, not written.
    for outcome in DecodeLoop(llm, jobs, report, skip=skip, response_cache=response_cache):
        if isinstance(outcome, Refused):
            continue
        writer.add(outcome.job.index, results_row(outcome), snapshot)
        if progress is not None:
            progress.advance(1, outcome.completion_tokens)
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
    for counters in ("connector", "response_cache"):  # per-run counters: summed over every run and rank
        docs = [s[counters] for s in every if counters in s]
        if docs:
            out[counters] = sum_counters(docs)
    specs = [s["speculative"] for s in every if "speculative" in s]
    if specs:
        out["speculative"] = _merge_speculative(specs)
    stores = [s["store"] for s in final if "store" in s]
    if stores:
        out["store"] = sum_counters(stores)
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
    out = sum_counters(docs)
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
    response_cache: Any = None,
) -> dict[str, Any]:
    """Generate every request of a shard's manifests, loading the stored prompt KV, committing a
    part every ``checkpoint_rows`` results into ``parts_url`` (default: a dot folder beside the
    results); a re-run after a crash resumes from the last part. Then commit the results."""
    parts_url = parts_url or default_parts_url(results_url)
    key = start_decode(manifests_url, parts_url, storage_options)
    stats = decode_rank(llm, manifests_url, parts_url, key=key, attempt=uuid.uuid4().hex[:12],
                        storage_options=storage_options, checkpoint_rows=checkpoint_rows, progress=progress,
                        response_cache=response_cache)
    return commit_parts([stats], parts_url, results_url, stats_url=stats_url, storage_options=storage_options)
