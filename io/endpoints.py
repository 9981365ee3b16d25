"""OpenAI Batch rows for ``/v1/responses`` and ``/v1/completions``, read into the one request kvbatch
runs (:class:`~kvbatch.io.batch_requests.ChatRequest`).

Why a second dialect module: a batch file written for OpenAI may use any of its three text endpoints,
and each row must be answered, or refused naming why, under the same rules as a chat row
(:mod:`kvbatch.io.batch_requests`: strict types, every reason of a bad row, fields that would change
the answer refused, fields that change nothing accepted, unknown fields warned about or, under
``--strict``, refused). :func:`~kvbatch.io.batch_requests.parse_request_line` hands a row whose
``url`` names one of these endpoints to :func:`read_endpoint_row` and makes its
:class:`~kvbatch.io.batch_requests.ChatRequest` from the answer (this module builds on
:mod:`kvbatch.io.request_fields`, as the chat reader does, and imports no reader).

- ``/v1/responses``: ``input`` (a string: one user message; or a list of messages ``{role, content}``
  whose content is a string or ``input_text``/``output_text`` parts, joined with ``"\\n"`` as chat's
  text parts are) and ``instructions`` (a system message before them) become the row's messages,
  rendered by the model's chat template like a chat row's. ``max_output_tokens``, ``temperature``,
  ``top_p``; ``text.format`` (``text``, ``json_object``, or ``json_schema`` with ``name``, ``schema``,
  ``strict`` directly in ``format``) becomes the same canonical response format a chat row's
  ``response_format`` does (:func:`~kvbatch.io.request_fields.parse_response_format`), so one schema is
  one grammar whichever endpoint asked for it. Function ``tools`` (flat: ``name``, ``parameters``...,
  strict by default), ``tool_choice`` and ``parallel_tool_calls``, and ``function_call`` /
  ``function_call_output`` input items, are read by :mod:`kvbatch.io.tools` into the chat forms, so a
  row with tools decodes as the chat row with the same tools does; other tool types are refused.
- ``/v1/completions``: ``prompt`` is raw text (no chat template: the model continues it) or token ids:
  a string, one-element array of a string, an array of token ids, or a one-element array of one.
  An array of several prompts would be several answers to one row, which the output shape
  (one line, one answer) cannot hold: a 400 saying to send one row per prompt. ``max_tokens``
  defaults to 16 as at OpenAI (not the reader's default); ``temperature``, ``top_p``, ``stop``,
  ``seed``; ``logprobs`` (0 to 5: the sampled token's logprob and that many alternatives, written in
  the completions shape by :mod:`kvbatch.io.batch_output`); ``logit_bias``, ``presence_penalty`` and
  ``frequency_penalty`` under a chat row's rules, into the same sampling fields (the penalties count
  the output's tokens, never the prompt's). ``echo: true`` puts the prompt's text before each
  choice's completion in ``choices[i].text``, as OpenAI's legacy endpoint does (a prompt of token
  ids echoes their decoding); it changes only the output line, never what the engine runs
  (:attr:`EndpointRow.echo`, carried to :attr:`kvbatch.ops.jobs.Job.echo`). ``echo`` with
  ``logprobs`` is a 400 naming both: OpenAI then gives the prompt tokens' logprobs too, which
  kvbatch's engine does not compute. ``suffix`` (text after the insertion point) is refused:
  kvbatch has no fill-in-the-middle.

The row keeps its endpoint (:attr:`ChatRequest.endpoint`), so every later step can answer in its
shape; a completions row keeps its prompt in :attr:`ChatRequest.prompt` and has no messages.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationError, field_validator

from kvbatch.io.request_fields import (
    _STRICT,
    COMPLETIONS_URL,
    INT32_MAX,
    INT64_MAX,
    INT64_MIN,
    MAX_STOP_SEQUENCES,
    MISSING,
    RESPONSES_URL,
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
from kvbatch.io.tools import TOOL_FIELDS, add_responses_item, parse_responses_tools

__all__ = [
    "COMPLETIONS_DEFAULT_MAX_TOKENS",
    "COMPLETIONS_IGNORED",
    "COMPLETIONS_REFUSED",
    "ECHO_WITH_LOGPROBS",
    "RESPONSES_IGNORED",
    "RESPONSES_REFUSED",
    "EndpointRow",
    "Problem",
    "read_endpoint_row",
    "prompt_field",
    "schema_field",
]

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_COMPLETIONS_LOGPROBS = 5  # OpenAI's limit
# The most choices (``n``) one chat or completions row may ask for: OpenAI's bound. A row of n
# choices is n engine requests over one prompt (ops.decode.loop), so n also bounds a row's work.
MAX_CHOICES = 128
_ROLES = ("system", "user", "assistant", "developer")
_TEXT_PARTS = ("input_text", "output_text")  # output_text: an assistant turn of the history

# Fields that would change the answer and that kvbatch cannot honour: the reason, and the values
# besides null that change nothing (accepted). As batch_requests.REFUSED_FIELDS is for chat.
RESPONSES_REFUSED: dict[str, tuple[str, tuple[Any, ...]]] = {
    "reasoning": ("reasoning settings are not supported: the model has none", ({},)),
    "previous_response_id": ("previous_response_id is not supported: a batch row holds its whole input", ()),
    "conversation": ("conversations are not supported: a batch row holds its whole input", ()),
    "prompt": ("prompt templates are not supported: send the input itself", ()),
    "include": ("include is not supported (no extra output data)", ([],)),
    "top_logprobs": ("top_logprobs is not supported on /v1/responses (only 0)", (0,)),
    "truncation": ("truncation is not supported (only 'disabled': a prompt longer than the context "
                   "window is refused)", ("disabled",)),
    "context_management": ("context management is not supported", ([],)),
    "moderation": ("moderation of the request and the answer is not supported", ()),
    "image": ("image options are not supported: only text output", ()),
    "access_programs": ("access programs are not supported", ()),
}
# Fields that change nothing in the answer: accepted and ignored (under --strict too).
# ``max_tool_calls`` bounds calls of built-in tools (none here; function tools: io.tools); ``background``
# is how the answer is delivered, not what it is.
RESPONSES_IGNORED = frozenset({
    "metadata", "store", "stream", "stream_options", "user", "safety_identifier", "service_tier",
    "prompt_cache_key", "prompt_cache_retention", "prompt_cache_options",
    "max_tool_calls", "background", "background_options",
})
COMPLETIONS_REFUSED: dict[str, tuple[str, tuple[Any, ...]]] = {
    "best_of": ("only best_of=1 is supported", (1,)),
    "suffix": ("suffix (insertion) is not supported", ("",)),
}
COMPLETIONS_IGNORED = frozenset({"user", "stream", "stream_options"})
# OpenAI answers echo + logprobs with the prompt tokens' logprobs as well (the first one null);
# the engine computes logprobs of sampled tokens only, and a half-filled list would be wrong.
ECHO_WITH_LOGPROBS = ("echo cannot be combined with logprobs: the answer would need the prompt tokens' "
                      "logprobs, which kvbatch does not compute (drop body.echo or body.logprobs)")

# Where a row's prompt and its structured-output schema are, by endpoint (for the reasons of
# checks made after parsing: the prompt's length, the schema's compilation).
_PROMPT_FIELDS = {RESPONSES_URL: "body.input", COMPLETIONS_URL: "body.prompt"}
_SCHEMA_FIELDS = {RESPONSES_URL: "body.text.format.schema"}


def prompt_field(endpoint: str | None) -> str:
    """The request field a row's prompt is in (a prompt too long for the context is refused under it);
    None is a chat row, as in the prompts table."""
    return _PROMPT_FIELDS.get(endpoint, "body.messages")


def schema_field(endpoint: str | None) -> str:
    """The request field a row's JSON schema is in (a schema that cannot compile is refused under it)."""
    return _SCHEMA_FIELDS.get(endpoint, "body.response_format.json_schema.schema")


# --------------------------------------------------------------------------------------------
# Edge schemas (pydantic): the scalar fields. ``input``, ``text`` and ``prompt`` are read by the
# functions below, which name the part of them that is wrong (a list item, a content part).


class _ResponsesBody(BaseModel):
    model_config = _STRICT
    model: Text | None = None
    input: Any = Field(...)
    instructions: Text | None = None
    max_output_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    text: Any = None


class _CompletionsBody(BaseModel):
    model_config = _STRICT
    model: Text | None = None
    prompt: Any = Field(...)
    max_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    stop: list[StopString] | None = Field(default=None, max_length=MAX_STOP_SEQUENCES)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_COMPLETIONS_LOGPROBS)
    n: int | None = Field(default=None, ge=1, le=MAX_CHOICES)
    # As a chat row's (io.batch_requests._ChatBody): the same rules, the same SamplingParams fields.
    logit_bias: dict[int, float] | None = None
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    # Output only: the prompt's text before the completion (ops.decode.generate.answer_line).
    echo: bool | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_str_to_list(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _logit_bias(cls, v: Any) -> Any:
        return v if v is None else logit_bias_ids(v)


class _ResponsesEnvelope(BaseModel):
    model_config = _STRICT
    method: Literal["POST"]
    url: Literal["/v1/responses"]
    body: _ResponsesBody


class _CompletionsEnvelope(BaseModel):
    model_config = _STRICT
    method: Literal["POST"]
    url: Literal["/v1/completions"]
    body: _CompletionsBody


_ENVELOPES: dict[str, type[BaseModel]] = {RESPONSES_URL: _ResponsesEnvelope, COMPLETIONS_URL: _CompletionsEnvelope}
_REFUSED = {RESPONSES_URL: RESPONSES_REFUSED, COMPLETIONS_URL: COMPLETIONS_REFUSED}
_KNOWN = {RESPONSES_URL: frozenset(_ResponsesBody.model_fields) | RESPONSES_IGNORED | frozenset(RESPONSES_REFUSED)
          | frozenset(TOOL_FIELDS),
          COMPLETIONS_URL: frozenset(_CompletionsBody.model_fields) | COMPLETIONS_IGNORED
          | frozenset(COMPLETIONS_REFUSED)}
_ENVELOPE_FIELDS = frozenset({"custom_id", "method", "url", "body"})


@dataclass(frozen=True)
class Problem:
    """What is wrong with a part read by hand: the path below the field, and the reason. (Not a
    tuple: a prompt of token ids is one.)"""

    path: str
    reason: str


# --------------------------------------------------------------------------------------------
# The parts read by hand


def input_messages(v: Any) -> list[dict[str, str]] | Problem:
    """A Responses ``input`` as chat messages, or (the path below ``input``, the reason)."""
    if isinstance(v, str):
        try:
            return [{"role": "user", "content": _utf8_encodable(v)}]
        except ValueError as e:
            return Problem("", str(e))
    if not isinstance(v, list) or not v:
        return Problem("", f"must be a string or a non-empty list of messages, got {_short(v)}")
    messages = []
    for i, item in enumerate(v):
        if not isinstance(item, dict):
            return Problem(f".{i}", f"must be a message object, got {json_type(item)}")
        kind = item.get("type", "message")
        if kind in ("function_call", "function_call_output"):  # a tool-call history (io.tools)
            try:
                add_responses_item(messages, item)
            except ValueError as e:
                return Problem(f".{i}", str(e))
            continue
        if kind != "message":
            return Problem(f".{i}.type", f"only message, function_call and function_call_output items are "
                                         f"supported, got {_short(kind)}")
        role = item.get("role")
        if role not in _ROLES:
            return Problem(f".{i}.role", f"must be one of {', '.join(map(repr, _ROLES))}, got {_short(role)}")
        content = _content_text(item["content"] if "content" in item else _MISSING_CONTENT)
        if isinstance(content, Problem):
            return Problem(f".{i}.content{content.path}", content.reason)
        messages.append({"role": "system" if role == "developer" else role, "content": content})
    return messages


_MISSING_CONTENT = object()


def _content_text(v: Any) -> str | Problem:
    if v is _MISSING_CONTENT:
        return Problem("", MISSING)
    if isinstance(v, str):
        try:
            return _utf8_encodable(v)
        except ValueError as e:
            return Problem("", str(e))
    if not isinstance(v, list):
        return Problem("", f"must be a string or a list of input_text parts, got {_short(v)}")
    texts = []
    for j, part in enumerate(v):
        if not isinstance(part, dict):
            return Problem(f".{j}", f"must be an object, got {json_type(part)}")
        kind = part.get("type")
        if kind not in _TEXT_PARTS:
            # An image or a file silently dropped would give a confident, wrong answer.
            return Problem(f".{j}.type", f"only input_text parts are supported, got {_short(kind)}")
        text = part.get("text")
        if not isinstance(text, str):
            return Problem(f".{j}.text", f"must be a string, got {_short(text)}")
        try:
            texts.append(_utf8_encodable(text))
        except ValueError as e:
            return Problem(f".{j}.text", str(e))
    return "\n".join(texts)


def text_format(v: Any) -> str | None | Problem:
    """A Responses ``text`` as the engine's canonical response format (None: plain text), or (the
    path below ``text``, the reason). ``json_schema`` keeps ``name``, ``schema`` and ``strict`` in
    ``format`` itself (chat's ``response_format`` nests them under ``json_schema``)."""
    if v is None:
        return None
    if not isinstance(v, dict):
        return Problem("", f"must be an object, got {json_type(v)}")
    verbosity = v.get("verbosity")
    if verbosity not in (None, "medium"):  # the default; the model has no such setting to turn
        return Problem(".verbosity", f"verbosity is not supported (only 'medium'), got {_short(verbosity)}")
    fmt = v.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        return Problem(".format", f"must be an object, got {json_type(fmt)}")
    if fmt.get("type") != "json_schema":
        got = parse_response_format(fmt)
        return Problem(".format" + got[0], got[1]) if isinstance(got, tuple) else got
    if "schema" not in fmt:
        return Problem(".format.schema", MISSING)
    name = fmt.get("name")
    if name is not None and not isinstance(name, str):
        return Problem(".format.name", f"must be a string, got {json_type(name)}")
    got = parse_response_format({"type": "json_schema",
                                 "json_schema": {"schema": fmt["schema"], "strict": fmt.get("strict")}})
    if isinstance(got, tuple):
        return Problem(".format" + got[0].removeprefix(".json_schema"), got[1])
    return got


def completion_prompt(v: Any) -> str | tuple[int, ...] | Problem:
    """A Completions ``prompt`` as one raw text or one list of token ids, or (the path below
    ``prompt``, the reason)."""
    if isinstance(v, str):
        try:
            return _utf8_encodable(v)
        except ValueError as e:
            return Problem("", str(e))
    if not isinstance(v, list) or not v:
        return Problem("", f"must be a string, an array of token ids or a one-element array of either, got {_short(v)}")
    if all(type(t) is int for t in v):
        return _token_ids(v, "")
    if len(v) > 1:
        return Problem("", (f"an array of {len(v)} prompts is not supported: one row is one completion "
                    "(send one row per prompt)"))
    one = v[0]
    if isinstance(one, str):
        return completion_prompt(one)
    if isinstance(one, list) and one and all(type(t) is int for t in one):
        return _token_ids(one, ".0")
    return Problem(".0", f"must be a string or a non-empty array of token ids, got {_short(one)}")


def _token_ids(ids: list[int], path: str) -> tuple[int, ...] | Problem:
    for i, t in enumerate(ids):
        if not 0 <= t <= INT32_MAX:
            return Problem(f"{path}.{i}", f"a token id must be between 0 and {INT32_MAX}, got {t}")
    return tuple(ids)


# --------------------------------------------------------------------------------------------
# A row


@dataclass(frozen=True)
class EndpointRow:
    """A valid row's request, in the fields :class:`~kvbatch.io.batch_requests.ChatRequest` has
    (which the chat reader builds from it: this module sits below it). ``sampling``: the keyword
    arguments of its ``SamplingParams``."""

    messages: list[dict[str, str]]
    prompt: str | tuple[int, ...] | None
    sampling: dict[str, Any]
    model: str | None
    unknown_fields: tuple[str, ...]
    n: int = 1  # choices asked for (a completions row's ``n``; a Responses row has one)
    # A completions row's ``echo``: its answer's text starts with the prompt's. Not a sampling
    # field: the engine's answer (and the response cache's key) is the same with or without it.
    echo: bool = False


def read_endpoint_row(obj: dict[str, Any], *, default_max_tokens: int, strict: bool) -> EndpointRow | Problem:
    """One ``/v1/responses`` or ``/v1/completions`` batch row (``obj["url"]`` says which; its
    ``custom_id`` is already checked) as a request, or the row's problem: the first field named,
    every reason given. ``default_max_tokens`` is the reader's default for a Responses row without
    ``max_output_tokens``; a Completions row defaults to OpenAI's 16."""
    url = obj["url"]
    problems: list[tuple[str, str]] = []  # (dotted field, reason)
    raw = obj.get("body")
    try:
        envelope: Any = _ENVELOPES[url].model_validate(obj)
    except ValidationError as e:
        envelope = None
        problems += [(_error_field(err), _error_reason(err)) for err in e.errors(include_url=False)]
    if isinstance(raw, dict):
        readers = ({"input": input_messages, "text": text_format} if url == RESPONSES_URL
                   else {"prompt": completion_prompt})
        read = {name: reader(raw[name]) for name, reader in readers.items() if name in raw}
        problems += [(f"body.{name}{got.path}", got.reason) for name, got in read.items() if isinstance(got, Problem)]
        if url == RESPONSES_URL and any(raw.get(k) is not None for k in TOOL_FIELDS):
            tools = parse_responses_tools(raw)
            if isinstance(tools, tuple):
                problems.append((f"body.{tools[0]}", tools[1]))
            elif tools is not None and isinstance(read.get("text"), str):
                problems.append(("body.tools", ("cannot be combined with a text.format other than text: the "
                                                "answer is either tool calls or the format")))
            elif tools is not None:
                read["tools"] = tools
        problems += [(f"body.{name}", f"{why}, got {_short(value)}") for name, value in raw.items()
                     if name in _REFUSED[url] and not _neutral(value, _REFUSED[url][name][1])
                     for why in (_REFUSED[url][name][0],)]
        if url == COMPLETIONS_URL and raw.get("echo") is True and raw.get("logprobs") is not None:
            problems.append(("body.echo", ECHO_WITH_LOGPROBS))
    # A part read by hand may repeat the schema's own complaint about it (``input`` missing).
    problems = list(dict.fromkeys(problems))
    if problems:
        reason = problems[0][1] + "".join(f"; {f}: {why}" for f, why in problems[1:])
        return Problem(problems[0][0], reason)
    body = envelope.body
    known = _KNOWN[url]
    unknown = (*(k for k in obj if k not in _ENVELOPE_FIELDS), *(f"body.{k}" for k in raw if k not in known))
    if unknown and strict:
        return Problem(unknown[0], "unknown field (strict mode rejects fields it would ignore)")
    temperature = 1.0 if body.temperature is None else float(body.temperature)
    top_p = 1.0 if body.top_p is None else float(body.top_p)
    if url == RESPONSES_URL:
        messages = read["input"]
        if body.instructions is not None:
            messages = [{"role": "system", "content": body.instructions}, *messages]
        return EndpointRow(messages, None, {"max_tokens": body.max_output_tokens or default_max_tokens,
                                            "temperature": temperature, "top_p": top_p,
                                            "response_format": read.get("tools", read.get("text"))},
                           body.model, unknown)
    return EndpointRow([], read["prompt"], {"max_tokens": body.max_tokens or COMPLETIONS_DEFAULT_MAX_TOKENS,
                                            "temperature": temperature, "top_p": top_p, "seed": body.seed,
                                            "stop": tuple(body.stop or ()), "logprobs": body.logprobs,
                                            "logit_bias": tuple(sorted((body.logit_bias or {}).items())),
                                            "presence_penalty": float(body.presence_penalty or 0.0),
                                            "frequency_penalty": float(body.frequency_penalty or 0.0)},
                       body.model, unknown, n=body.n or 1, echo=bool(body.echo))
