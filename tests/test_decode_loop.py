"""The one decode loop (kvbatch.ops.decode.loop.DecodeLoop), against an engine that finishes
requests in any order: every row that is not skipped comes out exactly once (answered or
refused, under its own index), the report counts exactly what came out, and a broken input ends
with one refused row right after the last row read."""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator

from hypothesis import given, settings
from hypothesis import strategies as st

from kvbatch.engine.runtime.llm import Result
from kvbatch.engine.runtime.sampling_params import SamplingParams
from kvbatch.io.batch_requests import WHOLE_LINE, InputStreamError, RejectedRow
from kvbatch.ops.decode.loop import Answered, DecodeLoop, Refused
from kvbatch.ops.decode.report import BatchReport
from kvbatch.ops.jobs import Job, Rejected


class ShuffledEngine:
    """Takes requests lazily, a window at a time, and finishes each window in a shuffled order."""

    spec = None

    def __init__(self, seed: int, window: int) -> None:
        self.rng = random.Random(seed)
        self.window = window
        self.stats = {"draft_s": 0.0, "step_s": 0.0}

    def stream(self, requests: Iterable, max_waiting: int | None = None) -> Iterator[Result]:
        it = iter(requests)
        while True:
            batch = [r for _, r in zip(range(self.window), it)]
            if not batch:
                return
            self.rng.shuffle(batch)
            for r in batch:
                yield Result(r.request_id, list(r.prompt_token_ids), [7, 8], "ok", "stop", 0, 0.01, 0.002)


def _jobs(kinds: list[bool], break_at: int | None) -> Iterator[Job | Rejected]:
    """The rows, breaking after ``break_at`` of them (after the last: a stream that fails to close)."""
    for i, ok in enumerate([*kinds, None]):
        if i == break_at:
            raise InputStreamError("s3://bucket/in.jsonl", i, "connection reset")
        if ok is None:
            return
        if ok:
            yield Job(i, f"c{i}", i + 1, [1, 2, 3], SamplingParams(max_tokens=2))
        else:
            yield Rejected(i, RejectedRow(i + 1, f"c{i}", "body.messages", "must not be empty"))


@settings(max_examples=60, deadline=None)
@given(kinds=st.lists(st.booleans(), max_size=40), data=st.data(), seed=st.integers(0, 99),
       window=st.integers(1, 6))
def test_every_row_comes_out_once_under_its_index(kinds, data, seed, window) -> None:
    n = len(kinds)
    break_at = data.draw(st.one_of(st.none(), st.integers(0, n)) if n else st.none())
    skipped = data.draw(st.sets(st.integers(0, max(n - 1, 0)), max_size=n)) if n else set()
    read = n if break_at is None else break_at
    report = BatchReport()
    loop = DecodeLoop(ShuffledEngine(seed, window), _jobs(kinds, break_at), report,
                      skip=lambda job: job.index in skipped)
    out = list(loop)

    indexes = [o.job.index if isinstance(o, Answered) else o.index for o in out]
    expected = [i for i in range(read) if i not in skipped]
    if break_at is not None:
        expected.append(read)  # the marker row, right after the last row read
        assert loop.broken is not None and loop.broken.lines_read == read
        marker = next(o for o in out if isinstance(o, Refused) and o.index == read)
        assert marker.row.field == WHOLE_LINE and "input ends here" in marker.row.reason
        assert "connection reset" in marker.row.reason
    else:
        assert loop.broken is None
    assert sorted(indexes) == expected
    answered = [o for o in out if isinstance(o, Answered)]
    assert all(kinds[o.job.index] for o in answered)
    assert all(o.result.request_id == str(o.job.index) for o in answered)
    assert report.requests == len(expected)
    assert report.succeeded == len(answered)
    assert report.rejected == len(out) - len(answered)
    assert sum(report.rejects_by_field.values()) == report.rejected
    assert report.output_tokens == 2 * len(answered)
