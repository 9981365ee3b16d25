"""The one decode loop: jobs in, each job's outcome out, in the order the engine finishes them.

Every path that answers requests runs it: ``kvbatch generate`` and ``kvbatch decode`` (one
process or a worker group's ranks), the pipeline's decode of a shard and ``kvbatch serve``'s
batches. They differ only in where an outcome goes (an ordered JSONL output, a rank's part files,
a batch's work folder), never in how jobs reach the engine, how a rejected row or a broken input
is accounted, or what the report counts.

:class:`DecodeLoop` feeds the engine lazily (only the requests in flight are held) and yields an
:class:`Answered` per finished request and a :class:`Refused` per row that cannot run, in place
of the request. An input stream that breaks part-way (:class:`~kvbatch.io.batch_requests.InputStreamError`)
stops the reading, lets the requests in flight finish and ends with one :class:`Refused` row
saying where and why the input ended; the error is kept in :attr:`DecodeLoop.broken`.

With a ``response_cache`` (:mod:`kvbatch.ops.decode.response_cache`) the loop looks rows up in
batches before they reach the engine: a hit is an :class:`Answered` with ``cached`` set, rebuilt
from the entry, that never enters the engine; a miss runs and its answer is written. Whenever
hits are waiting, the requests fed to the engine's ``stream`` hold a tick (a None), which the
engine hands back before its next step (:meth:`LLM.stream <kvbatch.engine.runtime.llm.LLM.stream>`),
so a long run of hits is handed out as it is found, not held until the engine's next result.
Any engine with that ``stream`` takes the cache: one process's, a lazily built one
(:class:`~kvbatch.ops.decode.lazy_engine.LazyEngine`) and an expert-parallel rank's lockstep
engine (:class:`~kvbatch.ops.decode.group.LockstepLLM`), whose group steps while any rank has work
and waits, stepping nothing, while a rank is still reading hits.

**Choices** (``n``, :attr:`Job.n <kvbatch.ops.jobs.Job.n>`): a row of n choices is n engine
requests over its one prompt, ids :func:`~kvbatch.ops.jobs.choice_request_id` (the row's index,
then ``<index>.<i>``), sampled with :func:`~kvbatch.ops.jobs.choice_sampling` (a seeded row's
choice i draws from a seed derived from (seed, i)). They are fed together, so the scheduler
computes the prompt's full blocks once (a waiting request whose next block is being computed
waits a step and then hits the prefix cache); only the last, partial block is computed per choice.
The loop gathers them and yields one :class:`Answered` per row, with every choice in order, once
the last one finishes. A choice the engine ends with an error fails its whole row: one
:class:`Refused` (the first error's reason) in place of the row, the other choices dropped. With
the response cache each choice is looked up and stored under its own key (its own sampling
parameters, the derived seed included), so a row may be part served, part computed.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from kvbatch.engine.runtime.llm import LLM, GenerationRequest, Result
from kvbatch.engine.text.tool_calls import is_tools_spec
from kvbatch.io.batch_requests import WHOLE_LINE, InputStreamError, RejectedRow
from kvbatch.io.urls import redact_text
from kvbatch.ops.decode.report import BatchReport
from kvbatch.ops.decode.response_cache import (
    LOOKUP_BATCH,
    ResponseCache,
    ResponseCacheMismatch,
    difference,
    result_from_body,
)
from kvbatch.ops.jobs import Job, Rejected, choice_request_id, choice_sampling

log = logging.getLogger("kvbatch.ops.decode")


@dataclass
class Answered:
    """A row the engine finished (or the response cache served): one result per choice, in
    choice order (``choices[i]`` is ``choices[i].index`` of the answer)."""

    job: Job
    choices: list[Result]
    hits: list[bool] = field(default_factory=list)  # per choice: served from the response cache

    @property
    def result(self) -> Result:
        """The first choice: the whole answer of a row of one choice."""
        return self.choices[0]

    @property
    def cached(self) -> bool:
        """Every choice came from the response cache: the row took no engine work."""
        return bool(self.hits) and all(self.hits)

    @property
    def prompt_tokens(self) -> int:
        return len(self.choices[0].prompt_token_ids)

    @property
    def completion_tokens(self) -> int:
        """Every choice's output tokens (OpenAI's ``usage.completion_tokens`` of an n-choice row)."""
        return sum(len(r.output_token_ids) for r in self.choices)

    def lead(self) -> Result:
        """The choice that stands for the row's prompt: the computed one that computed the most of
        it (the fewest tokens from the prefix cache or the KV store; the first such), choice 0 when
        every choice came from the response cache. The other choices found that prompt's full
        blocks in the prefix cache; counting them again would count the prompt n times."""
        computed = [i for i, hit in enumerate(self.hits or [False] * len(self.choices)) if not hit]
        if not computed:
            return self.choices[0]
        return self.choices[min(computed, key=lambda i: (self.choices[i].num_cached_tokens
                                                         + self.choices[i].num_loaded_tokens, i))]

    @property
    def cached_prompt_tokens(self) -> int:
        """Prompt tokens not computed for the row (OpenAI's ``cached_tokens``), the prompt counted
        once: all of them when the response cache served every choice, else the lead choice's."""
        if self.cached:
            return self.prompt_tokens
        lead = self.lead()
        return min(lead.num_cached_tokens + lead.num_loaded_tokens, self.prompt_tokens)

    def totals(self) -> Result:
        """The row's figures as one :class:`Result` (for counting, not for the answer): the prompt
        and its cache figures and latencies of :meth:`lead`, every choice's output tokens,
        preemptions and drafts summed. A row of one choice is its result."""
        if len(self.choices) == 1:
            return self.choices[0]
        lead = self.lead()
        return dataclasses.replace(
            lead, request_id=str(self.job.index), text="", logprobs=None,
            output_token_ids=[t for r in self.choices for t in r.output_token_ids],
            num_preemptions=sum(r.num_preemptions for r in self.choices),
            spec_draft_tokens=sum(r.spec_draft_tokens for r in self.choices),
            spec_accepted_tokens=sum(r.spec_accepted_tokens for r in self.choices),
            spec_target_steps=sum(r.spec_target_steps for r in self.choices))


@dataclass
class _Row:
    """A row whose choices are being answered."""

    job: Job
    choices: list[Result | None]
    hits: list[bool]
    left: int
    failed: bool = False


@dataclass
class Refused:
    """A row that did not run: rejected at reading or tokenizing, or the broken input's last line."""

    index: int
    row: RejectedRow


class DecodeLoop:
    """Iterate to run ``jobs`` through ``llm``; ``report`` counts requests, rejects by field and
    every result. ``skip(job)``: jobs answered before (a resumed run) are passed over, uncounted.
    ``model_name``: warn once per model name a row asks for that is not the one answering.
    ``response_cache``: a :class:`~kvbatch.ops.decode.response_cache.ResponseCache`."""

    def __init__(self, llm: LLM, jobs: Iterable[Job | Rejected], report: BatchReport, *,
                 skip: Callable[[Job | Rejected], bool] | None = None, model_name: str | None = None,
                 response_cache: ResponseCache | None = None) -> None:
        self.llm = llm
        self.jobs = jobs
        self.report = report
        self.skip = skip
        self.model_name = model_name
        self.broken: InputStreamError | None = None
        self._refused: deque[Refused] = deque()
        self._in_flight: dict[str, tuple[int, int]] = {}  # request id -> (row index, choice)
        self._rows: dict[int, _Row] = {}  # row index -> its choices so far
        self._asked_for: set[str] = set()
        self.response_cache = response_cache
        self._ready: deque[Answered] = deque()  # cache hits not yet handed out
        self._verify: dict[str, tuple[str, dict]] = {}  # request id -> (key, entry) being recomputed
        self._write: dict[str, str] = {}  # request id -> key its answer is stored under

    def _refuse(self, index: int, row: RejectedRow) -> None:
        report = self.report
        report.rejected += 1
        report.rejects_by_field[row.field] = report.rejects_by_field.get(row.field, 0) + 1
        self._refused.append(Refused(index, row))

    def _admit(self, job: Job | Rejected) -> Job | None:
        """Count ``job`` (unless skipped); the job if it is to be answered, None if not."""
        if self.skip is not None and self.skip(job):
            return None
        self.report.requests += 1
        if isinstance(job, Rejected):
            self._refuse(job.index, job.row)
            return None
        if (self.model_name is not None and job.model is not None and job.model != self.model_name
                and job.model not in self._asked_for):
            self._asked_for.add(job.model)
            log.warning("line %d asks for model %r; every row is answered by %r, which the output "
                        "names (warned once per model name)", job.line_no, job.model, self.model_name)
        return job

    def _start(self, job: Job) -> None:
        self._rows[job.index] = _Row(job, [None] * job.n, [False] * job.n, job.n)

    def _request(self, job: Job, choice: int) -> GenerationRequest:
        request_id = choice_request_id(job.index, choice)
        self._in_flight[request_id] = (job.index, choice)
        return GenerationRequest(request_id, choice_sampling(job.sampling, choice),
                                 prompt_token_ids=job.prompt_token_ids)

    def _deliver(self, index: int, choice: int, result: Result, hit: bool) -> Answered | Refused | None:
        """Note one choice's result: the row's :class:`Answered` once its last choice is in, its
        :class:`Refused` at its first error, else None."""
        row = self._rows[index]
        row.choices[choice], row.hits[choice] = result, hit
        row.left -= 1
        out: Answered | Refused | None = None
        if result.error is not None and not row.failed:  # structured outputs: the grammar ended the row
            row.failed = True
            job = row.job
            # a tools row's grammar is its tools' (the engine's reason says "response_format": its field)
            where = "body.tools" if is_tools_spec(job.sampling.response_format) else "body.response_format"
            self._refuse(job.index, RejectedRow(job.line_no, job.custom_id, where, result.error))
            out = self._refused.pop()
        if row.left == 0:
            del self._rows[index]
            if not row.failed:
                answered = Answered(row.job, [r for r in row.choices if r is not None], row.hits)
                if answered.cached:
                    self.report.add_cached(answered.totals())
                else:
                    self.report.add_result(answered.totals())
                out = answered
        return out

    def _input_broke(self, exc: InputStreamError, index: int) -> None:
        # Stop reading; the requests in flight still finish. The last row says where the input
        # broke, so the committed output cannot pass for complete.
        self.broken = exc
        self.report.requests += 1
        self._refuse(index, RejectedRow(exc.lines_read + 1, None, WHOLE_LINE,
                                        f"input ends here, unreadable: {redact_text(exc.reason, exc.url)}"))

    def _requests(self) -> Iterator[GenerationRequest]:
        index = 0
        try:
            for job in self.jobs:
                index = job.index + 1
                admitted = self._admit(job)
                if admitted is not None:
                    self._start(admitted)
                    for choice in range(admitted.n):
                        yield self._request(admitted, choice)
        except InputStreamError as exc:
            self._input_broke(exc, index)

    def __iter__(self) -> Iterator[Answered | Refused]:
        cache = self.response_cache
        source = self._requests() if cache is None else self._cached_requests(cache)
        try:
            for result in self.llm.stream(source):
                out = None if result is None else self._finished(result)  # None: a tick, hits may wait
                while self._ready or self._refused:
                    yield self._ready.popleft() if self._ready else self._refused.popleft()
                if out is not None:
                    yield out
            while self._ready or self._refused:
                yield self._ready.popleft() if self._ready else self._refused.popleft()
        finally:
            if cache is not None:
                cache.flush()
                self.report.response_cache = cache.to_json()
        assert not self._in_flight and not self._rows, "the engine answered every request it was fed"

    # -- with the response cache ------------------------------------------------------------
    def _cached_requests(self, cache: ResponseCache) -> Iterator[GenerationRequest | None]:
        """The misses' requests; hits go to ``_ready``. Yields None whenever hits are waiting, so
        the caller hands them out before reading on."""
        it = iter(self.jobs)
        index = 0
        while True:
            chunk: list[Job | Rejected] = []
            broken: InputStreamError | None = None
            try:
                for job in it:
                    chunk.append(job)
                    if len(chunk) >= LOOKUP_BATCH:
                        break
            except InputStreamError as exc:
                broken = exc
            keys: dict[tuple[int, int], str] = {}  # (row index, choice) -> key
            admitted: list[Job | None] = []
            for job in chunk:
                index = job.index + 1
                ok = self._admit(job)
                admitted.append(ok)
                if ok is not None:
                    for choice in range(ok.n):  # each choice under its own key (its own seed)
                        key = cache.key(dataclasses.replace(ok, sampling=choice_sampling(ok.sampling, choice), n=1))
                        if key is None:
                            cache.count(not_reusable=1)
                        else:
                            keys[ok.index, choice] = key
            found = cache.lookup_many(list(keys.values()))
            for job in admitted:
                if job is None:
                    continue
                self._start(job)
                for choice in range(job.n):
                    key = keys.get((job.index, choice))
                    request_id = choice_request_id(job.index, choice)
                    entry = None if key is None else found.get(key)
                    if key is None:
                        yield self._request(job, choice)
                    elif entry is None:
                        cache.count(misses=1)
                        self._write[request_id] = key
                        yield self._request(job, choice)
                    elif cache.should_verify(key):
                        self._verify[request_id] = (key, entry)
                        yield self._request(job, choice)
                    else:
                        result = result_from_body(request_id, job.prompt_token_ids, entry)
                        cache.count(hits=1, output_tokens_served=len(result.output_token_ids))
                        out = self._deliver(job.index, choice, result, hit=True)
                        if isinstance(out, Answered):
                            self._ready.append(out)
            if self._ready or self._refused:
                yield None
            if broken is not None:
                self._input_broke(broken, index)
                return
            if len(chunk) < LOOKUP_BATCH:
                return

    def _finished(self, result: Result) -> Answered | Refused | None:
        """One engine result; with the cache, verified against its entry or written (never an
        error: a request the engine ended with one, structured outputs' grammar, is its row's 400,
        never cached)."""
        index, choice = self._in_flight.pop(result.request_id)
        cache = self.response_cache
        if cache is None or result.error is not None:
            self._write.pop(result.request_id, None)
            self._verify.pop(result.request_id, None)
            return self._deliver(index, choice, result, hit=False)
        job = self._rows[index].job
        verifying = self._verify.pop(result.request_id, None)
        if verifying is not None:
            key, entry = verifying
            cache.count(hits=1, output_tokens_served=len(result.output_token_ids))
            diff = difference(entry, result)
            if diff is not None:
                cache.put(key, result, replace=True)
                cache.flush()
                raise ResponseCacheMismatch(
                    f"response cache verify: line {job.line_no} (custom_id {job.custom_id!r}): the cached answer "
                    f"differs from its recomputation ({diff}); the entry {key} now holds the recomputed answer")
            cache.count(verified=1)
        else:
            key = self._write.pop(result.request_id, None)
            if key is not None:
                cache.put(key, result)
        return self._deliver(index, choice, result, hit=False)
