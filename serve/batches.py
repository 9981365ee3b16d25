"""A batch's life, driven by the server: ``validating`` -> ``in_progress`` (a pipeline run over
its file) -> ``finalizing`` -> ``completed``; or ``failed`` (the file does not validate, or the
run failed), ``cancelling`` -> ``cancelled``.

The server is the only writer of batch records; the run writes only its work folder
(:mod:`kvbatch.pipelines.batch_api`). :meth:`BatchService.advance` moves a batch on from what it
finds there, so the same step serves a running server and one that restarted: a batch whose run
is gone (the machine or the server died with it) gets a new run, which resumes after the last
committed part, and a batch whose run finished while no server was up is finalized.

A batch not ended by its ``expires_at`` (its 24 h completion window) expires, as at OpenAI: its
run is told to stop, the rows it finished are in the output file, each row it never ran is a
``batch_expired`` line in the error file, and the batch reads ``expired``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

from kvbatch.io.batch_output import usage_counts
from kvbatch.io.batch_requests import ChatRequest, InputStreamError, RejectedRow, read_requests
from kvbatch.pipelines.batch_api import Part, list_parts, read_done, read_part_lines, request_cancel
from kvbatch.serve.errors import ApiError, not_found
from kvbatch.serve.files import FileService
from kvbatch.serve.launcher import Launcher
from kvbatch.serve.objects import (
    TERMINAL,
    WINDOW_S,
    BatchErrorItem,
    BatchErrors,
    BatchObject,
    BatchUsage,
    CreateBatch,
    RequestCounts,
)
from kvbatch.serve.settings import ServeSettings
from kvbatch.serve.state import StateStore

log = logging.getLogger(__name__)
MAX_LIST_LIMIT = 100
MAX_VALIDATION_ERRORS = 10  # reasons listed in a failed batch's ``errors``; the first lines say enough
EXPIRED_MESSAGE = "This request could not be executed before the completion window expired."  # OpenAI's words


def _failed(code: str, message: str, param: str | None = None) -> BatchErrors:
    return BatchErrors(data=[BatchErrorItem(code=code, message=message, param=param)])


class Uncovered(Exception):
    """The committed parts do not hold every input row exactly once."""


def _rows(lo: int, hi: int) -> str:
    """Rows [lo, hi) as the input's 1-based lines."""
    return f"input line {lo + 1}" if hi - lo == 1 else f"input lines {lo + 1}-{hi}"


def coverage_error(parts: list[Part], total: int, status: str | None) -> str | None:
    """None when ``parts`` (in input order) hold each input row at most once with no gap, and
    every one of the ``total`` rows when the run says ``completed``; else what is wrong. A
    cancelled run's ``tail-`` part (its rows finished out of order) may only come last."""
    at = 0
    for i, p in enumerate(parts):
        tail = p.name.startswith("tail-")
        if tail and (status != "cancelled" or i != len(parts) - 1):
            return f"a cancelled run's part {p.name} in a batch whose run says {status}"
        if tail:  # the rows after ``lo`` finished before the cancel, out of order: gaps are rows never run
            if p.lo < at:
                return f"{p.name} starts at a row already in a committed part"
            break
        if p.lo > at:
            return f"{_rows(at, p.lo)} are in no committed part"
        if p.lo < at:
            return f"{_rows(p.lo, min(at, p.hi))} are in two committed parts"
        at = p.hi
    if at > total:
        return f"the committed parts hold {at} rows; the input has {total}"
    if status == "completed" and at < total:
        return f"{_rows(at, total)} are in no committed part, yet the run says completed"
    return None


def _custom_id(raw: bytes | None) -> str | None:
    """An input line's ``custom_id`` when it has a usable one, for the error line of a row never run."""
    try:
        row = json.loads(raw) if raw else None
    except ValueError:
        return None
    cid = row.get("custom_id") if isinstance(row, dict) else None
    return cid if isinstance(cid, str) else None


def _ran(line: dict[str, Any], row: int, custom_id: str | None) -> bool:
    """Whether ``line`` of a cancelled run's tail is input row ``row``: an error line names its
    line, an answer its ``custom_id`` (the tail is in input order, so the first match is it)."""
    if line.get("error") is not None:
        return line["error"].get("line") == row + 1
    return line.get("custom_id") == custom_id


class BatchService:
    def __init__(self, store: StateStore, files: FileService, launcher: Launcher, settings: ServeSettings,
                 clock: Callable[[], float] | None = None) -> None:
        self.store = store
        self.files = files
        self.launcher = launcher
        self.settings = settings
        self.clock = clock or files.clock  # one clock for the batches and their files; tests pass their own
        self._lock = threading.RLock()
        self._batches: dict[str, dict[str, Any]] = {r["object"]["id"]: r for r in store.records("batches")}

    # -- reads

    def _record(self, owner: str, batch_id: str) -> dict[str, Any]:
        with self._lock:
            rec = self._batches.get(batch_id)
        if rec is None or rec["owner"] != owner:
            raise not_found("batch", batch_id)
        return rec

    def get(self, owner: str, batch_id: str) -> BatchObject:
        with self._lock:
            return BatchObject(**self._record(owner, batch_id)["object"])

    def list(self, owner: str, after: str | None, limit: int) -> dict[str, Any]:
        if not 1 <= limit <= MAX_LIST_LIMIT:
            raise ApiError(400, f"limit must be between 1 and {MAX_LIST_LIMIT}, got {limit}", param="limit")
        with self._lock:
            recs = [r for r in self._batches.values() if r["owner"] == owner]
        # Newest first, as OpenAI lists; created_at has whole seconds, the record's ns break ties.
        recs.sort(key=lambda r: (r["object"]["created_at"], r.get("created_ns", 0)), reverse=True)
        objs = [BatchObject(**r["object"]) for r in recs]
        if after:
            ids = [b.id for b in objs]
            if after not in ids:
                raise not_found("batch", after)
            objs = objs[ids.index(after) + 1:]
        page = objs[:limit]
        return {"object": "list", "data": [b.model_dump() for b in page],
                "first_id": page[0].id if page else None, "last_id": page[-1].id if page else None,
                "has_more": len(objs) > limit}

    # -- writes

    def _save(self, rec: dict[str, Any], obj: BatchObject) -> BatchObject:
        rec["object"] = obj.model_dump()
        self.store.put_record("batches", obj.id, rec)
        return obj

    def create(self, owner: str, body: CreateBatch) -> BatchObject:
        f = self.files.get(owner, body.input_file_id)  # another key's file is not found
        if f.purpose != "batch":
            raise ApiError(400, f"file {f.id} has purpose {f.purpose!r}; a batch's input must have purpose 'batch'",
                           param="input_file_id")
        now = int(self.clock())
        batch_id = "batch_" + uuid.uuid4().hex[:24]
        obj = BatchObject(id=batch_id, endpoint=body.endpoint, input_file_id=f.id,
                          completion_window=body.completion_window, status="validating", created_at=now,
                          expires_at=now + WINDOW_S, metadata=body.metadata, model=self.settings.model,
                          request_counts=RequestCounts())  # counted once validated, as OpenAI does
        rec: dict[str, Any] = {"owner": owner, "work_url": self.store.join("work", batch_id),
                               "input_url": self.files.content_url(owner, f.id), "attempts": 0, "worker": None,
                               "lines": self.files.lines(owner, f.id), "created_ns": time.time_ns()}
        if body.output_expires_after is not None:  # kept on the record: OpenAI's Batch object does not show it
            rec["output_expires_after_s"] = body.output_expires_after.seconds
        with self._lock:
            self._batches[batch_id] = rec
            return self._save(rec, obj)

    def cancel(self, owner: str, batch_id: str) -> BatchObject:
        with self._lock:
            rec = self._record(owner, batch_id)
            obj = BatchObject(**rec["object"])
            if obj.status in ("cancelling", "cancelled", "finalizing"):  # finalizing: every row has run
                return obj
            if obj.status in TERMINAL:
                raise ApiError(409, f"batch {batch_id} is {obj.status}; only a batch that has not ended can be "
                                    "cancelled", code="batch_not_cancellable")
            now = int(self.clock())
            rec.pop("expiring", None)  # the caller's cancel wins over an expiry not yet finalized
            if obj.status == "validating":  # no run yet: nothing to stop
                return self._save(rec, obj.model_copy(update={"status": "cancelled", "cancelling_at": now,
                                                              "cancelled_at": now}))
            request_cancel(rec["work_url"], self.store.storage_options)
            return self._save(rec, obj.model_copy(update={"status": "cancelling", "cancelling_at": now}))

    # -- the driver

    def active_ids(self) -> list[str]:
        with self._lock:
            return [i for i, r in self._batches.items() if r["object"]["status"] not in TERMINAL]

    def advance_all(self) -> None:
        try:
            self.files.sweep_expired()
        except Exception:  # expired files are unreachable already; their bytes go at a later poll
            log.exception("could not delete expired files (retried at the next poll)")
        for batch_id in self.active_ids():
            try:
                self.advance(batch_id)
            except Exception:  # one batch's trouble must not stop the others; retried at the next poll
                log.exception("batch %s: could not advance (retried at the next poll)", batch_id)

    def advance(self, batch_id: str) -> None:
        with self._lock:
            rec = self._batches[batch_id]
            obj = BatchObject(**rec["object"])
            if obj.status in ("validating", "in_progress") and obj.expires_at is not None \
                    and self.clock() >= obj.expires_at:
                if obj.status == "validating":  # never launched: every row expires unrun
                    rec["expiring"] = True
                    self._finalize(rec, obj, {"status": "cancelled"})
                    return
                if not rec.get("expiring"):
                    log.warning("batch %s: its completion window ended before it did; stopping its run", obj.id)
                    request_cancel(rec["work_url"], self.store.storage_options)
                    rec["expiring"] = True
                    self._save(rec, obj)
            if obj.status == "validating":
                self._validate_and_launch(rec, obj)
            elif obj.status in ("in_progress", "cancelling", "finalizing"):
                self._follow(rec, obj)

    def _validate_and_launch(self, rec: dict[str, Any], obj: BatchObject) -> None:
        now = int(self.clock())
        try:
            lines = self.files.lines(rec["owner"], obj.input_file_id)
        except ApiError:
            errors = _failed("file_not_found", f"input file {obj.input_file_id} was deleted before the batch ran",
                             "input_file_id")
            self._save(rec, obj.model_copy(update={"status": "failed", "failed_at": now, "errors": errors}))
            return
        if lines > self.settings.max_requests:
            errors = _failed("too_many_requests", f"the input has {lines} requests; the limit is "
                             f"{self.settings.max_requests} per batch", "input_file_id")
            self._save(rec, obj.model_copy(update={"status": "failed", "failed_at": now, "errors": errors}))
            return
        errors = self._unrunnable(rec["input_url"])
        if errors is not None:
            self._save(rec, obj.model_copy(update={"status": "failed", "failed_at": now, "errors": errors}))
            return
        self._launch(rec)
        self._save(rec, obj.model_copy(update={"status": "in_progress", "in_progress_at": now,
                                               "request_counts": RequestCounts(total=lines)}))

    def _unrunnable(self, url: str) -> BatchErrors | None:
        """A file with no request in it at all (not JSONL, another API's format) does not
        validate: the batch fails with the first lines' reasons rather than run to an error file
        of nothing but errors. Reading stops at the first valid request, which is usually line 1."""
        rejected: list[RejectedRow] = []
        try:
            items = read_requests(url, storage_options=self.store.storage_options)
            try:
                for item in items:
                    if isinstance(item, ChatRequest):
                        return None
                    rejected.append(item)
            finally:
                items.close()
        except InputStreamError as exc:
            return _failed("unreadable_file", exc.reason)
        items = [BatchErrorItem(code="invalid_request", message=f"line {r.line_no}: {r.field}: {r.reason}",
                                line=r.line_no, param=r.field) for r in rejected[:MAX_VALIDATION_ERRORS]]
        return BatchErrors(data=items or [BatchErrorItem(code="empty_file", message="the input file has no lines")])

    def _launch(self, rec: dict[str, Any]) -> None:
        obj = rec["object"]
        rec["attempts"] += 1
        # A relaunch of a batch whose input was deleted meanwhile fails in the run, which says why.
        # The run answers a row whose url is not the batch's endpoint with a 400 naming both.
        rec["worker"] = self.launcher.launch(obj["id"], rec["input_url"], rec["work_url"], self.settings.chunk_rows,
                                             endpoint=obj["endpoint"])
        log.info("batch %s: run %d launched", obj["id"], rec["attempts"])

    def _follow(self, rec: dict[str, Any], obj: BatchObject) -> None:
        opts = self.store.storage_options
        done = read_done(rec["work_url"], opts)
        if done is None and obj.status != "finalizing" and not self.launcher.alive(rec["worker"]):
            done = read_done(rec["work_url"], opts)  # it may have finished between the two looks
            if done is None:
                if obj.status == "cancelling" or rec.get("expiring"):
                    done = {"status": "cancelled"}
                elif rec["attempts"] < self.settings.max_attempts:
                    log.warning("batch %s: its run is gone without finishing; starting another, which resumes "
                                "after the last committed part", obj.id)
                    self._launch(rec)
                    self._save(rec, obj)
                    return
                else:
                    done = {"status": "failed", "error": f"the batch's run stopped {rec['attempts']} times "
                                                         "without finishing"}
        if done is None and obj.status == "finalizing":
            done = rec.get("done") or {"status": "failed", "error": "finalizing was interrupted"}
        if done is None:
            parts = list_parts(rec["work_url"], opts)
            counts = RequestCounts(total=obj.request_counts.total, completed=sum(p.ok for p in parts),
                                   failed=sum(p.failed for p in parts))
            if counts != obj.request_counts:
                self._save(rec, obj.model_copy(update={"request_counts": counts}))
            return
        self._finalize(rec, obj, done)

    def _finalize(self, rec: dict[str, Any], obj: BatchObject, done: dict[str, Any]) -> None:
        """Output and error files from the committed parts: successes in one, failures (with their
        line, field and reason) in the other, each in input order. Only when the parts hold every
        input row exactly once (every row up to where it stopped, for a cancelled run): else the
        batch fails, saying which rows, and no output file is written. An expired batch's error
        file also holds a ``batch_expired`` line for each row its run never reached."""
        now = int(self.clock())
        rec["done"] = {"status": done.get("status"), "error": done.get("error")}
        obj = self._save(rec, obj.model_copy(update={"status": "finalizing", "finalizing_at": obj.finalizing_at or now}))
        opts = self.store.storage_options
        parts = list_parts(rec["work_url"], opts)
        status = done.get("status")
        expired = status == "cancelled" and bool(rec.get("expiring"))
        usage = BatchUsage()
        never_run = 0

        def lines(ok: bool) -> Iterator[bytes]:
            nonlocal never_run
            for part in parts:
                part_lines = read_part_lines(rec["work_url"], part, opts)
                if ok and part.name.startswith("part-") and (
                        len(part_lines) != part.hi - part.lo
                        or sum(1 for x in part_lines if json.loads(x).get("error") is None) != part.ok):
                    raise Uncovered(f"part {part.name} holds {len(part_lines)} lines, not the "
                                    f"{part.hi - part.lo} its name says")
                for line in part_lines:
                    row = json.loads(line)
                    if (row.get("error") is None) != ok:
                        continue
                    if ok:  # the batch's usage: every answered row's, whichever endpoint's shape it has
                        tokens_in, cached, tokens_out = usage_counts(row["response"]["body"])
                        usage.input_tokens += tokens_in
                        usage.input_tokens_details.cached_tokens += cached
                        usage.output_tokens += tokens_out
                    yield line
            if not ok and expired:
                for line in self._never_run(rec, obj, parts, total):
                    never_run += 1
                    yield line

        total = obj.request_counts.total or rec.get("lines") or 0
        uncovered = coverage_error(parts, total, status)
        out = err = None
        for name in (f"{obj.id}_output.jsonl", f"{obj.id}_error.jsonl"):  # an interrupted finalize's files
            for left in self.files.list(rec["owner"], purpose="batch_output"):
                if left.filename == name:
                    self.files.delete(rec["owner"], left.id)
        expires_after_s = rec.get("output_expires_after_s")
        if uncovered is None:
            try:
                out = self.files.write_output(rec["owner"], f"{obj.id}_output.jsonl", lines(True),
                                              expires_after_s=expires_after_s)
                err = self.files.write_output(rec["owner"], f"{obj.id}_error.jsonl", lines(False),
                                              expires_after_s=expires_after_s)
            except Uncovered as exc:
                uncovered = str(exc)
                if out is not None:
                    self.files.delete(rec["owner"], out.id)
                out = None
        counts = RequestCounts(total=total, completed=sum(p.ok for p in parts),
                               failed=sum(p.failed for p in parts) + never_run)
        update: dict[str, Any] = {"request_counts": counts}
        if uncovered is None:
            usage.total_tokens = usage.input_tokens + usage.output_tokens
            update.update({"output_file_id": out.id if out else None, "error_file_id": err.id if err else None,
                           "usage": usage})
        if uncovered is not None:
            log.error("batch %s: its committed parts do not cover its input: %s", obj.id, uncovered)
            update.update(status="failed", failed_at=now, errors=_failed(
                "incomplete_output", f"the batch's output does not hold every input row exactly once: {uncovered}"))
        elif status == "completed":
            update.update(status="completed", completed_at=now)
        elif expired:
            update.update(status="expired", expired_at=now)
        elif status == "cancelled":
            update.update(status="cancelled", cancelled_at=now)
        else:
            update.update(status="failed", failed_at=now,
                          errors=_failed("batch_failed", done.get("error") or "the batch's run failed"))
        self._save(rec, obj.model_copy(update=update))
        log.info("batch %s: %s", obj.id, update["status"])

    def _never_run(self, rec: dict[str, Any], obj: BatchObject, parts: list[Part], total: int) -> Iterator[bytes]:
        """OpenAI's error line for each input row an expired batch's run never reached: the rows
        after its in-order parts that its tail (rows finished out of order) does not hold."""
        at = max((p.hi for p in parts if p.name.startswith("part-")), default=0)
        tail = [json.loads(x) for p in parts if p.name.startswith("tail-")
                for x in read_part_lines(rec["work_url"], p, self.store.storage_options)]
        k = 0

        def rows() -> Iterator[tuple[int, bytes | None]]:  # streamed: an input may be 200 MB
            seen = 0
            try:
                with self.store.open_blob("files", f"{obj.input_file_id}.jsonl") as f:
                    for raw in f:
                        if seen >= total:
                            return
                        if seen >= at:
                            yield seen, raw
                        seen += 1
            except FileNotFoundError:  # the input was deleted: its rows are known by their lines only
                pass
            for rest in range(max(seen, at), total):
                yield rest, None

        for row, raw in rows():
            cid = _custom_id(raw)
            if k < len(tail) and _ran(tail[k], row, cid):
                k += 1
                continue
            h = hashlib.sha256(f"{obj.id}:{row}".encode()).hexdigest()[:24]
            yield (json.dumps({"id": f"batch_req_{h}", "custom_id": cid, "response": None,
                               "error": {"code": "batch_expired", "message": EXPIRED_MESSAGE, "line": row + 1}})
                   + "\n").encode()


class Driver:
    """The server's background thread: every ``poll_s`` it advances each batch that has not ended."""

    def __init__(self, batches: BatchService, poll_s: float) -> None:
        self.batches = batches
        self.poll_s = poll_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kvbatch-batches", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.batches.advance_all()
            self._stop.wait(self.poll_s)
