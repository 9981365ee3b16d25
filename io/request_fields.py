"""The field-level rules every request dialect shares (:mod:`kvbatch.io.batch_requests` for chat rows,
:mod:`kvbatch.io.endpoints` for ``/v1/responses`` and ``/v1/completions`` rows): the batch URLs and
integer bounds, strict UTF-8 text, JSON type names and short quotes of a bad value for reasons a JSON
author understands, a pydantic error as (dotted field, reason), the neutral value of a refused field,
``response_format`` as the engine's canonical string, and ``logit_bias`` with integer keys (chat and
completions rows take it alike). No request type lives here: both readers
build on it, so neither has to import the other.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any

from pydantic import AfterValidator, ConfigDict, Field

CHAT_COMPLETIONS_URL = "/v1/chat/completions"
RESPONSES_URL = "/v1/responses"
COMPLETIONS_URL = "/v1/completions"
BATCH_URLS = (CHAT_COMPLETIONS_URL, RESPONSES_URL, COMPLETIONS_URL)  # a batch row's ``url``
MAX_STOP_SEQUENCES = 4  # OpenAI's limit
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
INT32_MAX = 2**31 - 1
WHOLE_LINE = "$"
MISSING = "required field is missing"


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


def _neutral(value: Any, neutral: tuple[Any, ...]) -> bool:
    # bool is an int to Python: ``presence_penalty: false`` is not 0 to a JSON author.
    return value is None or any(type(value) is type(n) and value == n for n in neutral) or (
        isinstance(value, float) and any(type(n) is int and value == n for n in neutral))


def parse_response_format(v: Any) -> str | None | tuple[str, str]:
    """``response_format`` as the engine's canonical string (None: plain text), or (the field
    path below ``response_format``, the reason) when it is malformed. ``json_schema`` needs a
    ``json_schema`` object whose ``schema`` is an object (``strict`` a boolean, default false);
    whether the schema compiles is checked where the grammar engine is (ops.jobs)."""
    if not isinstance(v, dict):
        return "", f"must be an object, got {json_type(v)}"
    kind = v.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return json.dumps({"type": "json_object"}, separators=(",", ":"))
    if kind != "json_schema":
        return ".type", f"must be one of 'text', 'json_object', 'json_schema', got {_short(kind)}"
    spec = v.get("json_schema")
    if not isinstance(spec, dict):
        return ".json_schema", f"must be an object with a schema, got {json_type(spec)}"
    schema, strict = spec.get("schema", {}), spec.get("strict", False)
    if not isinstance(schema, dict):
        return ".json_schema.schema", f"must be an object, got {json_type(schema)}"
    if strict is None:
        strict = False
    if not isinstance(strict, bool):
        return ".json_schema.strict", f"must be a boolean, got {json_type(strict)}"
    try:
        return json.dumps({"schema": schema, "strict": strict, "type": "json_schema"}, sort_keys=True,
                          separators=(",", ":"), ensure_ascii=False)
    except ValueError as e:  # NaN cannot reach here (json.loads made it), but keep the row's error a row's
        return ".json_schema.schema", str(e)


def _error_field(err: Any) -> str:
    return ".".join(str(p) for p in err["loc"]) or WHOLE_LINE


def _error_reason(err: Any) -> str:
    msg = _CLASS_NAME.sub("", err["msg"])
    if err["type"] == "value_error":  # our own validators: the message already says it all
        return msg.removeprefix("Value error, ")
    if err["type"] == "missing":
        return MISSING
    return f"{msg}, got {_short(err.get('input'))}"


_CLASS_NAME = re.compile(r" or instance of _\w+")


def json_type(v: Any) -> str:
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


MAX_LOGIT_BIAS = 300  # OpenAI's limit on logit_bias entries
_TOKEN_ID_KEY = re.compile(r"[0-9]{1,10}")


def logit_bias_ids(v: Any) -> dict[int, float]:
    """``logit_bias`` (an object of token-id strings to numbers in [-100, 100], at most 300) with
    integer keys; ValueError naming the first bad key or value (ranges against the vocabulary are
    the tokenizer's: ops.jobs)."""
    if not isinstance(v, dict):
        raise ValueError(f"must be an object of token ids to biases, got {json_type(v)}")
    if len(v) > MAX_LOGIT_BIAS:
        raise ValueError(f"has {len(v)} entries, at most {MAX_LOGIT_BIAS}")
    out: dict[int, float] = {}
    for key, bias in v.items():
        if not (isinstance(key, str) and _TOKEN_ID_KEY.fullmatch(key)) or int(key) > INT32_MAX:
            raise ValueError(f"key {_short(key)} is not a token id (a string of an integer from 0 to {INT32_MAX})")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise ValueError(f"the bias of token {key} must be a number in [-100, 100], got {_short(bias)}")
        if int(key) in out:
            raise ValueError(f"token {int(key)} is given twice")
        out[int(key)] = float(bias)
    return out
