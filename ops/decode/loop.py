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
from the entry, that never enters the engine; a miss runs and its answer is written. The loop
then drives the engine step by step (``admit``, ``step``), so that a long run of hits is handed
out as it is found, not held until the engine's next result.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from kvbatch.engine.runtime.llm import LLM, GenerationRequest, Result
from kvbatch.io.batch_requests import WHOLE_LINE, InputStreamError, RejectedRow
from kvbatch.io.urls import redact_text
from kvbatch.ops.decode.lazy_engine import LazyEngine, engine_started
from kvbatch.ops.decode.report import BatchReport
from kvbatch.ops.decode.response_cache import (
    LOOKUP_BATCH,
    ResponseCache,
    ResponseCacheMismatch,
    difference,
    result_from_body,
)
from kvbatch.ops.jobs import Job, Rejected

log = logging.getLogger("kvbatch.ops.decode")


@dataclass
class Answered:
    """A request the engine finished."""

    job: Job
    result: Result
    cached: bool = False  # served from the response cache, not computed


@dataclass
class Refused:
    """A row that did not run: rejected at reading or tokenizing, or the broken input's last line."""

    index: int
    row: RejectedRow


class DecodeLoop:
    """Iterate to run ``jobs`` through ``llm``; ``report`` counts requests, rejects by field and
    every result. ``skip(job)``: jobs answered before (a resumed run) are passed over, uncounted.
    ``model_name``: warn once per model name a row asks for that is not the one answering.
    ``response_cache``: a :class:`~kvbatch.ops.decode.response_cache.ResponseCache` (plain
    engines only, not an expert-parallel group's lockstep engine)."""

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
        self._in_flight: dict[str, Job] = {}
        self._asked_for: set[str] = set()
        self.response_cache = response_cache
        if response_cache is not None and not isinstance(llm, LazyEngine) and type(llm).stream is not LLM.stream:
            raise ValueError("the response cache runs with one engine, not an expert-parallel group's")
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

    def _request(self, job: Job) -> GenerationRequest:
        self._in_flight[str(job.index)] = job
        return GenerationRequest(str(job.index), job.sampling, prompt_token_ids=job.prompt_token_ids)

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
                    yield self._request(admitted)
        except InputStreamError as exc:
            self._input_broke(exc, index)

    def __iter__(self) -> Iterator[Answered | Refused]:
        if self.response_cache is not None:
            yield from self._iter_cached(self.response_cache)
            return
        for result in self.llm.stream(self._requests()):
            while self._refused:
                yield self._refused.popleft()
            if result.error is not None:  # structured outputs: the grammar ended the row
                yield self._grammar_refusal(result)
                continue
            job = self._in_flight.pop(result.request_id)
            self.report.add_result(result)
            yield Answered(job, result)
        while self._refused:
            yield self._refused.popleft()
        assert not self._in_flight, "the engine answered every request it was fed"

    def _grammar_refusal(self, result: Result) -> Refused:
        """A request the engine ended with an error (structured outputs: a schema that cannot
        compile, a grammar that allows no token) as a per-row 400 in its place; never cached."""
        job = self._in_flight.pop(result.request_id)
        self._write.pop(result.request_id, None)
        self._verify.pop(result.request_id, None)
        self._refuse(job.index, RejectedRow(job.line_no, job.custom_id, "body.response_format", result.error or ""))
        return self._refused.pop()

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
            keys: dict[int, str] = {}
            admitted: list[Job | None] = []
            for job in chunk:
                index = job.index + 1
                ok = self._admit(job)
                admitted.append(ok)
                if ok is not None:
                    key = cache.key(ok)
                    if key is None:
                        cache.count(not_reusable=1)
                    else:
                        keys[ok.index] = key
            found = cache.lookup_many(list(keys.values()))
            for job in admitted:
                if job is None:
                    continue
                key = keys.get(job.index)
                if key is None:
                    yield self._request(job)
                    continue
                entry = found.get(key)
                if entry is None:
                    cache.count(misses=1)
                    self._write[str(job.index)] = key
                    yield self._request(job)
                elif cache.should_verify(key):
                    self._verify[str(job.index)] = (key, entry)
                    yield self._request(job)
                else:
                    result = result_from_body(str(job.index), job.prompt_token_ids, entry)
                    cache.count(hits=1, output_tokens_served=len(result.output_token_ids))
                    self.report.add_cached(result)
                    self._ready.append(Answered(job, result, cached=True))
            if self._ready or self._refused:
                yield None
            if broken is not None:
                self._input_broke(broken, index)
                return
            if len(chunk) < LOOKUP_BATCH:
                return

    def _finished(self, cache: ResponseCache, result: Result) -> Answered:
        job = self._in_flight.pop(result.request_id)
        self.report.add_result(result)
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
        return Answered(job, result)

    def _iter_cached(self, cache: ResponseCache) -> Iterator[Answered | Refused]:
        """:meth:`LLM.stream`'s loop (admit, step, drain at the end) over the misses, handing out
        the hits and refusals between steps. A :class:`~kvbatch.ops.decode.lazy_engine.LazyEngine`
        is built by the first miss's ``add_request``; until then nothing here touches it."""
        llm = self.llm
        cap = 2 * llm.engine_config.max_num_seqs
        source = self._cached_requests(cache)
        exhausted = False
        try:
            while True:
                while not exhausted and (not engine_started(llm) or len(llm.scheduler.waiting) < cap):
                    request = next(source, _END)
                    if request is _END:
                        exhausted = True
                    elif request is None:
                        break
                    else:
                        llm.add_request(request)
                while self._ready or self._refused:
                    yield self._ready.popleft() if self._ready else self._refused.popleft()
                if not engine_started(llm) or not llm.scheduler.has_work():
                    if exhausted:
                        if llm.connector is not None:
                            llm.connector.drain()
                        break
                    continue
                for result in llm.step():
                    if result.error is not None:
                        yield self._grammar_refusal(result)
                        continue
                    answered = self._finished(cache, result)
                    while self._refused:
                        yield self._refused.popleft()
                    yield answered
        finally:
            cache.flush()
            self.report.response_cache = cache.to_json()
        assert not self._in_flight, "the engine answered every request it was fed"


_END = object()
