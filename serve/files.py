"""Uploaded and produced files: content on the object store, a record beside it, per owner.

An upload is streamed to the store while it is counted, so the limits (bytes and, for
``purpose=batch``, request lines) are checked without holding the file in memory; an upload
over a limit is a 400 that says which limit, and leaves nothing behind.

A file with an ``expires_at`` (a batch's output and error files, under the batch's
``output_expires_after``) is gone from that second on: 404 on every route, out of the listings,
whether or not :meth:`FileService.sweep_expired` has deleted its bytes yet.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from typing import Any, BinaryIO

from kvbatch.serve.errors import ApiError, not_found
from kvbatch.serve.objects import FileObject
from kvbatch.serve.settings import MB, ServeSettings
from kvbatch.serve.state import StateStore

PURPOSES = ("batch", "batch_output")
UPLOAD_PURPOSES = ("batch",)
COPY_BYTES = 1 << 20
PROBE_LINE_BYTES = 1 << 20  # a line longer than this is not judged at upload; the batch's validation does


class JsonlProbe:
    """Whether an upload is JSONL, judged while it streams: it is when some line is a JSON
    object (a malformed line among objects is only that row's error, reported in the batch's error
    file). A CSV, a JSON array or a document is refused at upload with the first line's reason,
    instead of being ``processed`` and failing later as a batch. Stops looking at the first object."""

    def __init__(self) -> None:
        self.ok = False
        self._pending = b""
        self._line_no = 0
        self._first_reason: str | None = None

    def feed(self, chunk: bytes) -> None:
        if self.ok:
            return
        *lines, self._pending = (self._pending + chunk).split(b"\n")
        for line in lines:
            self._judge(line)
            if self.ok:
                self._pending = b""
                return
        if len(self._pending) > PROBE_LINE_BYTES:  # too long to hold: not judged here
            self.ok, self._pending = True, b""

    def _judge(self, line: bytes) -> None:
        self._line_no += 1
        if not line.strip():
            return
        try:
            value = json.loads(line)
        except ValueError as exc:
            reason = f"malformed JSON ({exc.msg if isinstance(exc, json.JSONDecodeError) else 'not UTF-8'})"
        else:
            if isinstance(value, dict):
                self.ok = True
                return
            reason = f"a JSON {type(value).__name__.replace('dict', 'object').replace('list', 'array')}, not an object"
        if self._first_reason is None:
            self._first_reason = f"line {self._line_no} is {reason}"

    def refusal(self) -> str | None:
        """None when the upload is JSONL, else why not."""
        if not self.ok and self._pending:
            self._judge(self._pending)
            self._pending = b""
        if self.ok:
            return None
        return ("file is not JSONL (one JSON object per line, each a request): no line is a JSON object; "
                + (self._first_reason or "every line is blank"))


class FileService:
    def __init__(self, store: StateStore, settings: ServeSettings, clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self.settings = settings
        self.clock = clock  # seconds since the epoch; tests pass their own, to expire files without waiting
        self._lock = threading.Lock()
        self._files: dict[str, dict[str, Any]] = {r["object"]["id"]: r for r in store.records("files")}

    # -- records

    def _expired(self, rec: dict[str, Any]) -> bool:
        expires_at = rec["object"].get("expires_at")
        return expires_at is not None and self.clock() >= expires_at

    def _record(self, owner: str, file_id: str) -> dict[str, Any]:
        with self._lock:
            rec = self._files.get(file_id)
        if rec is None or rec["owner"] != owner or self._expired(rec):
            raise not_found("file", file_id)
        return rec

    def get(self, owner: str, file_id: str) -> FileObject:
        return FileObject(**self._record(owner, file_id)["object"])

    def lines(self, owner: str, file_id: str) -> int:
        return self._record(owner, file_id)["lines"]

    def content_url(self, owner: str, file_id: str) -> str:
        self._record(owner, file_id)
        return self.store.join("files", f"{file_id}.jsonl")

    def list(self, owner: str, purpose: str | None = None) -> list[FileObject]:
        with self._lock:
            recs = [r for r in self._files.values() if r["owner"] == owner and not self._expired(r)]
        recs.sort(key=lambda r: (r["object"]["created_at"], r.get("created_ns", 0)), reverse=True)  # newest first
        return [FileObject(**r["object"]) for r in recs if not purpose or r["object"]["purpose"] == purpose]

    def delete(self, owner: str, file_id: str) -> dict[str, Any]:
        self._record(owner, file_id)
        self._remove(file_id)
        return {"id": file_id, "object": "file", "deleted": True}

    def _remove(self, file_id: str) -> None:
        with self._lock:
            self._files.pop(file_id, None)
        self.store.delete("files", f"{file_id}.json")  # the record first: no record, no file
        self.store.delete("files", f"{file_id}.jsonl")

    def sweep_expired(self) -> list[str]:
        """Delete every file past its ``expires_at`` (already unreachable: this frees the store);
        returns their ids."""
        with self._lock:
            gone = [i for i, r in self._files.items() if self._expired(r)]
        for file_id in gone:
            self._remove(file_id)
        return gone

    def read(self, owner: str, file_id: str) -> Iterator[bytes]:
        self._record(owner, file_id)
        with self.store.open_blob("files", f"{file_id}.jsonl") as f:
            while chunk := f.read(COPY_BYTES):
                yield chunk

    # -- writes

    def too_large(self, declared: int | None = None) -> ApiError:
        limit = self.settings.max_file_bytes
        what = f"an upload of {declared} bytes" if declared is not None else "file"
        return ApiError(400, f"{what} is larger than the limit of {limit // MB} MB ({limit} bytes)", param="file",
                        code="file_too_large")

    def upload(self, owner: str, filename: str, purpose: str, source: BinaryIO) -> FileObject:
        """Copy ``source`` onto the store, refusing it whole if it is over a limit."""
        if purpose not in UPLOAD_PURPOSES:
            raise ApiError(400, f"purpose must be 'batch' (the only purpose this server takes), got {purpose[:40]!r}",
                           param="purpose", code="invalid_purpose")
        limit = self.settings.max_file_bytes
        file_id = "file-" + uuid.uuid4().hex[:24]
        sink = self.store.sink("files", f"{file_id}.jsonl")
        size = newlines = 0
        last = b"\n"
        probe = JsonlProbe()
        try:
            while chunk := source.read(COPY_BYTES):
                size += len(chunk)
                if size > limit:
                    raise self.too_large()
                sink.write(chunk)
                probe.feed(chunk)
                newlines += chunk.count(b"\n")
                last = chunk[-1:]
            lines = newlines + (last != b"\n")  # a last line without its newline is a request too
            if size == 0:
                raise ApiError(400, "file is empty", param="file", code="empty_file")
            refusal = probe.refusal()
            if refusal is not None:
                raise ApiError(400, refusal, param="file", code="invalid_file_format")
            if lines > self.settings.max_requests:
                raise ApiError(400, f"file has {lines} requests; the limit is {self.settings.max_requests} "
                                    f"per batch", param="file", code="too_many_requests")
            sink.commit()
        except BaseException:
            sink.abort()
            raise
        return self.add(owner, file_id, filename, purpose, size, lines)

    def add(self, owner: str, file_id: str, filename: str, purpose: str, size: int, lines: int,
            expires_after_s: int | None = None) -> FileObject:
        """Record a file whose content is already committed at ``files/<id>.jsonl``; one given
        ``expires_after_s`` expires that many seconds after its ``created_at``."""
        now = int(self.clock())
        obj = FileObject(id=file_id, bytes=size, created_at=now, filename=filename[:255], purpose=purpose,
                         expires_at=None if expires_after_s is None else now + expires_after_s)
        rec = {"object": obj.model_dump(), "owner": owner, "lines": lines, "created_ns": time.time_ns()}
        self.store.put_record("files", file_id, rec)
        with self._lock:
            self._files[file_id] = rec
        return obj

    def write_output(self, owner: str, filename: str, lines: Iterable[bytes],
                     expires_after_s: int | None = None) -> FileObject | None:
        """A batch's output or error file from its lines; None when there are none (OpenAI then
        leaves ``output_file_id`` / ``error_file_id`` null)."""
        file_id = "file-" + uuid.uuid4().hex[:24]
        sink = self.store.sink("files", f"{file_id}.jsonl")
        size = n = 0
        try:
            for line in lines:
                sink.write(line)
                size += len(line)
                n += 1
            if n == 0:
                sink.abort()
                return None
            sink.commit()
        except BaseException:
            sink.abort()
            raise
        return self.add(owner, file_id, filename, "batch_output", size, n, expires_after_s)
