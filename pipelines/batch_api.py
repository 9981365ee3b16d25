"""The Dagster job one ``kvbatch serve`` batch runs as: ``kvbatch_batch_api``.

A batch of the Files + Batches API is one run of this job over the batch's input file, so each
batch shows in the Dagster UI (tagged ``kvbatch/batch_id``) with its counts and tokens. The run
talks to the server only through a *work folder* on the object store, whose layout this module
owns (the server reads it with the same functions):

    <work>/part-<lo>-<hi>-<ok>.jsonl   output lines of input rows [lo, hi), in input order;
                                       ``ok`` of them succeeded (the rest are error lines)
    <work>/tail-<lo>.jsonl             rows finished after ``lo`` when the batch was cancelled
    <work>/cancel                      written by the server: stop, keep what is finished
    <work>/done.json                   written last by the run: completed | cancelled | failed

Every part is committed whole (a crash never leaves half a part), so a run started again over
the same folder — after the machine or the server died — resumes after the last committed part
and the batch still has exactly one line per input row.
"""

import json
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import dagster as dg
from fsspec.core import url_to_fs

from kvbatch.io.batch_output import JsonlWriter, error_line
from kvbatch.io.batch_requests import ChatRequest, RejectedRow, read_requests, reject
from kvbatch.io.urls import one_line
from kvbatch.resources import KVStoreResource, ModelResource, ObjectStoreResource

BATCH_JOB = "kvbatch_batch_api"
BATCH_TAG = "kvbatch/batch_id"
DONE, CANCEL = "done.json", "cancel"
DONE_STATUSES = ("completed", "cancelled", "failed")


# --------------------------------------------------------------------------------------------
# The work folder (read by the server, written by the run)


@dataclass(frozen=True)
class Part:
    """One committed part file: rows ``lo`` up to ``hi`` (exclusive), ``ok`` of them succeeded."""

    name: str
    lo: int
    hi: int
    ok: int

    @property
    def failed(self) -> int:
        return self.hi - self.lo - self.ok


def _fs(work_url: str, storage_options: Mapping[str, Any] | None) -> tuple[Any, str]:
    """The work folder's filesystem, its cached listing of the folder dropped first.

    fsspec keeps one filesystem instance per set of options, and s3fs caches every listing it
    makes: once a process has listed the folder, ``exists``, ``info`` and ``cat_file`` (which
    asks ``info`` for the size) answer from that listing, so a part, ``done.json`` or ``cancel``
    written since by *another* process (the run, the server) would stay "not found" for the life
    of this process. Every read here decides a batch's state, so each starts from S3 itself."""
    fs, root = url_to_fs(work_url, **dict(storage_options or {}))
    fs.invalidate_cache(root)
    return fs, root


def _join(work_url: str, name: str) -> str:
    return work_url.rstrip("/") + "/" + name


def list_parts(work_url: str, storage_options: Mapping[str, Any] | None = None) -> list[Part]:
    """The committed parts, in input order (``tail-`` files count their lines as they stand)."""
    fs, root = _fs(work_url, storage_options)
    try:
        names = [p.rsplit("/", 1)[-1] for p in fs.ls(root, detail=False)]
    except FileNotFoundError:
        return []
    parts = []
    for name in names:
        if name.startswith("part-") and name.endswith(".jsonl"):
            lo, hi, ok = (int(x) for x in name[5:-6].split("-"))
            parts.append(Part(name, lo, hi, ok))
        elif name.startswith("tail-") and name.endswith(".jsonl"):
            lines = [json.loads(x) for x in fs.cat_file(root + "/" + name).splitlines() if x.strip()]
            ok = sum(1 for line in lines if line.get("error") is None)
            lo = int(name[5:-6])
            parts.append(Part(name, lo, lo + len(lines), ok))
    return sorted(parts, key=lambda p: (p.lo, p.name.startswith("tail-")))


def read_part_lines(work_url: str, part: Part, storage_options: Mapping[str, Any] | None = None) -> list[bytes]:
    fs, root = _fs(work_url, storage_options)
    return [line + b"\n" for line in fs.cat_file(root + "/" + part.name).splitlines() if line.strip()]


def read_done(work_url: str, storage_options: Mapping[str, Any] | None = None) -> dict[str, Any] | None:
    """The run's last word (``status``, ``error``, token counts), or None while it runs."""
    fs, root = _fs(work_url, storage_options)
    try:
        return json.loads(fs.cat_file(root + "/" + DONE))
    except FileNotFoundError:
        return None


def request_cancel(work_url: str, storage_options: Mapping[str, Any] | None = None) -> None:
    fs, root = _fs(work_url, storage_options)
    fs.makedirs(root, exist_ok=True)
    fs.pipe_file(root + "/" + CANCEL, b"cancel\n")


def cancel_requested(work_url: str, storage_options: Mapping[str, Any] | None = None) -> bool:
    fs, root = _fs(work_url, storage_options)
    return bool(fs.exists(root + "/" + CANCEL))


def _write_json(url: str, obj: Mapping[str, Any], storage_options: Mapping[str, Any] | None) -> None:
    with JsonlWriter(url, storage_options=storage_options) as w:  # committed whole, or not at all
        w.write(obj)


# --------------------------------------------------------------------------------------------
# The run: plain Python over the engine


@dataclass
class RunSummary:
    status: str
    rows: int = 0
    succeeded: int = 0
    failed: int = 0
    resumed_from: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    wall_s: float = 0.0
    error: str | None = None
    response_cache: dict[str, Any] | None = None  # the response cache's counters, when it is on


def run_batch_parts(
    llm: Any,
    input_url: str,
    work_url: str,
    *,
    model_name: str,
    chunk_rows: int = 256,
    storage_options: Mapping[str, Any] | None = None,
    cancel_poll_s: float = 0.5,
    is_cancelled: Callable[[], bool] | None = None,
    response_cache: Any = None,
    endpoint: str | None = None,
) -> RunSummary:
    """Answer every row of ``input_url`` not yet in a committed part of ``work_url``, committing a
    part each time ``chunk_rows`` more rows are finished in order; stop early (keeping every
    finished row) when the server asks to cancel. Writes ``done.json`` last and returns it.
    ``response_cache``: a :class:`~kvbatch.ops.decode.response_cache.ResponseCache` (its counters:
    ``summary.response_cache``). ``endpoint``: the batch's; a row written for another one is its 400
    (as OpenAI requires every row of a batch to use the batch's endpoint)."""
    from kvbatch.ops.decode.generate import answer_line
    from kvbatch.ops.decode.loop import DecodeLoop, Refused
    from kvbatch.ops.decode.report import BatchReport
    from kvbatch.ops.jobs import tokenize_requests

    opts = dict(storage_options or {})
    started = time.monotonic()
    previous = read_done(work_url, opts)
    if previous is not None:  # this batch already ended: a second launch changes nothing
        return RunSummary(**{k: v for k, v in previous.items() if k in RunSummary.__dataclass_fields__})
    parts = [p for p in list_parts(work_url, opts) if p.name.startswith("part-")]
    resume = parts[-1].hi if parts else 0
    summary = RunSummary(status="completed", resumed_from=resume,
                         succeeded=sum(p.ok for p in parts), failed=sum(p.failed for p in parts))
    stop = is_cancelled or (lambda: cancel_requested(work_url, opts))
    lines: dict[int, dict[str, Any]] = {}
    next_lo = resume

    def flush(force: bool) -> None:
        nonlocal next_lo
        while True:
            hi = next_lo
            while hi in lines and hi - next_lo < chunk_rows:
                hi += 1
            if hi == next_lo or (hi - next_lo < chunk_rows and not force):
                return
            rows = [lines.pop(i) for i in range(next_lo, hi)]
            ok = sum(1 for r in rows if r["error"] is None)
            with JsonlWriter(_join(work_url, f"part-{next_lo:08d}-{hi:08d}-{ok:08d}.jsonl"),
                             storage_options=opts) as w:
                for r in rows:
                    w.write(r)
            summary.succeeded += ok
            summary.failed += len(rows) - ok
            next_lo = hi

    report = BatchReport.start(llm)
    rows = read_requests(input_url, storage_options=opts)
    if endpoint is not None:
        rows = (other_endpoint(item, endpoint) for item in rows)
    loop = DecodeLoop(llm, tokenize_requests(llm, rows), report,
                      skip=lambda job: job.index < resume, response_cache=response_cache)
    last_check = time.monotonic()
    cancelled = stop()
    if not cancelled:
        for outcome in loop:
            if isinstance(outcome, Refused):
                lines[outcome.index] = error_line(outcome.row)
                continue
            # Each row answers in its endpoint's shape (every choice of a row of n), with OpenAI's
            # cached_tokens: prompt tokens not computed for it (the engine's prefix cache or the KV
            # store served them; all of them when the response cache answered), the prompt counted once.
            cached = outcome.cached_prompt_tokens
            lines[outcome.job.index] = answer_line(llm, outcome, model_name, cached_tokens=cached)
            summary.prompt_tokens += outcome.prompt_tokens
            summary.cached_tokens += cached
            summary.output_tokens += outcome.completion_tokens
            flush(force=False)
            if time.monotonic() - last_check >= cancel_poll_s:
                last_check = time.monotonic()
                if stop():
                    cancelled = True
                    break
    flush(force=True)  # every finished row in order; on a cancel, what is left is out of order
    if cancelled:
        summary.status = "cancelled"
        if lines:
            tail = sorted(lines)
            with JsonlWriter(_join(work_url, f"tail-{tail[0]:08d}.jsonl"), storage_options=opts) as w:
                for i in tail:
                    w.write(lines[i])
            ok = sum(1 for i in tail if lines[i]["error"] is None)
            summary.succeeded += ok
            summary.failed += len(tail) - ok
    else:
        assert not lines, "every fed row was answered and written"
    summary.rows = summary.succeeded + summary.failed
    summary.response_cache = report.response_cache
    summary.wall_s = round(time.monotonic() - started, 3)
    _write_json(_join(work_url, DONE), asdict(summary), opts)
    return summary


def other_endpoint(item: ChatRequest | RejectedRow, endpoint: str) -> ChatRequest | RejectedRow:
    """The row, or its rejection when it was written for another endpoint than its batch's."""
    if isinstance(item, ChatRequest) and item.endpoint != endpoint:
        return reject(item, "url", f"the batch's endpoint is {endpoint}; this row's url is {item.endpoint}")
    return item


def write_failed(work_url: str, exc: BaseException, storage_options: Mapping[str, Any] | None = None) -> None:
    """Record a run that died of an error (the model did not load, the store is unreachable):
    the server then fails the batch with this one line as its reason."""
    _write_json(_join(work_url, DONE), asdict(RunSummary(status="failed", error=one_line(exc, work_url))),
                storage_options)


# --------------------------------------------------------------------------------------------
# Dagster wiring


class BatchApiRunConfig(dg.Config):
    batch_id: str
    input_url: str
    work_url: str
    chunk_rows: int = 256
    endpoint: str | None = None  # the batch's; None: each row answers for its own url


@dg.op(description="Answer one kvbatch serve batch: every row of its input file, one output line each, "
                   "committed in parts to its work folder (resumable, cancellable).")
def batch_api_run(context: dg.OpExecutionContext, config: BatchApiRunConfig, model: ModelResource,
                  object_store: ObjectStoreResource, kv_store: KVStoreResource) -> dg.Output:
    opts = object_store.options_for(config.work_url)
    try:
        # The pipeline's KV store: a prompt prefix stored by any earlier batch or nightly run is
        # loaded, not recomputed, and counted in the answer's cached_tokens.
        store = kv_store.open(object_store.url, object_store.storage_options(), model.engine_spec())
        llm = model.load(store, decode=True)
        cache = kv_store.open_response_cache(object_store.url, object_store.storage_options(), llm)
        try:
            summary = run_batch_parts(llm, config.input_url, config.work_url, model_name=model.model,
                                      chunk_rows=config.chunk_rows, storage_options=opts, response_cache=cache,
                                      endpoint=config.endpoint)
        finally:
            if cache is not None:
                cache.close()
    except Exception as exc:
        write_failed(config.work_url, exc, opts)
        raise
    context.log.info(f"batch {config.batch_id}: {summary.status}, {summary.succeeded} succeeded, "
                     f"{summary.failed} failed (resumed from row {summary.resumed_from})")
    return dg.Output(asdict(summary), metadata={
        "status": summary.status, "requests_succeeded": summary.succeeded, "requests_failed": summary.failed,
        "resumed_from_row": summary.resumed_from, "prompt_tokens": summary.prompt_tokens,
        "cached_prompt_tokens": summary.cached_tokens, "output_tokens": summary.output_tokens,
        "wall_s": summary.wall_s,
        **({f"response_cache_{k}": summary.response_cache[k] for k in ("hits", "misses", "writes")}
           if summary.response_cache else {})})


@dg.job(name=BATCH_JOB, executor_def=dg.in_process_executor,
        description="One batch of the OpenAI-compatible Batches API (kvbatch serve) over its input file.")
def batch_api_job() -> None:
    batch_api_run()


def batch_run_config(batch_id: str, input_url: str, work_url: str, chunk_rows: int,
                     endpoint: str | None = None) -> dict[str, Any]:
    config: dict[str, Any] = {"batch_id": batch_id, "input_url": input_url, "work_url": work_url,
                              "chunk_rows": chunk_rows}
    if endpoint is not None:
        config["endpoint"] = endpoint
    return {"ops": {"batch_api_run": {"config": config}}}
