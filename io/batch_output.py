"""Write batch results as OpenAI-Batch-format JSONL, in input order, all or nothing.

Why this module exists: the output of a batch is one line per input line, in the same order,
in the shape OpenAI's Batch API returns, so a user can run one dataset on OpenAI or on us and
diff the files. Requests finish out of order (short answers first), so
:class:`OrderedJsonlWriter` holds back only the out-of-order tail and writes each line as soon
as every line before it is written (vLLM's ``run-batch`` does the same). Both writers write
to a name nobody reads and commit on a clean close, so a crash never leaves a truncated file
that looks complete: a re-run replaces the output whole.

How "commit" works depends on where the file goes:

- local paths: a sibling ``.<name>.tmp-<host>-<pid>-<random>`` file, then ``os.replace``
  (atomic on POSIX). A writer killed before its commit (SIGKILL, out of memory) leaves its
  temp file behind; the next writer of the same name removes the ones whose process is gone
  (same host, pid no longer running) and never one of a live writer or of another host;
- object stores whose fsspec files support ``autocommit=False`` (s3, gcs, azure): a multipart
  upload completed on commit and aborted on failure, so the object appears whole or not at all;
- any other fsspec filesystem (``memory://``...): a sibling ``.tmp-`` name, then ``fs.mv``.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import IO, Any

from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem

from kvbatch.engine.text.tool_calls import ParsedCall, ToolsSpec, is_tools_spec, parse_tool_calls
from kvbatch.io.batch_requests import CHAT_COMPLETIONS_URL, COMPLETIONS_URL, RESPONSES_URL, RejectedRow
from kvbatch.io.tools import responses_echo
from kvbatch.io.urls import redact_text

__all__ = [
    "FINISH_REASONS",
    "AtomicSink",
    "JsonlWriter",
    "OrderedJsonlWriter",
    "OutputError",
    "TokenLogprob",
    "encode_line",
    "error_line",
    "remove_stale_temps",
    "result_line",
    "usage_counts",
]

FINISH_REASONS = frozenset({"stop", "length"})
# OpenAI and vLLM report -inf logprobs as -9999.0: JSON has no infinity.
MIN_LOGPROB = -9999.0
# fsspec protocols whose files honour autocommit=False with an atomic commit.
_TRANSACTIONAL_PROTOCOLS = frozenset({"s3", "s3a", "gs", "gcs", "abfs", "abfss", "az"})


# --------------------------------------------------------------------------------------------
# Line builders


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's logprob and its top alternatives, as the engine reports them.

    ``token_bytes`` is for byte-level tokens that are not valid UTF-8 on their own; when
    absent the token's UTF-8 encoding is reported.
    """

    token: str
    logprob: float
    top_logprobs: tuple[tuple[str, float], ...] = ()
    token_bytes: bytes | None = None


def _stable_hex(*parts: object) -> str:
    """A deterministic id: a re-run of the same input yields the same ids, so outputs diff clean."""
    h = hashlib.sha256("\x1f".join(str(p) for p in parts).encode("utf-8", "surrogatepass"))
    return h.hexdigest()[:32]


def _clamp(lp: float) -> float:
    return MIN_LOGPROB if math.isnan(lp) or lp < MIN_LOGPROB else float(lp)


def _logprobs_json(logprobs: Sequence[TokenLogprob]) -> dict[str, Any]:
    return {
        "content": [
            {
                "token": t.token,
                "logprob": _clamp(t.logprob),
                "bytes": list(t.token_bytes if t.token_bytes is not None else t.token.encode()),
                "top_logprobs": [
                    {"token": tok, "logprob": _clamp(lp), "bytes": list(tok.encode())}
                    for tok, lp in t.top_logprobs
                ],
            }
            for t in logprobs
        ]
    }


def result_line(
    custom_id: str,
    request_index: int,
    *,
    text: str,
    finish_reason: str,
    prompt_tokens: int,
    completion_tokens: int,
    model: str,
    token_ids: list[int] | None = None,
    logprobs: Sequence[TokenLogprob] | None = None,
    created: int | None = None,
    draft_tokens: tuple[int, int] | None = None,
    endpoint: str = CHAT_COMPLETIONS_URL,
    cached_tokens: int | None = None,
    response_format: str | None = None,
    choice: int = 0,
) -> dict[str, Any]:
    """One successful request as an OpenAI Batch output line, its ``response.body`` in the shape of
    the ``endpoint`` the row was written for: a chat completion, a Responses object
    (:func:`_response_body`) or a text completion (:func:`_completion_body`).

    ``request_index`` should be the request's input line number (``ChatRequest.line_no``):
    it and ``custom_id`` seed the ids, so a request keeps its ids whether it succeeds or is
    rejected (see :func:`error_line`). ``token_ids`` goes into the choice as ``token_ids``,
    as vLLM's ``return_token_ids`` does. ``created`` defaults to now (Unix seconds).
    ``draft_tokens``: (accepted, rejected) drafted tokens under speculative decoding, reported
    where OpenAI reports predicted-output tokens (``usage.completion_tokens_details``; a Responses
    object has no such field). ``cached_tokens``: prompt tokens not computed for this request (the
    prefix cache or the KV store served them), OpenAI's ``usage.prompt_tokens_details.cached_tokens``
    (``input_tokens_details`` in a Responses object, where it is always present: 0 when not given).
    ``response_format``: the engine's (the job's ``sampling.response_format``); a tools spec makes
    the answer's calls ``message.tool_calls`` (:func:`_tool_message`). ``choice``: which of a row's
    ``n`` choices this answer is (its tool-call ids are its own: :func:`_call_json`).
    """
    if finish_reason not in FINISH_REASONS:
        raise ValueError(f"finish_reason must be one of {sorted(FINISH_REASONS)}, got {finish_reason!r}")
    if prompt_tokens < 0 or completion_tokens < 0:
        raise ValueError(f"token counts must be >= 0, got {prompt_tokens}, {completion_tokens}")
    h = _stable_hex(request_index, custom_id)
    created = int(time.time()) if created is None else created
    if endpoint == RESPONSES_URL:
        body = _response_body(h, text, finish_reason, prompt_tokens, completion_tokens, model, created,
                              cached_tokens, response_format)
    elif endpoint in (CHAT_COMPLETIONS_URL, COMPLETIONS_URL):
        usage = _usage(prompt_tokens, completion_tokens, draft_tokens, cached_tokens)
        body = (_chat_body(h, text, finish_reason, model, created, token_ids, logprobs, usage, response_format,
                           choice)
                if endpoint == CHAT_COMPLETIONS_URL else
                _completion_body(h, text, finish_reason, model, created, token_ids, logprobs, usage))
    else:
        raise ValueError(f"endpoint must be one of {CHAT_COMPLETIONS_URL}, {RESPONSES_URL}, {COMPLETIONS_URL}, "
                         f"got {endpoint!r}")
    return {
        "id": f"batch_req_{h}",
        "custom_id": custom_id,
        "response": {"status_code": 200, "request_id": f"req_{h}", "body": body},
        "error": None,
    }


def _tool_message(h: str, text: str, finish_reason: str, response_format: str | None,
                  choice: int = 0) -> tuple[dict[str, Any], str] | None:
    """(the message, ``tool_calls``) of an answer that called tools, or None: ``content`` is the
    text before the calls (null when none), each call's ``id`` is ``call_`` and a hash of the row
    and the call's position (a re-run gives the same ids), ``arguments`` a JSON string. An answer
    cut by ``max_tokens`` mid-call, or plain text under ``tool_choice: auto``, stays text."""
    if finish_reason != "stop" or not is_tools_spec(response_format):
        return None
    spec = ToolsSpec.parse(response_format)  # type: ignore[arg-type]
    if spec.choice == "none":
        return None
    parsed = parse_tool_calls(text, spec.format, spec.control_token)
    if parsed is None:
        return None
    content, calls = parsed
    return {"role": "assistant", "content": content,
            "tool_calls": [_call_json(h, i, c, choice) for i, c in enumerate(calls)]}, "tool_calls"


def _call_json(h: str, index: int, call: ParsedCall, choice: int = 0) -> dict[str, Any]:
    # The choice is hashed in too: a row's n choices often make the same calls, and a client that
    # answers them keys its tool messages by id. Choice 0 keeps the ids a row of one choice has.
    parts = (h, "call", index) if choice == 0 else (h, "call", index, "choice", choice)
    return {"id": f"call_{_stable_hex(*parts)[:24]}", "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


def _chat_body(h: str, text: str, finish_reason: str, model: str, created: int, token_ids: list[int] | None,
               logprobs: Sequence[TokenLogprob] | None, usage: dict[str, Any],
               response_format: str | None = None, choice: int = 0) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": text}
    called = _tool_message(h, text, finish_reason, response_format, choice)
    if called is not None:
        message, finish_reason = called
    choice: dict[str, Any] = {
        "index": 0,
        "message": message,
        "finish_reason": finish_reason,
        "logprobs": None if logprobs is None else _logprobs_json(logprobs),
    }
    if token_ids is not None:
        choice["token_ids"] = list(token_ids)
    return {"id": f"chatcmpl-{h}", "object": "chat.completion", "created": created, "model": model,
            "choices": [choice], "usage": usage}


def _completion_body(h: str, text: str, finish_reason: str, model: str, created: int, token_ids: list[int] | None,
                     logprobs: Sequence[TokenLogprob] | None, usage: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's text completion (``/v1/completions``): ``choices[0].text``, and the legacy logprobs
    shape: parallel lists of the tokens, their logprobs, their alternatives (token -> logprob, the
    ``logprobs`` most likely) and each token's character offset in the text."""
    choice: dict[str, Any] = {
        "text": text,
        "index": 0,
        "logprobs": None if logprobs is None else _completion_logprobs(logprobs),
        "finish_reason": finish_reason,
    }
    if token_ids is not None:
        choice["token_ids"] = list(token_ids)
    return {"id": f"cmpl-{h}", "object": "text_completion", "created": created, "model": model,
            "choices": [choice], "usage": usage}


def _completion_logprobs(logprobs: Sequence[TokenLogprob]) -> dict[str, Any]:
    offsets, at = [], 0
    for t in logprobs:
        offsets.append(at)
        at += len(t.token)
    return {
        "tokens": [t.token for t in logprobs],
        "token_logprobs": [_clamp(t.logprob) for t in logprobs],
        "top_logprobs": [{tok: _clamp(lp) for tok, lp in t.top_logprobs} for t in logprobs],
        "text_offset": offsets,
    }


def _response_body(h: str, text: str, finish_reason: str, input_tokens: int, output_tokens: int, model: str,
                   created: int, cached_tokens: int | None, response_format: str | None = None) -> dict[str, Any]:
    """OpenAI's Responses object (``/v1/responses``): one assistant message of one ``output_text``.
    A row cut by ``max_output_tokens`` is ``incomplete``, as OpenAI marks it. A row with tools echoes
    them (``tools``, ``tool_choice``, ``parallel_tool_calls``) and its calls are ``function_call``
    items after the message (no message when there is no text before the calls)."""
    done = finish_reason == "stop"
    status = "completed" if done else "incomplete"
    tools = is_tools_spec(response_format)
    output: list[dict[str, Any]] = [{"type": "message", "id": f"msg_{h}", "status": status, "role": "assistant",
                                     "content": [{"type": "output_text", "text": text, "annotations": []}]}]
    called = _tool_message(h, text, finish_reason, response_format)
    if called is not None:
        message = called[0]
        output = [{**output[0], "content": [{"type": "output_text", "text": message["content"], "annotations": []}]}
                  ] if message["content"] is not None else []
        output += [{"type": "function_call", "id": f"fc_{c['id'].removeprefix('call_')}", "call_id": c["id"],
                    "name": c["function"]["name"], "arguments": c["function"]["arguments"], "status": "completed"}
                   for c in message["tool_calls"]]
    return {
        "id": f"resp_{h}",
        "object": "response",
        "created_at": created,
        "status": status,
        "error": None,
        "incomplete_details": None if done else {"reason": "max_output_tokens"},
        "model": model,
        "output": output,
        **responses_echo(response_format if tools else None),
        "usage": {
            "input_tokens": input_tokens,
            # cache_write_tokens: prompt tokens billed for writing a prompt cache; kvbatch bills none.
            "input_tokens_details": {"cached_tokens": min(cached_tokens or 0, input_tokens), "cache_write_tokens": 0},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input_tokens + output_tokens,
        },
    }


def _usage(prompt_tokens: int, completion_tokens: int, draft_tokens: tuple[int, int] | None,
           cached_tokens: int | None = None) -> dict[str, Any]:
    usage: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": min(cached_tokens, prompt_tokens)}
    if draft_tokens is not None:
        usage["completion_tokens_details"] = {"accepted_prediction_tokens": draft_tokens[0],
                                              "rejected_prediction_tokens": draft_tokens[1]}
    return usage


def usage_counts(body: Mapping[str, Any]) -> tuple[int, int, int]:
    """(input, cached input, output) tokens of a success line's ``response.body``, whichever
    endpoint's shape it has (a Responses object counts ``input_tokens``/``output_tokens``)."""
    usage = body["usage"]
    if "input_tokens" in usage:
        return (usage["input_tokens"], usage.get("input_tokens_details", {}).get("cached_tokens", 0),
                usage["output_tokens"])
    return (usage["prompt_tokens"], usage.get("prompt_tokens_details", {}).get("cached_tokens", 0),
            usage["completion_tokens"])


def error_line(rejected: RejectedRow) -> dict[str, Any]:
    """One rejected row as an output line.

    Carries the error twice on purpose: as an HTTP 400 ``response`` (what vLLM's run-batch
    writes and what OpenAI-batch tooling checks via ``response.status_code``) and as a
    top-level ``error`` with the line and field, for people and for the errors file.
    ``custom_id`` is null when the row had no usable one.
    """
    h = _stable_hex(rejected.line_no, rejected.custom_id)
    message = f"line {rejected.line_no}: {rejected.field}: {rejected.reason}"
    return {
        "id": f"batch_req_{h}",
        "custom_id": rejected.custom_id,
        "response": {
            "status_code": 400,
            "request_id": f"req_{h}",
            "body": {
                "error": {
                    "message": message,
                    "type": "invalid_request_error",
                    "param": rejected.field,
                    "code": "invalid_request",
                }
            },
        },
        "error": {
            "code": "invalid_request",
            "message": message,
            "line": rejected.line_no,
            "field": rejected.field,
        },
    }


# --------------------------------------------------------------------------------------------
# Writers


def encode_line(obj: Mapping[str, Any]) -> bytes:
    """One JSONL line, as every writer here encodes it. ``allow_nan=False``: NaN is not JSON, and
    a file other tools can't parse is worse than failing here, where the bad value is known."""
    return (json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False) + "\n").encode()


_encode = encode_line


class OutputError(OSError):
    """An output cannot be written (a directory, a read-only filesystem, no permission, disk
    full); the message names the output's URL and the reason."""


def _host() -> str:
    # The temp name must parse back: keep the host to characters that cannot be the separator.
    return re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname()) or "host"


def _temp_name(path: str) -> str:
    """A sibling name that dataset readers skip: a process killed before its commit (SIGKILL,
    out of memory) leaves this file behind, and pyarrow, Spark and DuckDB folder scans ignore
    names starting with ``.``, so it can never be read as part of a table. The host and pid
    in it let a later writer tell a dead writer's leftover from a live writer's file."""
    head, tail = os.path.split(path)
    name = f".{tail}.tmp-{_host()}-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    return os.path.join(head, name) if head else name


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def remove_stale_temps(path: str) -> list[str]:
    """Delete the temp files of earlier writers of the local ``path`` that died before their
    commit; returns what was deleted. Only names this module makes for ``path`` are looked
    at, and one is stale only if it was made on this host by a pid that no longer runs (a pid
    reused since then keeps a leftover a while longer: the safe direction). Files from other
    hosts on a shared filesystem, and the old ``.tmp-<random>`` names without a pid, are left
    alone: nothing here can tell whether their writer still runs."""
    head, tail = os.path.split(path)
    pattern = re.compile(rf"\.{re.escape(tail)}\.tmp-(?P<host>[A-Za-z0-9_.]+)-(?P<pid>\d+)-[0-9a-f]{{12}}")
    host = _host()
    removed: list[str] = []
    try:
        names = os.listdir(head or ".")
    except OSError:
        return removed
    for name in names:
        m = pattern.fullmatch(name)
        if m is None or m["host"] != host:
            continue
        pid = int(m["pid"])
        if pid == os.getpid() or _pid_alive(pid):
            continue
        stale = os.path.join(head, name)
        try:
            os.remove(stale)
        except FileNotFoundError:  # another cleaner got there first
            continue
        except OSError:  # not ours to remove: leave it, the write itself will say what is wrong
            continue
        removed.append(stale)
    return removed


def _output_error(url: str, exc: BaseException) -> OutputError:
    reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc) or type(exc).__name__
    return OutputError(redact_text(f"cannot write {url}: {reason}"))


SPOOL_DIR_ENV = "KVBATCH_SPOOL_DIR"


def spool_dir() -> str | None:
    """Where local spool files of object-store outputs go: ``$KVBATCH_SPOOL_DIR``, else the
    system's temp folder (None)."""
    return os.environ.get(SPOOL_DIR_ENV) or None


class AtomicSink:
    """A binary file that becomes visible at its final name only on :meth:`commit`.

    Opening one is the writability check: for a local path it refuses a directory and creates
    the temp file at once, so a read-only filesystem or a missing permission fails here, before
    any work, with :class:`OutputError` naming the URL (and so do failed writes and commits).
    """

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None, *, spool: bool = False) -> None:
        # spool: an object-store output is written to a local temp file and uploaded whole at
        # commit, instead of through the filesystem's write buffer (s3fs keeps up to a
        # multipart block, 5-50 MB, in memory per open file): what a step holding a thousand
        # outputs open at once (the shard writer) needs to stay bounded in memory.
        self._spool_path: str | None = None
        try:
            self._open(url, storage_options, spool)
        except OutputError:
            raise
        except Exception as exc:  # noqa: BLE001 - any opener's failure is one message naming the output
            raise _output_error(url, exc) from exc

    def _open(self, url: str, storage_options: Mapping[str, Any] | None, spool: bool) -> None:
        fs, path = url_to_fs(url, **dict(storage_options or {}))
        self.url = url
        self._fs = fs
        self._path = path
        self._tmp: str | None = None
        self._transactional = False
        protocols = {fs.protocol} if isinstance(fs.protocol, str) else set(fs.protocol)
        if isinstance(fs, LocalFileSystem):
            if os.path.isdir(path):
                # Caught now: os.replace onto a directory would fail only after all the work.
                raise OutputError(redact_text(f"cannot write {url}: is a directory"))
            parent = os.path.dirname(path)
            if parent:
                try:
                    os.makedirs(parent, exist_ok=True)
                except (FileExistsError, NotADirectoryError):  # errno's "File exists" misleads here
                    raise OutputError(redact_text(f"cannot write {url}: a parent of it is not a directory")) from None
            remove_stale_temps(path)
            self._tmp = _temp_name(path)
            self._file: IO[bytes] = open(self._tmp, "wb")  # noqa: SIM115 - closed in commit/abort
        elif spool:
            handle, self._spool_path = tempfile.mkstemp(prefix="kvbatch-spool-", suffix=".part", dir=spool_dir())
            self._file = os.fdopen(handle, "wb")
            self._transactional = bool(protocols & _TRANSACTIONAL_PROTOCOLS)
            if not self._transactional:
                self._tmp = _temp_name(path)
        elif protocols & _TRANSACTIONAL_PROTOCOLS:
            self._transactional = True
            self._file = fs.open(path, "wb", autocommit=False)
        else:
            self._tmp = _temp_name(path)
            self._file = fs.open(self._tmp, "wb")

    def write(self, data: bytes) -> None:
        try:
            self._file.write(data)
        except OSError as exc:  # disk full, quota: say which output
            raise _output_error(self.url, exc) from exc

    def commit(self) -> None:
        try:
            self._commit()
        except OutputError:
            raise
        except OSError as exc:
            raise _output_error(self.url, exc) from exc

    def _commit(self) -> None:
        if isinstance(self._fs, LocalFileSystem):
            # Data on disk before the rename, or a power cut can leave an empty "complete" file.
            self._file.flush()
            os.fsync(self._file.fileno())
        self._file.close()
        if self._spool_path is not None:
            # One upload of the finished file: on S3 an object appears only when its (multipart)
            # upload completes, so a reader sees the old object or the new one, never a part.
            try:
                self._fs.put_file(self._spool_path, self._path if self._transactional else self._tmp)
                if not self._transactional:
                    self._fs.mv(self._tmp, self._path)
            finally:
                os.remove(self._spool_path)
        elif self._transactional:
            self._file.commit()  # type: ignore[attr-defined]
        elif isinstance(self._fs, LocalFileSystem):
            assert self._tmp is not None
            os.replace(self._tmp, self._path)
        else:
            assert self._tmp is not None
            self._fs.mv(self._tmp, self._path)

    def abort(self) -> None:
        """Drop everything written. Best effort: called while another error is in flight."""
        try:
            self._file.close()
        except Exception:  # noqa: BLE001 - the original error matters more
            pass
        try:
            if self._spool_path is not None:
                os.remove(self._spool_path)  # nothing was uploaded yet
            elif self._transactional:
                self._file.discard()  # type: ignore[attr-defined]
            elif isinstance(self._fs, LocalFileSystem):
                assert self._tmp is not None
                os.remove(self._tmp)
            else:
                self._fs.rm(self._tmp)
        except Exception:  # noqa: BLE001
            pass


class ParquetSinkFile:
    """The file-like face pyarrow's ParquetWriter needs (write, tell, flush, close) over an
    :class:`AtomicSink`, counting the bytes written. Closing it does not commit: the writer closes
    its stream when it finishes, and the sink is committed (or aborted) separately."""

    def __init__(self, sink: AtomicSink) -> None:
        self._sink = sink
        self.bytes_written = 0
        self.closed = False

    def write(self, data: Any) -> int:
        data = bytes(data)
        self._sink.write(data)
        self.bytes_written += len(data)
        return len(data)

    def tell(self) -> int:
        return self.bytes_written

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True

class JsonlWriter:
    """Writes dicts as JSONL lines in the order given; the file appears only on a clean close.

    Use as a context manager: an exception inside the ``with`` block discards the file. Used
    directly for the CLI's ``--errors`` file and, wrapped, by :class:`OrderedJsonlWriter`.
    """

    def __init__(self, url: str, *, storage_options: Mapping[str, Any] | None = None) -> None:
        self.url = url
        self._sink = AtomicSink(url, storage_options)
        self._done = False
        self.lines_written = 0
        self.bytes_written = 0

    @property
    def closed(self) -> bool:
        """True once committed or aborted."""
        return self._done

    def write(self, obj: Mapping[str, Any]) -> None:
        """Append one line. Raises ValueError for objects that are not valid JSON (NaN...)."""
        self.write_encoded(_encode(obj))

    def write_encoded(self, line: bytes) -> None:
        """Append one already-encoded line (it must end with a newline)."""
        if self._done:
            raise ValueError(f"{self.url}: writer is closed")
        self._sink.write(line)
        self.lines_written += 1
        self.bytes_written += len(line)

    def close(self) -> None:
        """Commit: make the file visible at its final name. Idempotent."""
        if self._done:
            return
        self._done = True
        try:
            self._sink.commit()
        except BaseException:
            self._sink.abort()
            raise

    def abort(self) -> None:
        """Discard everything written; the final name is left as it was. Idempotent."""
        if self._done:
            return
        self._done = True
        self._sink.abort()

    def __enter__(self) -> JsonlWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


class OrderedJsonlWriter:
    """Accepts ``put(index, obj)`` in any order and writes lines strictly by index.

    Indexes are contiguous integers from ``start`` (use the position in the request stream,
    not the line number: blank lines leave gaps in line numbers). A line is written as soon
    as all lower indexes are, so the buffer holds only the out-of-order tail; bounding that
    tail is the caller's job (limit requests in flight). ``max_pending`` turns a runaway tail
    into an error instead of an out-of-memory kill. ``close()`` raises, and discards the
    file, if any index is missing (or fewer than ``total`` lines were put, when given).
    ``put`` is thread-safe.
    """

    def __init__(
        self,
        url: str,
        *,
        start: int = 0,
        total: int | None = None,
        max_pending: int | None = None,
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        self._out = JsonlWriter(url, storage_options=storage_options)
        self.url = url
        self._start = start
        self._next = start
        self._total = total
        self._max_pending = max_pending
        self._pending: dict[int, bytes] = {}
        self._lock = threading.Lock()

    @property
    def next_index(self) -> int:
        """The lowest index not yet written."""
        return self._next

    @property
    def pending_count(self) -> int:
        """Lines held back, waiting for a lower index."""
        return len(self._pending)

    @property
    def lines_written(self) -> int:
        return self._out.lines_written

    def put(self, index: int, obj: Mapping[str, Any]) -> None:
        """Hand over the line for ``index``; it is written once every lower index is."""
        line = _encode(obj)  # encode outside the lock, and fail before buffering
        with self._lock:
            if self._out.closed:
                raise ValueError(f"{self.url}: writer is closed")
            if index < self._next or index in self._pending:
                raise ValueError(f"{self.url}: index {index} was already put")
            if self._total is not None and index >= self._start + self._total:
                raise ValueError(f"{self.url}: index {index} is beyond total {self._total}")
            if index != self._next:
                if self._max_pending is not None and len(self._pending) >= self._max_pending:
                    raise ValueError(
                        f"{self.url}: {len(self._pending)} lines are waiting for index "
                        f"{self._next}; max_pending is {self._max_pending}"
                    )
                self._pending[index] = line
                return
            self._out.write_encoded(line)
            self._next += 1
            while self._next in self._pending:
                self._out.write_encoded(self._pending.pop(self._next))
                self._next += 1

    def close(self) -> None:
        """Commit if every index from ``start`` up is present; otherwise discard and raise."""
        with self._lock:
            missing: str | None = None
            if self._pending:
                missing = (
                    f"index {self._next} is missing; {len(self._pending)} later lines "
                    f"(up to index {max(self._pending)}) could not be written"
                )
            elif self._total is not None and self._next != self._start + self._total:
                missing = f"got {self._next - self._start} of {self._total} lines"
            if missing is not None:
                self._pending.clear()
                self._out.abort()
                raise ValueError(f"{self.url}: {missing}; output discarded")
            self._out.close()

    def abort(self) -> None:
        """Discard the output; nothing appears at the final name."""
        with self._lock:
            self._pending.clear()
            self._out.abort()

    def __enter__(self) -> OrderedJsonlWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()
