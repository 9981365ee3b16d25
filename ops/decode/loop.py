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
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from kvbatch.engine.runtime.llm import LLM, GenerationRequest, Result
from kvbatch.io.batch_requests import WHOLE_LINE, InputStreamError, RejectedRow
from kvbatch.io.urls import redact_text
from kvbatch.ops.decode.report import BatchReport
from kvbatch.ops.jobs import Job, Rejected

log = logging.getLogger("kvbatch.ops.decode")


@dataclass
class Answered:
    """A request the engine finished."""

    job: Job
    result: Result


@dataclass
class Refused:
    """A row that did not run: rejected at reading or tokenizing, or the broken input's last line."""

    index: int
    row: RejectedRow


class DecodeLoop:
    """Iterate to run ``jobs`` through ``llm``; ``report`` counts requests, rejects by field and
    every result. ``skip(job)``: jobs answered before (a resumed run) are passed over, uncounted.
    ``model_name``: warn once per model name a row asks for that is not the one answering."""

    def __init__(self, llm: LLM, jobs: Iterable[Job | Rejected], report: BatchReport, *,
                 skip: Callable[[Job | Rejected], bool] | None = None, model_name: str | None = None) -> None:
        self.llm = llm
        self.jobs = jobs
        self.report = report
        self.skip = skip
        self.model_name = model_name
        self.broken: InputStreamError | None = None
        self._refused: deque[Refused] = deque()
        self._in_flight: dict[str, Job] = {}
        self._asked_for: set[str] = set()

    def _refuse(self, index: int, row: RejectedRow) -> None:
        report = self.report
        report.rejected += 1
        report.rejects_by_field[row.field] = report.rejects_by_field.get(row.field, 0) + 1
        self._refused.append(Refused(index, row))

    def _requests(self) -> Iterator[GenerationRequest]:
        index = 0
        try:
            for job in self.jobs:
                index = job.index + 1
                if self.skip is not None and self.skip(job):
                    continue
                self.report.requests += 1
                if isinstance(job, Rejected):
                    self._refuse(job.index, job.row)
                    continue
                if (self.model_name is not None and job.model is not None and job.model != self.model_name
                        and job.model not in self._asked_for):
                    self._asked_for.add(job.model)
                    log.warning("line %d asks for model %r; every row is answered by %r, which the output "
                                "names (warned once per model name)", job.line_no, job.model, self.model_name)
                self._in_flight[str(job.index)] = job
                yield GenerationRequest(str(job.index), job.sampling, prompt_token_ids=job.prompt_token_ids)
        except InputStreamError as exc:
            # Stop reading; the requests in flight still finish. The last row says where the input
            # broke, so the committed output cannot pass for complete.
            self.broken = exc
            self.report.requests += 1
            self._refuse(index, RejectedRow(exc.lines_read + 1, None, WHOLE_LINE,
                                            f"input ends here, unreadable: {redact_text(exc.reason, exc.url)}"))

    def __iter__(self) -> Iterator[Answered | Refused]:
        for result in self.llm.stream(self._requests()):
            while self._refused:
                yield self._refused.popleft()
            job = self._in_flight.pop(result.request_id)
            self.report.add_result(result)
            yield Answered(job, result)
        while self._refused:
            yield self._refused.popleft()
        assert not self._in_flight, "the engine answered every request it was fed"
