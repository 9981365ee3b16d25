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

A row of ``n`` choices is one output line (:func:`answer_line`): ``choices[i]`` (``index`` i) is
choice i, and ``usage`` counts the prompt once and every choice's output tokens, as OpenAI's does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import nullcontext
from typing import Any

from kvbatch.engine.runtime.llm import LLM, Result
from kvbatch.io.batch_output import (
    JsonlWriter,
    OrderedJsonlWriter,
    TokenLogprob,
    error_line,
    result_line,
)
from kvbatch.io.batch_requests import read_requests
from kvbatch.ops.decode.loop import Answered, DecodeLoop, Refused
from kvbatch.ops.decode.report import BatchReport
from kvbatch.ops.jobs import IncompleteInput, Job, Rejected, tokenize_requests
from kvbatch.ops.prefill.manifests import manifest_jobs, read_manifests


def result_logprobs(llm: LLM, result: Result) -> list[TokenLogprob] | None:
    if result.logprobs is None or llm.tokenizer is None:
        return None
    tok = llm.tokenizer

    def text(i: int) -> str:
        return tok.decode([i], skip_special_tokens=False)

    return [
        TokenLogprob(text(e["token_id"]), e["logprob"], tuple((text(i), lp) for i, lp in e.get("top", [])))
        for e in result.logprobs
    ]


def result_draft_tokens(llm: LLM, result: Result) -> tuple[int, int] | None:
    """(accepted, rejected) draft tokens of a speculative engine's answer, else None."""
    if llm.spec is None:
        return None
    return result.spec_accepted_tokens, result.spec_draft_tokens - result.spec_accepted_tokens


def answer_line(llm: LLM, answered: Answered, model_name: str, *,
                cached_tokens: int | None = None) -> dict[str, Any]:
    """The output line of an answered row in its endpoint's shape: every choice, in order
    (``index`` i), each built as a row of one choice would be; ``usage`` with the prompt once and the
    choices' output (and draft) tokens summed. ``cached_tokens``: the row's
    ``prompt_tokens_details.cached_tokens`` (:attr:`Answered.cached_prompt_tokens`), or None for none.
    A completions row with ``echo`` (:attr:`Job.echo`) has the prompt's text before each choice's:
    only the line changes, the engine's answer (and what the response cache holds) is as generated."""
    job = answered.job
    echo = job.echo or ""
    draft = [result_draft_tokens(llm, r) for r in answered.choices]
    drafted = None if draft[0] is None else (sum(d[0] for d in draft if d), sum(d[1] for d in draft if d))
    lines = [result_line(job.custom_id, job.line_no, text=echo + r.text, finish_reason=r.finish_reason,
                         prompt_tokens=answered.prompt_tokens,
                         completion_tokens=answered.completion_tokens if i == 0 else len(r.output_token_ids),
                         model=model_name, logprobs=result_logprobs(llm, r), draft_tokens=drafted,
                         endpoint=job.endpoint, cached_tokens=cached_tokens,
                         response_format=job.sampling.response_format, choice=i)
             for i, r in enumerate(answered.choices)]
    line = lines[0]
    if len(lines) > 1:  # the first line carries the row's usage; the others lend their choice
        choices = line["response"]["body"]["choices"]
        for i, other in enumerate(lines[1:], start=1):
            choices.append(dict(other["response"]["body"]["choices"][0], index=i))
    return line


def run_jobs(
    llm: LLM,
    jobs: Iterator[Job | Rejected],
    output_url: str | OrderedJsonlWriter,
    *,
    errors_url: str | JsonlWriter | None = None,
    model_name: str = "kvbatch",
    storage_options: dict[str, Any] | None = None,
    on_progress: Callable[[int, int], None] | None = None,
    response_cache: Any = None,
    on_answered: Callable[[Answered], None] | None = None,
) -> BatchReport:
    """Run the jobs through ``llm``, writing one output line per job in index order.
    ``response_cache``: a :class:`~kvbatch.ops.decode.response_cache.ResponseCache`.
    ``on_answered``: called with each answered row before its line is put (a worker rank's sink
    keeps the row's figures beside its line).

    ``output_url`` and ``errors_url`` are URLs, or writers the caller already opened (the
    CLI opens its outputs before loading the model, so an unwritable one fails first); this
    commits them on success and discards them on any error except :class:`IncompleteInput`.
    """
    report = BatchReport.start(llm)
    out = output_url if isinstance(output_url, OrderedJsonlWriter) else \
        OrderedJsonlWriter(output_url, storage_options=storage_options)
    if isinstance(errors_url, JsonlWriter):
        errors_cm: Any = errors_url
    else:
        errors_cm = JsonlWriter(errors_url, storage_options=storage_options) if errors_url else nullcontext()
    loop = DecodeLoop(llm, jobs, report, model_name=model_name, response_cache=response_cache)
    with out, errors_cm as errors:
        for outcome in loop:
            if isinstance(outcome, Refused):
                line = error_line(outcome.row)
                out.put(outcome.index, line)
                if errors is not None:
                    errors.write(line)
            else:
                if on_answered is not None:
                    on_answered(outcome)
                out.put(outcome.job.index, answer_line(llm, outcome, model_name))
            if on_progress:
                on_progress(report.succeeded + report.rejected, report.rejected)
    report.finish(llm)
    if loop.broken is not None:
        raise IncompleteInput(loop.broken, report)
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
    response_cache: Any = None,
) -> BatchReport:
    """Run every request of ``input_url`` through ``llm``; write ``output_url`` (and the errors).

    ``on_progress(done, rejected)`` is called after each finished or rejected request;
    ``strict`` rejects rows with unknown fields instead of warning about them. Raises
    :class:`~kvbatch.io.batch_requests.InputStreamError` when the input cannot be opened and
    :class:`IncompleteInput` when it breaks part-way (see the module docstring).
    """
    jobs = tokenize_requests(llm, read_requests(input_url, storage_options=storage_options, strict=strict))
    return run_jobs(llm, jobs, output_url, errors_url=errors_url, model_name=model_name,
                    storage_options=storage_options, on_progress=on_progress, response_cache=response_cache)


def run_decode(
    llm: LLM,
    manifests_url: str,
    output_url: str,
    *,
    errors_url: str | None = None,
    model_name: str = "kvbatch",
    storage_options: dict[str, Any] | None = None,
    on_progress: Callable[[int, int], None] | None = None,
    response_cache: Any = None,
) -> BatchReport:
    """Generate from manifests, loading each prompt's stored blocks instead of recomputing them."""
    jobs = manifest_jobs(llm, read_manifests(manifests_url, storage_options))
    return run_jobs(llm, jobs, output_url, errors_url=errors_url, model_name=model_name,
                    storage_options=storage_options, on_progress=on_progress, response_cache=response_cache)
