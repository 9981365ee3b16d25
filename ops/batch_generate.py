"""The batch generate step: a request file in, one output line per request out, in input order.

Plain Python (no Dagster): the ``kvbatch generate`` command and the pipeline's decode step both
call :func:`run_batch`. Bad rows never abort the batch: each becomes an error line naming the
line, the field and the reason, in the output (where the request would have been) and in the
optional errors file. Memory stays bounded: requests are read lazily, only the requests in
flight and the out-of-order tail of the output are held.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

from kvbatch.engine.llm import LLM, GenerationRequest, Result
from kvbatch.engine.sampling_params import SamplingParams
from kvbatch.engine.tokenizer import ChatTokenizer
from kvbatch.io.batch_output import JsonlWriter, OrderedJsonlWriter, TokenLogprob, error_line, result_line
from kvbatch.io.batch_requests import ChatRequest, RejectedRow, read_requests, reject
from kvbatch.ops.metrics import percentile


@dataclass
class BatchReport:
    """What one batch did; ``to_json`` is the ``--metrics`` file."""

    requests: int = 0
    succeeded: int = 0
    rejected: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # served by the engine's in-memory prefix cache
    loaded_prompt_tokens: int = 0  # served by the external KV store
    output_tokens: int = 0
    wall_s: float = 0.0
    preemptions: int = 0
    ttft_s: list[float] = field(default_factory=list)
    tpot_s: list[float] = field(default_factory=list)
    rejects_by_field: dict[str, int] = field(default_factory=dict)
    # Speculative decoding: drafted tokens, drafts kept, target passes that decoded, seconds
    # spent drafting and in engine steps (the drafter's share of the step time).
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_target_steps: int = 0
    spec_enabled: bool = False
    draft_s: float = 0.0
    step_s: float = 0.0
    _since: tuple[float, float, float] = field(default=(0.0, 0.0, 0.0), repr=False)

    @classmethod
    def start(cls, llm: LLM) -> "BatchReport":
        """An empty report for a run of ``llm`` from now (its clock and drafter counters)."""
        report = cls(spec_enabled=llm.spec is not None)
        report._since = (time.perf_counter(), llm.stats["draft_s"], llm.stats["step_s"])
        return report

    def finish(self, llm: LLM) -> None:
        """Close the run started by :meth:`start`: wall time and the drafter's share of it."""
        t0, draft0, step0 = self._since
        self.wall_s = time.perf_counter() - t0
        self.draft_s = llm.stats["draft_s"] - draft0
        self.step_s = llm.stats["step_s"] - step0

    def add_result(self, result: Result) -> None:
        self.succeeded += 1
        self.prompt_tokens += len(result.prompt_token_ids)
        self.cached_prompt_tokens += result.num_cached_tokens
        self.loaded_prompt_tokens += result.num_loaded_tokens
        self.output_tokens += len(result.output_token_ids)
        self.preemptions += result.num_preemptions
        self.spec_draft_tokens += result.spec_draft_tokens
        self.spec_accepted_tokens += result.spec_accepted_tokens
        self.spec_target_steps += result.spec_target_steps
        self.ttft_s.append(result.ttft_s)
        if result.tpot_s is not None:
            self.tpot_s.append(result.tpot_s)

    def to_json(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "succeeded": self.succeeded,
            "rejected": self.rejected,
            "rejects_by_field": dict(sorted(self.rejects_by_field.items())),
            "prompt_tokens": self.prompt_tokens,
            "cached_prompt_tokens": self.cached_prompt_tokens,
            "loaded_prompt_tokens": self.loaded_prompt_tokens,
            "output_tokens": self.output_tokens,
            "wall_s": round(self.wall_s, 4),
            "output_tokens_per_s": round(self.output_tokens / self.wall_s, 3) if self.wall_s else 0.0,
            "total_tokens_per_s": round((self.prompt_tokens + self.output_tokens) / self.wall_s, 3)
            if self.wall_s else 0.0,
            "ttft_s_p50": percentile(self.ttft_s, 50),
            "ttft_s_p95": percentile(self.ttft_s, 95),
            "tpot_s_p50": percentile(self.tpot_s, 50),
            "tpot_s_p95": percentile(self.tpot_s, 95),
            "preemptions": self.preemptions,
            **(self._spec_json() if self.spec_enabled else {}),
        }

    def _spec_json(self) -> dict[str, Any]:
        steps = self.spec_target_steps
        return {"speculative": {
            "draft_tokens": self.spec_draft_tokens,
            "accepted_tokens": self.spec_accepted_tokens,
            "acceptance_rate": round(self.spec_accepted_tokens / self.spec_draft_tokens, 4)
            if self.spec_draft_tokens else 0.0,
            "target_steps": steps,
            # Tokens each decoding target pass kept from the drafter (the bonus token not counted).
            "mean_accepted_per_step": round(self.spec_accepted_tokens / steps, 4) if steps else 0.0,
            "drafter_time_share": round(self.draft_s / self.step_s, 4) if self.step_s else 0.0,
        }}


@dataclass
class Job:
    """One request ready for the engine: its place in the output and what to run."""

    index: int
    custom_id: str
    line_no: int
    prompt_token_ids: list[int]
    sampling: SamplingParams
    model: str | None = None


@dataclass
class Rejected:
    index: int
    row: RejectedRow


def to_engine_sampling(req: ChatRequest) -> SamplingParams:
    return SamplingParams(**dataclasses.asdict(req.sampling))


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


def tokenize_requests(llm: LLM, items: Iterator[ChatRequest | RejectedRow]) -> Iterator[Job | Rejected]:
    """Render and tokenize each valid row; a row the template refuses or that does not fit the
    context window becomes a rejection, like any other bad row."""
    if llm.tokenizer is None:
        raise ValueError("chat requests need a model with a tokenizer")
    for index, item in enumerate(items):
        yield tokenize_request(llm.tokenizer, llm.max_model_len, index, item)


def tokenize_request(tokenizer: ChatTokenizer, max_model_len: int, index: int,
                     item: ChatRequest | RejectedRow) -> Job | Rejected:
    """One row of :func:`tokenize_requests`; needs only the tokenizer, so a worker process that
    rebuilt it from the checkpoint's tokenizer source gives exactly the same answer."""
    if isinstance(item, RejectedRow):
        return Rejected(index, item)
    try:
        ids = tokenizer.encode_chat(item.messages)
    except ValueError as exc:  # a template that raises for this conversation
        return Rejected(index, reject(item, "body.messages", f"chat template failed: {exc}"))
    if len(ids) >= max_model_len:
        return Rejected(index, reject(item, "body.messages",
                                      f"prompt is {len(ids)} tokens; the context window is {max_model_len}"))
    return Job(index, item.custom_id, item.line_no, ids, to_engine_sampling(item), item.model)


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
