"""Prefill once, decode anywhere: the two halves of a disaggregated batch.

``run_prefill`` computes the KV of every prompt's full blocks that the store lacks, writes them,
and emits one manifest line per input row (rejected rows included, so nothing is lost between
the halves). ``run_decode`` reads the manifests in another process (or machine), loads the
blocks into its paged cache through the engine's KV connector, computes only the tail, and
writes the same output as ``kvbatch generate``.

An input stream that breaks part-way (a truncated ``.gz``) loses nothing read before the break,
as in ``kvbatch generate``: every row read is prefilled and has its manifest line, the manifests
end with a rejected line saying where and why the input ended (decode answers it as a rejected
row, so the results say so too), they are committed, and :class:`IncompletePrefill` is raised.

The manifest format is :mod:`kvbatch.ops.manifests`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from kvbatch.engine.runtime.llm import LLM, GenerationRequest
from kvbatch.io.batch_output import JsonlWriter
from kvbatch.io.batch_requests import WHOLE_LINE, ChatRequest, InputStreamError, RejectedRow, read_requests
from kvbatch.io.urls import redact_text
from kvbatch.ops.batch_generate import IncompleteInput, run_jobs
from kvbatch.ops.batch_report import BatchReport
from kvbatch.ops.jobs import Rejected, tokenize_requests
from kvbatch.ops.manifests import (
    MANIFEST_VERSION,
    attach_locations,
    manifest_jobs,
    manifest_line,
    read_manifests,
)


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


class IncompletePrefill(IncompleteInput):
    """:class:`~kvbatch.ops.batch_generate.IncompleteInput` of a prefill: the rows read before
    the break are prefilled and the manifests committed; ``report`` is the :class:`PrefillReport`."""

    report: PrefillReport  # type: ignore[assignment]


def _rejected_manifest(index: int, row: RejectedRow) -> dict[str, Any]:
    return {"v": MANIFEST_VERSION, "index": index, "custom_id": row.custom_id, "line_no": row.line_no,
            "rejected": {"field": row.field, "reason": row.reason}}


def run_prefill(
    llm: LLM,
    input_url: str | Iterable[ChatRequest | RejectedRow],
    manifests_url: str | JsonlWriter,
    *,
    model_name: str = "kvbatch",
    storage_options: dict[str, Any] | None = None,
    on_progress: Callable[[int], None] | None = None,
) -> PrefillReport:
    """Compute and store the prompt KV of every row of ``input_url``; write the manifests.

    ``input_url`` may be the rows already opened (:func:`~kvbatch.io.batch_requests.read_requests`)
    and ``manifests_url`` a writer already opened: the CLI opens both before it loads the model,
    so an unreadable input or unwritable output fails first. The writer is committed on success
    and on :class:`IncompletePrefill`, discarded on any other error.
    """
    if llm.connector is None:
        raise ValueError("prefill needs an LLM with a kv_store")
    store = llm.connector.store
    bs = llm.engine_config.block_size
    report = PrefillReport()
    started = time.perf_counter()
    computed_before = llm.stats["computed_prompt_tokens"]
    rows = read_requests(input_url, storage_options=storage_options) if isinstance(input_url, str) else input_url
    jobs = tokenize_requests(llm, iter(rows))
    broken: list[InputStreamError] = []
    # The lines wait here until the blocks are flushed: each then says where its blocks are
    # (block_locations), and none can be committed before the blocks it names are durable.
    lines: list[dict[str, Any]] = []
    out = manifests_url if isinstance(manifests_url, JsonlWriter) else \
        JsonlWriter(manifests_url, storage_options=storage_options)
    with out:

        def engine_requests() -> Iterator[GenerationRequest]:
            try:
                for job in jobs:
                    report.requests += 1
                    if isinstance(job, Rejected):
                        report.rejected += 1
                        lines.append(_rejected_manifest(job.index, job.row))
                    else:
                        report.prompt_tokens += len(job.prompt_token_ids)
                        manifest = manifest_line(llm, job, model_name)
                        keys = manifest["block_keys"]
                        if keys and not all(store.contains(keys)):
                            yield GenerationRequest(str(job.index), job.sampling,
                                                    prompt_token_ids=job.prompt_token_ids, prefill_only=True)
                        else:
                            report.prompt_tokens_already_stored += len(keys) * bs
                        lines.append(manifest)  # in input order, whatever the order of completion
                    if on_progress:
                        on_progress(report.requests)
            except InputStreamError as exc:
                # Stop reading; the requests already handed to the engine still run. The last
                # manifest line says where the input broke, so the file cannot pass for complete.
                broken.append(exc)
                lines.append(_rejected_manifest(report.requests, RejectedRow(exc.lines_read + 1, None, WHOLE_LINE,
                    f"input ends here, unreadable: {redact_text(exc.reason, exc.url)}")))
                report.requests += 1
                report.rejected += 1

        for _ in llm.stream(engine_requests()):
            pass
        # The end of the shard: the store's buffered blocks become segments before the manifests
        # that point at them are written and committed.
        llm.connector.flush()
        for line in attach_locations(llm, lines):
            out.write(line)
    report.wall_s = time.perf_counter() - started
    report.prompt_tokens_computed = llm.stats["computed_prompt_tokens"] - computed_before
    report.connector = llm.connector.stats.to_json()
    report.store = store.stats()
    if broken:
        raise IncompletePrefill(broken[0], report)
    return report


def run_decode(
    llm: LLM,
    manifests_url: str,
    output_url: str,
    *,
    errors_url: str | None = None,
    model_name: str = "kvbatch",
    storage_options: dict[str, Any] | None = None,
    on_progress: Callable[[int, int], None] | None = None,
) -> BatchReport:
    """Generate from manifests, loading each prompt's stored blocks instead of recomputing them."""
    jobs = manifest_jobs(llm, read_manifests(manifests_url, storage_options))
    return run_jobs(llm, jobs, output_url, errors_url=errors_url, model_name=model_name,
                    storage_options=storage_options, on_progress=on_progress)
