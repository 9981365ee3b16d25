"""Read OpenAI-Batch-format (and plain chat) JSONL request files into engine requests.

Why this module exists: a batch of a million prompts must never die on line 731,482 because
someone typed ``"temperature": "hot"``, and it must never lose that line either. So every
non-blank input line becomes exactly one item, in input order: a :class:`ChatRequest` the
engine can run, or a :class:`RejectedRow` that names the line, the field and the reason and
ends up in the output as an error line.

Accepted row shapes (one JSON object per line):

- OpenAI Batch: ``{"custom_id", "method": "POST", "url": "/v1/chat/completions", "body": {...}}``
  where ``body`` is a chat-completions request.
- Plain chat (what the pipeline's shards feed): ``{"custom_id", "messages", <sampling fields>}``.
  A row is taken as plain when it has none of ``body``, ``method`` or ``url``.

Decisions, each one documented because a user will eventually ask:

- Roles: ``system``, ``user``, ``assistant`` and ``developer``. ``developer`` is OpenAI's new
  name for the system prompt (o1 and later) and open models' chat templates know only
  ``system``, so it is mapped to ``system``. ``tool`` / ``function`` messages are rejected
  (no tool calling here). A message's ``name`` and other extra keys are dropped.
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
- Unknown body fields are ignored (OpenAI clients send many: ``stream``, ``user``,
  ``metadata``...), but known fields with a wrong type are rejected; types are strict (no
  ``"0.5"`` -> 0.5, no ``true`` -> 1), since a coerced value is a guess about intent.
- ``custom_id`` must be a non-empty string; the first occurrence of an id is kept and every
  later one is rejected, whether or not the first one was valid, because an output file
  with two lines for one id is ambiguous either way.
- Whole-line problems (bad UTF-8, bad JSON, not an object) use the field ``"$"``.
- Prompt length needs the tokenizer, so the caller checks it and uses :func:`reject`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import fsspec
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
)

__all__ = [
    "ChatRequest",
    "RejectedRow",
    "SamplingParams",
    "parse_request_line",
    "read_requests",
    "reject",
]

CHAT_COMPLETIONS_URL = "/v1/chat/completions"
MAX_STOP_SEQUENCES = 4  # OpenAI's limit
MAX_TOP_LOGPROBS = 20  # OpenAI's limit
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
WHOLE_LINE = "$"
MISSING = "required field is missing"


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


@dataclass(frozen=True)
class ChatRequest:
    """One valid input row. ``line_no`` is the 1-based line in the file (blank lines count),
    for messages and stable output ids; an output writer's index is the item's position in
    the :func:`read_requests` stream, which has no gaps."""

    line_no: int
    custom_id: str
    messages: list[dict[str, str]]  # [{"role": "system"|"user"|"assistant", "content": str}]
    sampling: SamplingParams
    model: str | None


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


def _utf8_encodable(s: str) -> str:
    # json.loads accepts lone surrogates ("\ud800"); they would crash the tokenizer or the
    # output writer much later, far from the line that caused it.
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"contains an unpaired surrogate at position {e.start}") from None
    return s


Text = Annotated[str, AfterValidator(_utf8_encodable)]
StopString = Annotated[str, Field(min_length=1), AfterValidator(_utf8_encodable)]

_STRICT = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class _Message(BaseModel):
    model_config = _STRICT
    role: Literal["system", "user", "assistant", "developer"]
    content: Any = Field(...)

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, v: Any) -> str:
        """Accept a string or the list-of-text-parts form, and return one string."""
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
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    stop: list[StopString] | None = Field(default=None, max_length=MAX_STOP_SEQUENCES)
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    n: int | None = None
    ignore_eos: bool | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_str_to_list(cls, v: Any) -> Any:
        """OpenAI allows ``stop`` as one string or a list; normalize to a list."""
        return [v] if isinstance(v, str) else v


class _BatchEnvelope(BaseModel):
    model_config = _STRICT
    method: Literal["POST"]
    url: Literal["/v1/chat/completions"]
    body: _ChatBody


# --------------------------------------------------------------------------------------------
# Parsing


def parse_request_line(
    line: bytes, line_no: int, *, default_max_tokens: int = 256
) -> ChatRequest | RejectedRow:
    """Parse one raw JSONL line. Never raises for bad input: it returns a RejectedRow.

    Duplicate ``custom_id`` detection needs the whole file's history, so it lives in
    :func:`read_requests`, not here.
    """
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as e:
        return RejectedRow(line_no, None, WHOLE_LINE, f"invalid UTF-8 at byte offset {e.start}")
    if line_no == 1 and text.startswith("\ufeff"):  # a BOM written by some editors
        text = text[1:]
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return RejectedRow(line_no, None, WHOLE_LINE, f"malformed JSON: {e.msg} at column {e.colno}")
    except RecursionError:
        return RejectedRow(line_no, None, WHOLE_LINE, "malformed JSON: nested too deeply")
    if not isinstance(obj, dict):
        return RejectedRow(line_no, None, WHOLE_LINE, f"must be a JSON object, got {_json_type(obj)}")

    custom_id = obj.get("custom_id")
    if "custom_id" not in obj:
        return RejectedRow(line_no, None, "custom_id", MISSING)
    if not isinstance(custom_id, str):
        return RejectedRow(line_no, None, "custom_id", f"must be a string, got {_json_type(custom_id)}")
    if not custom_id:
        return RejectedRow(line_no, None, "custom_id", "must not be empty")
    try:
        _utf8_encodable(custom_id)
    except ValueError as e:
        return RejectedRow(line_no, None, "custom_id", str(e))

    is_batch = any(k in obj for k in ("body", "method", "url"))
    try:
        if is_batch:
            body = _BatchEnvelope.model_validate(obj).body
        else:
            body = _ChatBody.model_validate(obj)
    except ValidationError as e:
        field, reason = _describe(e)
        return RejectedRow(line_no, custom_id, field, reason)

    prefix = "body." if is_batch else ""
    return _to_request(body, line_no, custom_id, prefix, default_max_tokens)


def _to_request(
    body: _ChatBody, line_no: int, custom_id: str, prefix: str, default_max_tokens: int
) -> ChatRequest | RejectedRow:
    """Cross-field checks and the conversion to engine values."""
    if body.n is not None and body.n != 1:
        return RejectedRow(line_no, custom_id, prefix + "n", f"only n=1 is supported, got {body.n}")
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
    )
    messages = [
        {"role": "system" if m.role == "developer" else m.role, "content": m.content}
        for m in body.messages
    ]
    return ChatRequest(line_no, custom_id, messages, sampling, body.model)


def _describe(e: ValidationError) -> tuple[str, str]:
    """The first pydantic error as (dotted field path, reason with the offending value)."""
    errors = e.errors(include_url=False)
    err = errors[0]
    field = ".".join(str(p) for p in err["loc"]) or WHOLE_LINE
    msg = _CLASS_NAME.sub("", err["msg"])
    if err["type"] == "value_error":  # our own validators: the message already says it all
        msg = msg.removeprefix("Value error, ")
    elif err["type"] == "missing":
        msg = MISSING
    else:
        msg = f"{msg}, got {_short(err.get('input'))}"
    if len(errors) > 1:
        msg += f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''})"
    return field, msg


_CLASS_NAME = re.compile(r" or instance of _\w+")


def _json_type(v: Any) -> str:
    """The JSON name of a Python value's type, for messages a JSON author understands."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, (int, float)):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, list):
        return "array"
    return "object"


def _short(v: Any, limit: int = 60) -> str:
    """A value as JSON, cut short: reasons quote the bad value without copying a whole prompt."""
    try:
        s = json.dumps(v, ensure_ascii=False)
        s.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates: keep the reason itself writable
        s = json.dumps(v, ensure_ascii=True)
    except (TypeError, ValueError):
        s = repr(v)
    return s if len(s) <= limit else s[: limit - 3] + "..."


# --------------------------------------------------------------------------------------------
# Streaming reader


def read_requests(
    url: str,
    *,
    default_max_tokens: int = 256,
    storage_options: Mapping[str, Any] | None = None,
) -> Iterator[ChatRequest | RejectedRow]:
    """Stream a request file, yielding one item per non-blank line, in input order.

    ``url`` is a local path or any fsspec URL (``s3://``, ``memory://``...); compression is
    inferred from the extension (``.gz``, ``.zst``...). Memory stays bounded by the longest
    line plus the set of ``custom_id`` values seen (needed to reject duplicates). Line
    numbers are 1-based and count blank lines, so they match what an editor shows.
    """
    seen: dict[str, int] = {}
    with fsspec.open(url, "rb", compression="infer", **dict(storage_options or {})) as f:
        for line_no, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            item = parse_request_line(raw, line_no, default_max_tokens=default_max_tokens)
            cid = item.custom_id
            if cid is not None:
                first = seen.setdefault(cid, line_no)
                if first != line_no:
                    item = RejectedRow(line_no, cid, "custom_id", f"duplicate of line {first}")
            yield item
