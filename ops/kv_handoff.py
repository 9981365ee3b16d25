"""Prefill once, decode anywhere: the two halves of a disaggregated batch.

``run_prefill`` computes the KV of every prompt's full blocks that the store lacks, writes them,
and emits one manifest line per input row (rejected rows included, so nothing is lost between
the halves). ``run_decode`` reads the manifests in another process (or machine), loads the
blocks into its paged cache through the engine's KV connector, computes only the tail, and
writes the same output as ``kvbatch generate``.

The manifest format is :mod:`kvbatch.ops.manifests`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from kvbatch.engine.runtime.llm import LLM, GenerationRequest
from kvbatch.io.batch_output import JsonlWriter
from kvbatch.io.batch_requests import read_requests
from kvbatch.ops.batch_generate import run_jobs
from kvbatch.ops.batch_report import BatchReport
from kvbatch.ops.jobs import Rejected, tokenize_requests
from kvbatch.ops.manifests import (
    MANIFEST_VERSION,
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


def run_prefill(
    llm: LLM,
    input_url: str,
    manifests_url: str,
    *,
    model_name: str = "kvbatch",
    storage_options: dict[str, Any] | None = None,
    on_progress: Callable[[int], None] | None = None,
) -> PrefillReport:
    """Compute and store the prompt KV of every row of ``input_url``; write the manifests."""
    if llm.connector is None:
        raise ValueError("prefill needs an LLM with a kv_store")
    store = llm.connector.store
    bs = llm.engine_config.block_size
    report = PrefillReport()
    started = time.perf_counter()
    computed_before = llm.stats["computed_prompt_tokens"]
    jobs = tokenize_requests(llm, read_requests(input_url, storage_options=storage_options))
    with JsonlWriter(manifests_url, storage_options=storage_options) as out:

        def engine_requests() -> Iterator[GenerationRequest]:
            for job in jobs:
                report.requests += 1
                if isinstance(job, Rejected):
                    report.rejected += 1
                    out.write({"v": MANIFEST_VERSION, "index": job.index, "custom_id": job.row.custom_id,
                               "line_no": job.row.line_no,
                               "rejected": {"field": job.row.field, "reason": job.row.reason}})
                else:
                    report.prompt_tokens += len(job.prompt_token_ids)
                    manifest = manifest_line(llm, job, model_name)
                    keys = manifest["block_keys"]
                    if keys and not all(store.contains(keys)):
                        yield GenerationRequest(str(job.index), job.sampling,
                                                prompt_token_ids=job.prompt_token_ids, prefill_only=True)
                    else:
                        report.prompt_tokens_already_stored += len(keys) * bs
                    # Manifests are written in input order; decode waits for the blocks it needs
                    # only through the store, so order of completion does not matter here.
                    out.write(manifest)
                if on_progress:
                    on_progress(report.requests)

        for _ in llm.stream(engine_requests()):
            pass
    report.wall_s = time.perf_counter() - started
    report.prompt_tokens_computed = llm.stats["computed_prompt_tokens"] - computed_before
    report.connector = llm.connector.stats.to_json()
    report.store = store.stats()
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
