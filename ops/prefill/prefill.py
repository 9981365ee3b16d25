"""The prefill stage, one algorithm (:func:`prefill_jobs`) for every caller: prefill once,
decode anywhere.

It computes the KV of every prompt's full blocks that the store lacks, writes them, and emits
one manifest line per input row (rejected rows included, so nothing is lost between the stages).
:func:`run_prefill` feeds it a request file (``kvbatch prefill``), :func:`prefill_shard` a
pipeline shard's table (the ``prefill_kv`` asset). Decode
(:func:`kvbatch.ops.decode.generate.run_decode`, :mod:`kvbatch.ops.decode.shard`) reads the
manifests in another process (or machine), loads the blocks into its paged cache through the
engine's KV connector, computes only the tail, and writes the same output as ``kvbatch generate``.

An input stream that breaks part-way (a truncated ``.gz``) loses nothing read before the break,
as in ``kvbatch generate``: every row read is prefilled and has its manifest line, the manifests
end with a rejected line saying where and why the input ended (decode answers it as a rejected
row, so the results say so too), they are committed, and :class:`IncompletePrefill` is raised.

The manifest format is :mod:`kvbatch.ops.prefill.manifests`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from kvbatch.engine.runtime.llm import LLM, GenerationRequest
from kvbatch.io.batch_output import JsonlWriter
from kvbatch.io.batch_requests import WHOLE_LINE, ChatRequest, InputStreamError, RejectedRow, read_requests
from kvbatch.io.prompt_table import record_request
from kvbatch.io.shard_tables import read_table, write_json
from kvbatch.io.urls import redact_text
from kvbatch.ops.jobs import IncompleteInput, Job, Rejected, request_job, tokenize_requests
from kvbatch.ops.prefill.manifests import MANIFEST_VERSION, attach_locations, manifest_line
from kvbatch.ops.results.metrics import ProgressMeter


@dataclass
class PrefillReport:
    requests: int = 0
    rejected: int = 0
    prompt_tokens: int = 0
    prompt_tokens_computed: int = 0
    prompt_tokens_already_stored: int = 0  # requests whose every block was in the store: not run
    wall_s: float = 0.0
    store: dict[str, Any] = field(default_factory=dict)
    connector: dict[str, Any] = field(default_factory=dict)
    broken: InputStreamError | None = None  # the input broke part-way (the manifests say where)

    def to_json(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "rejected": self.rejected,
            "prompt_tokens": self.prompt_tokens,
            "prompt_tokens_computed": self.prompt_tokens_computed,
            "prompt_tokens_already_stored": self.prompt_tokens_already_stored,
            "wall_s": round(self.wall_s, 4),
            "prefill_tokens_per_s": round(self.prompt_tokens_computed / self.wall_s, 3) if self.wall_s else 0.0,
            **self.connector,
            "store": self.store,
        }


class ShardModelMismatch(ValueError):
    """The shard was tokenized for another model or KV layout than the one prefilling it."""


class IncompletePrefill(IncompleteInput):
    """:class:`~kvbatch.ops.jobs.IncompleteInput` of a prefill: the rows read before
    the break are prefilled and the manifests committed; ``report`` is the :class:`PrefillReport`."""

    report: PrefillReport  # type: ignore[assignment]


def _rejected_manifest(index: int, row: RejectedRow) -> dict[str, Any]:
    return {"v": MANIFEST_VERSION, "index": index, "custom_id": row.custom_id, "line_no": row.line_no,
            "rejected": {"field": row.field, "reason": row.reason}}


def prefill_jobs(
    llm: LLM,
    items: Iterable[tuple[Job | Rejected, list[str] | None]],
    out: JsonlWriter,
    *,
    model_name: str = "kvbatch",
    on_row: Callable[[int], None] | None = None,
) -> PrefillReport:
    """The one prefill: compute and store the KV of every job's full blocks that the store lacks,
    then write one manifest line per item, in order (a rejected row's line says why).

    ``items`` pairs each job with the block keys recorded when its shard was made, or None; keys
    that differ from this engine's raise :class:`ShardModelMismatch` (the shard was made for
    another model or KV layout). ``on_row(tokens_computed)`` is called once per row as it is done
    (0 for a row whose blocks were all stored, or that was rejected). The lines wait until the
    blocks are flushed: each then says where its blocks are, and none is written before the
    blocks it names are durable. An input that breaks part-way (:class:`InputStreamError`) ends
    the manifests with a rejected line saying where; the report's ``broken`` holds the error.
    """
    if llm.connector is None:
        raise ValueError("prefill needs an LLM with a kv_store")
    store = llm.connector.store
    bs = llm.engine_config.block_size
    report = PrefillReport()
    started = time.perf_counter()
    computed_before = llm.stats["computed_prompt_tokens"]
    lines: list[dict[str, Any]] = []

    def engine_requests() -> Iterator[GenerationRequest]:
        try:
            for job, recorded_keys in items:
                report.requests += 1
                if isinstance(job, Rejected):
                    report.rejected += 1
                    lines.append(_rejected_manifest(job.index, job.row))
                    if on_row:
                        on_row(0)
                    continue
                report.prompt_tokens += len(job.prompt_token_ids)
                manifest = manifest_line(llm, job, model_name)
                keys = manifest["block_keys"]
                if recorded_keys is not None and keys != recorded_keys:
                    raise ShardModelMismatch(
                        f"{job.custom_id!r}: the shard's block keys differ from this model's; the shards were "
                        f"made for another model, dtype, weight format or block size: re-run prompt_shards")
                if keys and not all(store.contains(keys)):
                    yield GenerationRequest(str(job.index), job.sampling, prompt_token_ids=job.prompt_token_ids,
                                            prefill_only=True)
                else:
                    report.prompt_tokens_already_stored += len(keys) * bs
                    if on_row:
                        on_row(0)
                lines.append(manifest)  # in input order, whatever the order of completion
        except InputStreamError as exc:
            # Stop reading; the requests already handed to the engine still run. The last
            # manifest line says where the input broke, so the file cannot pass for complete.
            report.broken = exc
            lines.append(_rejected_manifest(report.requests, RejectedRow(exc.lines_read + 1, None, WHOLE_LINE,
                f"input ends here, unreadable: {redact_text(exc.reason, exc.url)}")))
            report.requests += 1
            report.rejected += 1

    for result in llm.stream(engine_requests()):
        if on_row:
            # The tokens this row computed: its full blocks less those the engine's prefix cache
            # or the store already held (what prompt_tokens_computed counts; the whole prompt
            # here made the log say 1,440 tokens where the metadata said 144).
            on_row(len(result.prompt_token_ids) - result.num_cached_tokens - result.num_loaded_tokens)
    # The store's buffered blocks become segments before the manifests that point at them are written.
    llm.connector.flush()
    for line in attach_locations(llm, lines):
        out.write(line)
    report.wall_s = time.perf_counter() - started
    report.prompt_tokens_computed = llm.stats["computed_prompt_tokens"] - computed_before
    report.connector = llm.connector.stats.to_json()
    report.store = store.stats()  # per tier: retries, failures, timeouts, breaker opens (outages show here)
    return report


def run_prefill(
    llm: LLM,
    input_url: str | Iterable[ChatRequest | RejectedRow],
    manifests_url: str | JsonlWriter,
    *,
    model_name: str = "kvbatch",
    storage_options: dict[str, Any] | None = None,
    on_progress: Callable[[int], None] | None = None,
) -> PrefillReport:
    """Compute and store the prompt KV of every row of ``input_url``; write the manifests
    (:func:`prefill_jobs`). ``on_progress(rows done)``.

    ``input_url`` may be the rows already opened (:func:`~kvbatch.io.batch_requests.read_requests`)
    and ``manifests_url`` a writer already opened: the CLI opens both before it loads the model,
    so an unreadable input or unwritable output fails first. The writer is committed on success
    and on :class:`IncompletePrefill`, discarded on any other error.
    """
    rows = read_requests(input_url, storage_options=storage_options) if isinstance(input_url, str) else input_url
    out = manifests_url if isinstance(manifests_url, JsonlWriter) else \
        JsonlWriter(manifests_url, storage_options=storage_options)
    done = [0]

    def row_done(_tokens: int) -> None:
        done[0] += 1
        if on_progress:
            on_progress(done[0])

    with out:
        report = prefill_jobs(llm, ((job, None) for job in tokenize_requests(llm, iter(rows))), out,
                              model_name=model_name, on_row=row_done)
    if report.broken is not None:
        raise IncompletePrefill(report.broken, report)
    return report


def shard_jobs(table: pa.Table) -> Iterator[tuple[Job, list[str]]]:
    """(engine job, block keys recorded at sharding) for every row of a shard table."""
    index = 0
    for batch in table.to_batches(max_chunksize=4096):
        for rec in batch.to_pylist():
            req = record_request(rec)
            yield request_job(index, req, list(rec["prompt_token_ids"])), list(rec["block_keys"])
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
    """Store the KV of every prompt's full blocks that the store lacks; write the manifests
    (:func:`~kvbatch.ops.prefill.prefill.prefill_jobs`, the same prefill as ``kvbatch prefill``).
    ``progress`` (rows done, tokens/s, ETA) advances by a row as each prompt is stored or found."""
    table = read_table(shard_table_url, storage_options=storage_options)
    if progress is not None:
        progress.restart()  # the rate covers the prefill, as wall_s does, not the table read before it
    with JsonlWriter(manifests_url, storage_options=storage_options) as out:
        report = prefill_jobs(llm, shard_jobs(table), out, model_name=model_name,
                              on_row=None if progress is None else lambda tokens: progress.advance(1, tokens))
    stats: dict[str, Any] = {
        "requests": report.requests, "prompt_tokens": report.prompt_tokens,
        "prompt_tokens_already_stored": report.prompt_tokens_already_stored, "wall_s": round(report.wall_s, 6),
        "prompt_tokens_computed": report.prompt_tokens_computed, "manifest_version": MANIFEST_VERSION,
        "connector": report.connector, "store": report.store}
    if progress is not None:
        # The last line is the step's own figures (a preempted row recomputes), as its metadata:
        # the same rounded wall time, or the rate's last digit can differ.
        progress.finish(tokens=stats["prompt_tokens_computed"], elapsed_s=stats["wall_s"])
    if stats_url:
        write_json(stats, stats_url, storage_options=storage_options)
    return stats
