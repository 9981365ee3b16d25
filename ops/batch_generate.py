"""The batch generate step: a request file in, one output line per request out, in input order.

Plain Python (no Dagster): the ``kvbatch generate`` command and the pipeline's decode step both
call :func:`run_batch`. Bad rows never abort the batch: each becomes an error line naming the
line, the field and the reason, in the output (where the request would have been) and in the
optional errors file. Memory stays bounded: requests are read lazily, only the requests in
flight and the out-of-order tail of the output are held.

An input stream that breaks part-way (:class:`~kvbatch.io.batch_requests.InputStreamError`:
a truncated ``.gz``, a read error) loses nothing already read: the requests read before the
break are all answered, the output gets one last error line saying where and why the input
ended, it is committed, and then :class:`IncompleteInput` is raised with the report, so the
caller can still write metrics and must say the batch is incomplete.

Every output line names the model that ran (``model_name``), whatever a row's ``model`` asked
for; a run warns once per model name it was asked for and did not run.
"""

from __future__ import annotations

import logging
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
from kvbatch.io.batch_requests import WHOLE_LINE, InputStreamError, RejectedRow, read_requests
from kvbatch.ops.batch_report import BatchReport
from kvbatch.ops.jobs import Job, Rejected, tokenize_requests

log = logging.getLogger(__name__)


class IncompleteInput(Exception):
    """The input broke part-way; everything read before the break was answered and the output
    committed (its last line says where the input ended). ``report`` is the run's report."""

    def __init__(self, error: InputStreamError, report: BatchReport) -> None:
        self.error = error
        self.report = report
        super().__init__(str(error))


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
    output_url: str | OrderedJsonlWriter,
    *,
    errors_url: str | JsonlWriter | None = None,
    model_name: str = "kvbatch",
    storage_options: dict[str, Any] | None = None,
    on_progress: Callable[[int, int], None] | None = None,
) -> BatchReport:
    """Run the jobs through ``llm``, writing one output line per job in index order.

    ``output_url`` and ``errors_url`` are URLs, or writers the caller already opened (the
    CLI opens its outputs before loading the model, so an unwritable one fails first); this
    commits them on success and discards them on any error except :class:`IncompleteInput`.
    """
    report = BatchReport.start(llm)
    in_flight: dict[str, Job] = {}
    broken: list[InputStreamError] = []
    asked_for: set[str] = set()
    out = output_url if isinstance(output_url, OrderedJsonlWriter) else \
        OrderedJsonlWriter(output_url, storage_options=storage_options)
    if isinstance(errors_url, JsonlWriter):
        errors_cm: Any = errors_url
    else:
        errors_cm = JsonlWriter(errors_url, storage_options=storage_options) if errors_url else nullcontext()
    with out, errors_cm as errors:

        def put_rejected(index: int, row: RejectedRow) -> None:
            line = error_line(row)
            out.put(index, line)
            if errors is not None:
                errors.write(line)
            report.rejected += 1
            report.rejects_by_field[row.field] = report.rejects_by_field.get(row.field, 0) + 1

        def engine_requests() -> Iterator[GenerationRequest]:
            index = 0
            try:
                for job in jobs:
                    index = job.index + 1
                    report.requests += 1
                    if isinstance(job, Rejected):
                        put_rejected(job.index, job.row)
                        if on_progress:
                            on_progress(report.succeeded + report.rejected, report.rejected)
                        continue
                    if job.model is not None and job.model != model_name and job.model not in asked_for:
                        asked_for.add(job.model)
                        log.warning("line %d asks for model %r; every row is answered by %r, which the output "
                                    "names (warned once per model name)", job.line_no, job.model, model_name)
                    key = str(job.index)
                    in_flight[key] = job
                    yield GenerationRequest(key, job.sampling, prompt_token_ids=job.prompt_token_ids)
            except InputStreamError as exc:
                # Stop reading, let the requests in flight finish, and end the output with a line
                # that says where the input broke, so the committed file cannot pass for complete.
                broken.append(exc)
                report.requests += 1
                put_rejected(index, RejectedRow(exc.lines_read + 1, None, WHOLE_LINE,
                                                f"input ends here, unreadable: {exc.reason}"))

        for result in llm.stream(engine_requests()):
            job = in_flight.pop(result.request_id)
            out.put(job.index, result_line(
                job.custom_id, job.line_no, text=result.text, finish_reason=result.finish_reason,
                prompt_tokens=len(result.prompt_token_ids), completion_tokens=len(result.output_token_ids),
                model=model_name, logprobs=_logprobs(llm, result),
                draft_tokens=(result.spec_accepted_tokens, result.spec_draft_tokens - result.spec_accepted_tokens)
                if llm.spec is not None else None,
            ))
            report.add_result(result)
            if on_progress:
                on_progress(report.succeeded + report.rejected, report.rejected)
    report.finish(llm)
    if broken:
        raise IncompleteInput(broken[0], report)
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
    strict: bool = False,
) -> BatchReport:
    """Run every request of ``input_url`` through ``llm``; write ``output_url`` (and the errors).

    ``on_progress(done, rejected)`` is called after each finished or rejected request;
    ``strict`` rejects rows with unknown fields instead of warning about them. Raises
    :class:`~kvbatch.io.batch_requests.InputStreamError` when the input cannot be opened and
    :class:`IncompleteInput` when it breaks part-way (see the module docstring).
    """
    jobs = tokenize_requests(llm, read_requests(input_url, storage_options=storage_options, strict=strict))
    return run_jobs(llm, jobs, output_url, errors_url=errors_url, model_name=model_name,
                    storage_options=storage_options, on_progress=on_progress)
