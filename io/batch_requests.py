"""Read OpenAI-Batch-format (and plain chat) JSONL request files into engine requests.

Why this module exists: a batch of a million prompts must never die on line 731,482 because
someone typed ``"temperature": "hot"``, and it must never lose that line either. So every
input line, blank ones included, becomes exactly one item, in input order: a
:class:`ChatRequest` the engine can run, or a :class:`RejectedRow` that names the line, the
field and the reason and ends up in the output as an error line. The output therefore has as
many lines as the input, and line N of one answers line N of the other.

A stream that cannot be read further (a truncated or corrupt ``.gz``, a file that is not
gzip, a directory, a read error) is not a row: :func:`read_requests` yields every row read
before the break and then raises :class:`InputStreamError`, which says where it broke.

Accepted row shapes (one JSON object per line):

- OpenAI Batch: ``{"custom_id", "method": "POST", "url": "/v1/chat/completions", "body": {...}}``
  where ``body`` is a chat-completions request; ``"url": "/v1/responses"`` and ``"/v1/completions"``
  rows are read by :mod:`kvbatch.io.endpoints` into the same :class:`ChatRequest`.
- Plain chat (what the pipeline's shards feed): ``{"custom_id", "messages", <sampling fields>}``.
  A row is taken as plain when it has none of ``body``, ``method`` or ``url``.

Decisions, each one documented because a user will eventually ask:

- Roles: ``system``, ``user``, ``assistant`` and ``developer``. ``developer`` is OpenAI's new
  name for the system prompt (o1 and later) and open models' chat templates know only
  ``system``, so it is mapped to ``system``. ``tool`` messages (with ``tool_call_id``) and an
  assistant's ``tool_calls`` (its ``content`` may then be null) are a tool-call history, read by
  :mod:`kvbatch.io.tools`; the legacy ``function`` role is rejected. A message's ``name`` and
  other extra keys are dropped.
- ``tools``, ``tool_choice``, ``parallel_tool_calls``: read by :mod:`kvbatch.io.tools` into a tools
  spec in :attr:`SamplingParams.response_format` (the answer is then decoded in the template's
  tool-call format); with a ``response_format`` other than text, refused.
- Content: a string, or the list-of-parts form with only ``{"type": "text"}`` parts, joined
  with ``"\\n"`` (what vLLM does, so one dataset gives the same prompt on both).
  Image/audio/file parts are rejected, not dropped: a prompt silently missing its image
  would produce a confident, wrong answer.
- ``max_completion_tokens`` wins over ``max_tokens`` (vLLM's rule); neither means the
  reader's ``default_max_tokens``.
- ``top_k``: 0 means off; -1 (vLLM's spelling of off) is accepted and stored as 0.
- ``logprobs: true`` alone gives the sampled token's logprob (``SamplingParams.logprobs == 0``);
  with ``top_logprobs: k`` it gives k alternatives. ``top_logprobs > 0`` without
  ``logprobs: true`` is rejected, as OpenAI does.
- The ``model`` field of a row does not choose a model: every row is answered by the one
  model the run loaded (``kvbatch generate --model``, the pipeline's model resource), and the
  output's ``model`` names that model, never the row's. A row may name another model (OpenAI
  files usually say ``"gpt-4o"``); it is kept as :attr:`ChatRequest.model` and the run warns
  once per name it was not given.
- ``response_format``: ``text`` is the default; ``json_object`` and ``json_schema`` become
  :attr:`SamplingParams.response_format`, one canonical JSON string per schema (sorted keys), which
  the engine decodes under a grammar (:mod:`kvbatch.engine.text.structured`). A malformed value is
  rejected naming the sub-field; whether a schema compiles is checked when the row is tokenized.
- ``logit_bias``: an object of token ids (strings of integers, as JSON keys are) to biases in
  [-100, 100], at most 300 entries (OpenAI's rules); ``presence_penalty`` and ``frequency_penalty``
  in [-2, 2]. Whether each id is in the model's vocabulary is checked when the row is tokenized.
- OpenAI fields we do not act on are of two kinds (:data:`REFUSED_FIELDS`, :data:`IGNORED_FIELDS`;
  docs/batch-api.md has the table of every field). One that would change the answer (``functions``,
  ``audio``...) is a rejected row naming it, whenever its value is not
  the neutral one (``functions: []``, ``function_call: "none"`` change nothing
  and pass): answering as if it were absent would be a confident, wrong answer. One that changes
  nothing in the answer (``user``, ``metadata``, ``store``, ``service_tier``...) is accepted and
  ignored, without a warning, under ``--strict`` too.
- Unknown fields (a typo such as ``max_token``, or a field OpenAI does not have) are ignored with
  a warning, logged once per field name per file with the first line that has it, and listed on the
  request (:attr:`ChatRequest.unknown_fields`); with ``strict=True`` (``--strict``) such a
  row is rejected instead, naming the field. Known fields with a wrong type are always
  rejected; types are strict (no ``"0.5"`` -> 0.5, no ``true`` -> 1), since a coerced value
  is a guess about intent.
- Blank and whitespace-only lines are rejected (field ``"$"``, reason ``blank line``), not
  skipped, so that line numbers and output lines stay aligned.
- Numbers: an integer longer than Python's int-string limit (4300 digits) is a malformed
  line, not a crash; integer fields are bounded (``max_tokens``, ``top_k`` and token ids to
  int32, ``seed`` to int64) so no value can overflow a tensor later.
- ``custom_id`` must be a non-empty string; the first occurrence of an id is kept and every
  later one is rejected, whether or not the first one was valid, because an output file
  with two lines for one id is ambiguous either way.
- Whole-line problems (bad UTF-8, bad JSON, not an object) use the field ``"$"``.
- Prompt length needs the tokenizer, so the caller checks it and uses :func:`reject`.
"""

from __future__ import annotations

import dataclasses
import gzip
import itertools
import json
import logging
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import fsspec
from pydantic import (
    BaseModel,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from kvbatch.io.endpoints import MAX_CHOICES, Problem, read_endpoint_row
from kvbatch.io.request_fields import (
    _STRICT,
    BATCH_URLS,
    CHAT_COMPLETIONS_URL,
    COMPLETIONS_URL,
    INT32_MAX,
    INT64_MAX,
    INT64_MIN,
    MAX_LOGIT_BIAS,  # noqa: F401 - ops.prefill.manifests reads it from this module
    MAX_STOP_SEQUENCES,
    MISSING,
    RESPONSES_URL,
    WHOLE_LINE,
    StopString,
    Text,
    _error_field,
    _error_reason,
    _neutral,
    _short,
    _utf8_encodable,
    json_type,
    logit_bias_ids,
    parse_response_format,
)
from kvbatch.io.tools import TOOL_FIELDS, history_message, parse_tools
from kvbatch.io.urls import redact_text

__all__ = [
    "ChatRequest",
    "InputStreamError",
    "RejectedRow",
    "SamplingParams",
    "parse_request_line",
    "read_requests",
    "reject",
]

MAX_TOP_LOGPROBS = 20  # OpenAI's limit
BLANK = "blank line"

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------
# Engine-facing values (plain dataclasses: no validation cost inside the engine's loops)


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request. Already validated; the engine trusts every field."""

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None  # None = off; k = the sampled token plus k alternatives
    ignore_eos: bool = False
    # Structured outputs: the canonical JSON of response_format json_schema / json_object (None: text).
    response_format: str | None = None
    # (token id, bias) pairs sorted by id; penalties on the output's tokens (OpenAI's semantics).
    logit_bias: tuple[tuple[int, float], ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0


@dataclass(frozen=True)
class ChatRequest:
    """One valid input row. ``line_no`` is the 1-based line in the file (blank lines count),
    for messages and stable output ids; an output writer's index is the item's position in
    the :func:`read_requests` stream, which has no gaps. ``model`` is what the row asked for,
    not what answers it (see the module docstring); ``unknown_fields`` are the dotted names of
    the fields that were ignored."""

    line_no: int
    custom_id: str
    messages: list[dict[str, str]]  # [{"role": "system"|"user"|"assistant", "content": str}]
    sampling: SamplingParams
    model: str | None
    # The OpenAI API the row was written for (its batch ``url``; a plain row is chat): it decides the
    # answer's shape (io.batch_output). A ``/v1/completions`` row has no messages: ``prompt`` is its
    # raw text or token ids, which no chat template touches (io.endpoints).
    endpoint: str = CHAT_COMPLETIONS_URL
    prompt: str | tuple[int, ...] | None = None
    # Choices asked for (``n``, 1 to MAX_CHOICES): the decode loop runs n engine requests over the
    # one prompt and gathers them into one answer (ops.decode.loop).
    n: int = 1
    # A ``/v1/completions`` row's ``echo``: the answer's text starts with the prompt's (io.endpoints).
    # Output only, so not in ``sampling``: the engine and the response cache never see it.
    echo: bool = False
    # A diagnostic about the line, not part of the request: two rows asking the same are equal.
    unknown_fields: tuple[str, ...] = dataclasses.field(default=(), compare=False)


@dataclass(frozen=True)
class RejectedRow:
    """One input row that will not run, and why. ``field`` is a dotted path such as
    ``body.messages.2.content`` or ``"$"`` for the whole line."""

    line_no: int
    custom_id: str | None
    field: str
    reason: str


def reject(req: ChatRequest, field: str, reason: str) -> RejectedRow:
    """Turn a parsed request into a rejection for checks made later (prompt too long needs
    the tokenizer), keeping its line and id so it lands in the output like any other."""
    return RejectedRow(line_no=req.line_no, custom_id=req.custom_id, field=field, reason=reason)


# --------------------------------------------------------------------------------------------
# Edge schemas (pydantic)


class _Message(BaseModel):
    model_config = _STRICT
    role: Literal["system", "user", "assistant", "developer", "tool"]
    # Before content: its validator reads them (a null content is an assistant's that calls tools).
    tool_calls: Any = None  # an assistant turn's calls (io.tools)
    tool_call_id: Any = None  # the call a tool message answers
    content: Any = Field(...)
    _as_dict: dict[str, Any] = PrivateAttr(default_factory=dict)

    @model_validator(mode="after")
    def _tool_history(self) -> _Message:
        self._as_dict = history_message(self.role, self.content, self.tool_calls, self.tool_call_id)
        return self

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, v: Any, info: ValidationInfo) -> str | None:
        """Accept a string or the list-of-text-parts form, and return one string (null: an
        assistant turn that only calls tools, checked with its tool_calls)."""
        if v is None and info.data.get("role") == "assistant" and info.data.get("tool_calls") is not None:
            return None
        if isinstance(v, str):
            return _utf8_encodable(v)
        if isinstance(v, list):
            texts: list[str] = []
            for i, part in enumerate(v):
                if not isinstance(part, dict):
                    raise ValueError(f"part {i} must be an object, got {type(part).__name__}")
                kind = part.get("type")
                if kind != "text":
                    raise ValueError(f"part {i} has type {kind!r}; only text parts are supported")
                text = part.get("text")
                if not isinstance(text, str):
                    raise ValueError(f"part {i} text must be a string, got {_short(text)}")
                texts.append(_utf8_encodable(text))
            return "\n".join(texts)
        raise ValueError(f"must be a string or a list of text parts, got {_short(v)}")


class _ChatBody(BaseModel):
    """The chat-completions fields we act on. Everything else in the body is ignored."""

    model_config = _STRICT
    model: Text | None = None
    messages: list[_Message] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1, le=INT32_MAX)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    stop: list[StopString] | None = Field(default=None, max_length=MAX_STOP_SEQUENCES)
    stop_token_ids: list[Annotated[int, Field(ge=0, le=INT32_MAX)]] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    n: int | None = Field(default=None, ge=1, le=MAX_CHOICES)
    ignore_eos: bool | None = None
    logit_bias: dict[int, float] | None = None
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_str_to_list(cls, v: Any) -> Any:
        """OpenAI allows ``stop`` as one string or a list; normalize to a list."""
        return [v] if isinstance(v, str) else v

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _logit_bias(cls, v: Any) -> Any:
        return v if v is None else logit_bias_ids(v)


class _BatchEnvelope(BaseModel):
    model_config = _STRICT
    method: Literal["POST"]
    url: str
    body: _ChatBody

    @field_validator("url")
    @classmethod
    def _chat_url(cls, v: str) -> str:
        # The other endpoints' rows never get here (parse_request_line hands them to io.endpoints).
        if v != CHAT_COMPLETIONS_URL:
            raise ValueError(f"must be one of {', '.join(map(repr, BATCH_URLS))}, got {_short(v)}")
        return v


# --------------------------------------------------------------------------------------------
# Parsing


def parse_request_line(
    line: bytes, line_no: int, *, default_max_tokens: int = 256, strict: bool = False
) -> ChatRequest | RejectedRow:
    """Parse one raw JSONL line. Never raises for bad input: it returns a RejectedRow.

    ``strict`` rejects a row with a field this reader does not know instead of ignoring it.
    Duplicate ``custom_id`` detection needs the whole file's history, so it lives in
    :func:`read_requests`, not here.
    """
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as e:
        return RejectedRow(line_no, None, WHOLE_LINE, f"invalid UTF-8 at byte offset {e.start}")
    if line_no == 1 and text.startswith("\ufeff"):  # a BOM written by some editors
        text = text[1:]
    if not text.strip():
        return RejectedRow(line_no, None, WHOLE_LINE, BLANK)
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return RejectedRow(line_no, None, WHOLE_LINE, f"malformed JSON: {e.msg} at column {e.colno}")
    except RecursionError:
        return RejectedRow(line_no, None, WHOLE_LINE, "malformed JSON: nested too deeply")
    except ValueError as e:
        # json turns digits into int() and Python refuses more than sys.get_int_max_str_digits()
        # of them (a guard against quadratic-time parsing): the line is unreadable, not the file.
        if "integer string conversion" in str(e):
            limit = sys.get_int_max_str_digits()
            return RejectedRow(line_no, None, WHOLE_LINE, f"malformed JSON: an integer has more than {limit} digits")
        return RejectedRow(line_no, None, WHOLE_LINE, f"malformed JSON: {e}")
    if not isinstance(obj, dict):
        return RejectedRow(line_no, None, WHOLE_LINE, f"must be a JSON object, got {json_type(obj)}")

    custom_id = obj.get("custom_id")
    if "custom_id" not in obj:
        return RejectedRow(line_no, None, "custom_id", MISSING)
    if not isinstance(custom_id, str):
        return RejectedRow(line_no, None, "custom_id", f"must be a string, got {json_type(custom_id)}")
    if not custom_id:
        return RejectedRow(line_no, None, "custom_id", "must not be empty")
    try:
        _utf8_encodable(custom_id)
    except ValueError as e:
        return RejectedRow(line_no, None, "custom_id", str(e))

    is_batch = any(k in obj for k in ("body", "method", "url"))
    if is_batch and obj.get("url") in (RESPONSES_URL, COMPLETIONS_URL):
        got = read_endpoint_row(obj, default_max_tokens=default_max_tokens, strict=strict)
        if isinstance(got, Problem):
            return RejectedRow(line_no, custom_id, got.path, got.reason)
        return ChatRequest(line_no, custom_id, got.messages, SamplingParams(**got.sampling), got.model,
                           endpoint=obj["url"], prompt=got.prompt, unknown_fields=got.unknown_fields, n=got.n,
                           echo=got.echo)
    prefix = "body." if is_batch else ""
    raw = obj.get("body") if is_batch else obj
    refused = [(prefix + name, why) for name, why in _refused_fields(raw)] if isinstance(raw, dict) else []
    try:
        if is_batch:
            body = _BatchEnvelope.model_validate(obj).body
        else:
            body = _ChatBody.model_validate(obj)
    except ValidationError as e:
        field, reason = describe_validation_error(e)
        return RejectedRow(line_no, custom_id, field, reason + "".join(f"; {f}: {why}" for f, why in refused))
    if refused:  # every reason, the first field named
        reason = refused[0][1] + "".join(f"; {f}: {why}" for f, why in refused[1:])
        return RejectedRow(line_no, custom_id, refused[0][0], reason)

    unknown = _unknown_fields(obj, is_batch)
    if unknown and strict:
        return RejectedRow(line_no, custom_id, unknown[0], "unknown field (strict mode rejects fields it would ignore)")
    item = _to_request(body, line_no, custom_id, prefix, default_max_tokens)
    raw_body = obj["body"] if is_batch else obj
    if isinstance(item, ChatRequest) and raw_body.get("response_format") is not None:
        rf = parse_response_format(raw_body["response_format"])
        if isinstance(rf, tuple):
            return RejectedRow(line_no, custom_id, prefix + "response_format" + rf[0], rf[1])
        if rf is not None:
            item = dataclasses.replace(item, sampling=dataclasses.replace(item.sampling, response_format=rf))
    if isinstance(item, ChatRequest) and any(raw_body.get(k) is not None for k in TOOL_FIELDS):
        spec = parse_tools(raw_body)
        if isinstance(spec, tuple):
            return RejectedRow(line_no, custom_id, prefix + spec[0], spec[1])
        if spec is not None and item.sampling.response_format is not None:
            return RejectedRow(line_no, custom_id, prefix + "tools",
                               "cannot be combined with a response_format other than text: the answer is "
                               "either tool calls or the format")
        if spec is not None:
            item = dataclasses.replace(item, sampling=dataclasses.replace(item.sampling, response_format=spec))
    if unknown and isinstance(item, ChatRequest):
        item = dataclasses.replace(item, unknown_fields=unknown)
    return item


_ENVELOPE_FIELDS = frozenset({"custom_id", "method", "url", "body"})
_BODY_FIELDS = frozenset(_ChatBody.model_fields)
# Read by parse_response_format and io.tools, not by _ChatBody (the columnar reader sends such rows per-row).
_STRUCTURED_FIELDS = frozenset({"response_format", *TOOL_FIELDS})

# OpenAI chat-completions fields that would change the answer and that kvbatch cannot honour: the
# reason a row that sets one is refused, and the values besides null that change nothing (accepted).
REFUSED_FIELDS: dict[str, tuple[str, tuple[Any, ...]]] = {
    "functions": ("function calling is not supported", ([],)),
    "function_call": ("function calling is not supported", ("none",)),
    "audio": ("audio output is not supported", ()),
    "modalities": ("only text output is supported", (["text"],)),
    "moderation": ("moderation of the request and the answer is not supported", ()),
    "reasoning_effort": ("reasoning_effort is not supported: the model has no such setting", ()),
    "verbosity": ("verbosity is not supported", ()),
    "web_search_options": ("web search is not supported", ()),
}
# OpenAI chat-completions fields that change nothing in the answer: accepted and ignored (no
# warning, --strict accepts them).
IGNORED_FIELDS = frozenset({
    "user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key",
    "prompt_cache_retention", "prompt_cache_options", "stream", "stream_options", "prediction",
})


def _refused_fields(body: dict[str, Any]) -> list[tuple[str, str]]:
    """(field, reason) for each field of ``body``, in its order, that would change the answer and is
    not honoured."""
    return [(name, f"{REFUSED_FIELDS[name][0]}, got {_short(value)}") for name, value in body.items()
            if name in REFUSED_FIELDS and not _neutral(value, REFUSED_FIELDS[name][1])]


def _unknown_fields(obj: dict[str, Any], is_batch: bool) -> tuple[str, ...]:
    """Dotted names of the fields of a validated row that nothing reads, in the row's order."""
    known = _BODY_FIELDS | _STRUCTURED_FIELDS | IGNORED_FIELDS | frozenset(REFUSED_FIELDS)
    if is_batch:
        top = [k for k in obj if k not in _ENVELOPE_FIELDS]
        return (*top, *(f"body.{k}" for k in obj["body"] if k not in known))
    return tuple(k for k in obj if k != "custom_id" and k not in known)


def _to_request(
    body: _ChatBody, line_no: int, custom_id: str, prefix: str, default_max_tokens: int
) -> ChatRequest | RejectedRow:
    """Cross-field checks and the conversion to engine values."""
    if body.top_logprobs and not body.logprobs:
        return RejectedRow(
            line_no, custom_id, prefix + "top_logprobs", "requires logprobs: true"
        )
    if body.logprobs:
        logprobs: int | None = body.top_logprobs or 0
    else:
        logprobs = None
    max_tokens = body.max_completion_tokens or body.max_tokens or default_max_tokens
    d = SamplingParams()
    sampling = SamplingParams(
        max_tokens=max_tokens,
        temperature=d.temperature if body.temperature is None else float(body.temperature),
        top_p=d.top_p if body.top_p is None else float(body.top_p),
        top_k=max(body.top_k or 0, 0),
        min_p=d.min_p if body.min_p is None else float(body.min_p),
        seed=body.seed,
        stop=tuple(body.stop or ()),
        stop_token_ids=tuple(body.stop_token_ids or ()),
        logprobs=logprobs,
        ignore_eos=bool(body.ignore_eos),
        logit_bias=tuple(sorted((body.logit_bias or {}).items())),
        presence_penalty=float(body.presence_penalty or 0.0),
        frequency_penalty=float(body.frequency_penalty or 0.0),
    )
    messages = [m._as_dict for m in body.messages]
    return ChatRequest(line_no, custom_id, messages, sampling, body.model, n=body.n or 1)


def describe_validation_error(e: ValidationError) -> tuple[str, str]:
    """(the first error's dotted field path, every reason): the first error's reason with the
    offending value, then each further error as ``; <field>: <reason>``, so a row wrong in two
    places says both instead of hiding the second behind a count."""
    errors = e.errors(include_url=False)
    field = _error_field(errors[0])
    msg = _error_reason(errors[0])
    for err in errors[1:]:
        msg += f"; {_error_field(err)}: {_error_reason(err)}"
    return field, msg


# --------------------------------------------------------------------------------------------
# Streaming reader


class InputStreamError(Exception):
    """The request stream cannot be read further: it could not be opened, or it broke after
    ``lines_read`` lines (every one of them was yielded). Not a row's fault, so not a row."""

    def __init__(self, url: str, lines_read: int, reason: str) -> None:
        self.url = url
        self.lines_read = lines_read
        self.reason = reason
        where = f" after line {lines_read}" if lines_read else ""
        # The URL and the reason (an exception's text may quote it) can hold a credential.
        super().__init__(redact_text(f"cannot read {url}{where}: {reason}", url))


def _stream_reason(exc: BaseException) -> str:
    """What broke, in words a user can act on (the exception types are the stdlib's)."""
    if isinstance(exc, EOFError):
        return "the compressed stream ends early (truncated file?)"
    if isinstance(exc, gzip.BadGzipFile):
        return f"not a valid gzip file ({exc})"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror.lower() if isinstance(exc, (IsADirectoryError, FileNotFoundError,
                                                        PermissionError)) else str(exc)
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _raw_lines(f: Any, url: str) -> Iterator[bytes]:
    """The file's lines; any failure to read (bad gzip, truncated stream, I/O) becomes an
    :class:`InputStreamError` that counts the lines already handed out."""
    n = 0
    try:
        while True:
            try:
                raw = f.readline()
            except Exception as exc:  # noqa: BLE001 - any reader's failure ends the stream, in one message
                raise InputStreamError(url, n, _stream_reason(exc)) from exc
            if not raw:
                return
            n += 1
            yield raw
    finally:
        f.close()


def read_requests(
    url: str,
    *,
    default_max_tokens: int = 256,
    storage_options: Mapping[str, Any] | None = None,
    strict: bool = False,
    check_duplicates: bool = True,
) -> Iterator[ChatRequest | RejectedRow]:
    """Stream a request file, yielding one item per line (blank lines too), in input order.

    ``url`` is a local path or any fsspec URL (``s3://``, ``memory://``...); compression is
    inferred from the extension (``.gz``, ``.zst``...). The file is opened and its first line
    read before this returns, so a missing, unreadable or not-really-compressed input fails
    here, before any model is loaded, with :class:`InputStreamError`; a stream that breaks
    later raises it after every line before the break has been yielded. Memory stays bounded
    by the longest line plus the set of ``custom_id`` values seen (needed to reject
    duplicates; ``check_duplicates=False`` leaves that to the caller, as ingest does with a
    spill to disk, and then memory is the longest line). Line numbers are 1-based, so they match what an editor shows. Unknown fields
    are logged once per name (``strict``: rejected, see the module docstring).
    """
    try:
        f = fsspec.open(url, "rb", compression="infer", **dict(storage_options or {})).open()
    except Exception as exc:  # noqa: BLE001 - any opener's failure is one message naming the input
        raise InputStreamError(url, 0, _stream_reason(exc)) from exc
    lines = _raw_lines(f, url)
    first = next(lines, None)  # reads the header of a compressed file: not gzip fails now
    return _parse_lines(url, first, lines, default_max_tokens, strict, check_duplicates)


def read_line_blocks(url: str, *, block_lines: int = 8192, storage_options: Mapping[str, Any] | None = None,
                     read_bytes: int = 1 << 22) -> Iterator[list[bytes]]:
    """The file's lines (without their ``\\n``) in lists of at most ``block_lines``, read in
    ``read_bytes`` chunks (no per-line read call): for the columnar ingest. Opening fails here,
    as in :func:`read_requests`; a stream that breaks later raises :class:`InputStreamError`
    counting the lines of the blocks already handed out."""
    try:
        f = fsspec.open(url, "rb", compression="infer", **dict(storage_options or {})).open()
    except Exception as exc:
        raise InputStreamError(url, 0, _stream_reason(exc)) from exc
    try:
        first = f.read(read_bytes)
    except Exception as exc:
        f.close()
        raise InputStreamError(url, 0, _stream_reason(exc)) from exc
    return _line_blocks(f, url, first, block_lines, read_bytes)


def _line_blocks(f: Any, url: str, data: bytes, block_lines: int, read_bytes: int) -> Iterator[list[bytes]]:
    handed = 0
    pending: list[bytes] = []
    tail = b""
    try:
        while data:
            parts = (tail + data).split(b"\n")
            tail = parts.pop()
            pending += parts
            while len(pending) >= block_lines:
                block, pending = pending[:block_lines], pending[block_lines:]
                handed += len(block)
                yield block
            try:
                data = f.read(read_bytes)
            except Exception as exc:
                raise InputStreamError(url, handed, _stream_reason(exc)) from exc
        if tail:
            pending.append(tail)
        if pending:
            yield pending
    finally:
        f.close()


def warn_unknown_fields(url: str, item: ChatRequest | RejectedRow, warned: set[str]) -> None:
    """Log each unknown field name once per file (``warned``: the names already logged)."""
    if isinstance(item, ChatRequest) and item.unknown_fields:
        for name in item.unknown_fields:
            if name not in warned:
                warned.add(name)
                log.warning("%s line %d: unknown field %r ignored (warned once per field name; "
                            "--strict rejects such rows)", url, item.line_no, name)


def _parse_lines(
    url: str, first: bytes | None, lines: Iterator[bytes], default_max_tokens: int, strict: bool,
    check_duplicates: bool = True,
) -> Iterator[ChatRequest | RejectedRow]:
    seen: dict[str, int] = {}
    warned: set[str] = set()
    try:
        if first is None:
            return
        for line_no, raw in enumerate(itertools.chain((first,), lines), start=1):
            item = parse_request_line(raw, line_no, default_max_tokens=default_max_tokens, strict=strict)
            cid = item.custom_id
            if cid is not None and check_duplicates:
                first_line = seen.setdefault(cid, line_no)
                if first_line != line_no:
                    item = RejectedRow(line_no, cid, "custom_id", f"duplicate of line {first_line}")
            warn_unknown_fields(url, item, warned)
            yield item
    finally:
        lines.close()  # type: ignore[attr-defined]
