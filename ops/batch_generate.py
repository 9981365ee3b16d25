"""The batch generate step: a request file in, one output line per request out, in input order.

Plain Python (no Dagster): the ``kvbatch generate`` command and the pipeline's decode step both
call :func:`run_batch`. Bad rows never abort the batch: each becomes an error line naming the
line, the field and the reason, in the output (where the request would have been) and in the
optional errors file. Memory stays bounded: requests are read lazily, only the requests in
flight and the out-of-order tail of the output are held.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import nullcontext
from typing import Any

from kvbatch.engine.runtime.llm import LLM, GenerationRequest, Result
from kvbatch.io.batch_output import (
    JsonlWriter,
    OrderedJsonlWriter,
    TokenLogprob,
    error_line,
    result_line,
)
from kvbatch.io.batch_requests import read_requests
from kvbatch.ops.batch_report import BatchReport
from kvbatch.ops.jobs import Job, Rejected, tokenize_requests


def _logprobs(llm: LLM, result: Result) -> list[TokenLogprob] | None:
    if result.logprobs is None or llm.tokenizer is None:
        return None
    tok = llm.tokenizer

    def text(i: int) -> str:
        return tok.decode([i], skip_special_tokens=False)

    return [
        TokenLogprob(text(e["token_id"]), e["logprob"], tuple((text(i), lp) for i, lp in e.get("top", [])))
        for e in result.logprobs
    ]


def run_jobs(
    llm: LLM,
    jobs: Iterator[Job | Rejected],
    output_url: str,
    *,
    errors_url: str | None = None,
    model_name: str = "kvbatch",
    storage_options: dict[str, Any] | None = None,
    on_progress: Callable[[int, int], None] | None = None,
) -> BatchReport:
    """Run the jobs through ``llm``, writing one output line per job in index order."""
    report = BatchReport.start(llm)
    in_flight: dict[str, Job] = {}
    with OrderedJsonlWriter(output_url, storage_options=storage_options) as out, \
            (JsonlWriter(errors_url, storage_options=storage_options) if errors_url else nullcontext()) as errors:

        def engine_requests() -> Iterator[GenerationRequest]:
            for job in jobs:
                report.requests += 1
                if isinstance(job, Rejected):
                    line = error_line(job.row)
                    out.put(job.index, line)
                    if errors is not None:
                        errors.write(line)
                    report.rejected += 1
                    field_name = job.row.field
                    report.rejects_by_field[field_name] = report.rejects_by_field.get(field_name, 0) + 1
                    if on_progress:
                        on_progress(report.succeeded + report.rejected, report.rejected)
                    continue
                key = str(job.index)
                in_flight[key] = job
                yield GenerationRequest(key, job.sampling, prompt_token_ids=job.prompt_token_ids)

        for result in llm.stream(engine_requests()):
            job = in_flight.pop(result.request_id)
            out.put(job.index, result_line(
                job.custom_id, job.line_no, text=result.text, finish_reason=result.finish_reason,
                prompt_tokens=len(result.prompt_token_ids), completion_tokens=len(result.output_token_ids),
                model=job.model or model_name, logprobs=_logprobs(llm, result),
                draft_tokens=(result.spec_accepted_tokens, result.spec_draft_tokens - result.spec_accepted_tokens)
                if llm.spec is not None else None,
            ))
            report.add_result(result)
            if on_progress:
                on_progress(report.succeeded + report.rejected, report.rejected)
    report.finish(llm)
    return report


def run_batch(
    llm: LLM,
    input_url: str,
    output_url: str,
    *,
    errors_url: str | None = None,
    model_name: str = "kvbatch",
    storage_options: dict[str, Any] | None = None,
    on_progress: Callable[[int, int], None] | None = None,
) -> BatchReport:
    """Run every request of ``input_url`` through ``llm``; write ``output_url`` (and the errors).

    ``on_progress(done, rejected)`` is called after each finished or rejected request.
    """
    jobs = tokenize_requests(llm, read_requests(input_url, storage_options=storage_options))
    return run_jobs(llm, jobs, output_url, errors_url=errors_url, model_name=model_name,
                    storage_options=storage_options, on_progress=on_progress)
