"""The prompts table: one validated request per row, as ingest writes it and every later step
reads it back (shards add token ids and block keys to the same columns), and the rejects table
beside it. ``request_record`` and ``record_request`` convert between a row and a
:class:`~kvbatch.io.batch_requests.ChatRequest` and are inverse to each other.

``response_format`` (structured outputs) is the canonical JSON string of a row's constrained
format (:func:`~kvbatch.io.batch_requests.parse_response_format`: sorted keys, no spaces, so one
schema is one string), null for a free-text row. It is a plain string column, not a schema id and
a side table: Parquet dictionary-encodes it, so a column chunk stores each distinct format once
(ten million rows sharing three schemas store three strings per row group, and an index per row),
a null costs a bit, and every reader (prefill, decode, the CLI) gets the format from the row
itself, with nothing to join.

``logit_bias`` holds a row's (token id, bias) pairs, ``presence_penalty`` and ``frequency_penalty``
its penalties; null is the neutral value (no bias, 0), so a table of rows without them is what it
was before the columns existed.

``endpoint`` is the OpenAI API a row was written for (null: ``/v1/chat/completions``, so a table of
chat rows is what it was before the column existed), which decides the answer's shape. A
``/v1/completions`` row has no messages: its raw prompt is ``prompt`` (text) or ``prompt_ids``
(token ids), which the shard step tokenizes without the chat template
(:func:`~kvbatch.ops.jobs.prompt_ids`). A completions row's ``echo`` has no column: it changes only
the OpenAI output line, and the pipeline's results table holds the answer as generated (its ``text``
never starts with the prompt, which is in this table), so a row read back has ``echo`` false.

Tool calling (docs/tools.md): a row's tools spec is its ``response_format`` (the same column, a
string starting ``{"type":"tools"``), and a message's tool-call history is in two fields of the
message struct, null on every other message: ``tool_calls`` (an assistant turn's calls as the JSON
text of what the template gets: each ``{"id", "type", "function": {"name", "arguments"}}``, the
arguments the parsed object, key order kept) and ``tool_call_id`` (a ``tool`` message's). Two string
fields, not a nested list: a conversation without tool calls costs each a null per message, which
Parquet stores as a run of definition levels. A table written before the fields existed reads as
having none.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import pyarrow as pa

from kvbatch.io.batch_requests import CHAT_COMPLETIONS_URL, ChatRequest, RejectedRow, SamplingParams

# A text-only conversation's messages (what the columnar request reader builds; casting it to
# PROMPT_MESSAGES_TYPE gives the tool fields as nulls).
MESSAGES_TYPE = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
PROMPT_MESSAGES_TYPE = pa.list_(pa.struct([*MESSAGES_TYPE.value_type, ("tool_calls", pa.string()),
                                           ("tool_call_id", pa.string())]))
LOGIT_BIAS_TYPE = pa.list_(pa.struct([("token", pa.int64()), ("bias", pa.float64())]))


PROMPTS_SCHEMA = pa.schema([
    ("row", pa.int64()),  # 1-based line (JSONL) or row (Parquet) of the input
    ("custom_id", pa.string()),
    ("messages", PROMPT_MESSAGES_TYPE),
    ("model", pa.string()),
    ("max_tokens", pa.int64()),
    ("temperature", pa.float64()),
    ("top_p", pa.float64()),
    ("top_k", pa.int64()),
    ("min_p", pa.float64()),
    ("seed", pa.int64()),
    ("stop", pa.list_(pa.string())),
    ("stop_token_ids", pa.list_(pa.int64())),
    ("logprobs", pa.int64()),
    ("ignore_eos", pa.bool_()),
    ("response_format", pa.string()),  # canonical JSON of json_schema / json_object; null: free text
    ("logit_bias", LOGIT_BIAS_TYPE),  # (token id, bias) pairs sorted by id; null: no bias
    ("presence_penalty", pa.float64()),  # null: 0
    ("frequency_penalty", pa.float64()),  # null: 0
    ("endpoint", pa.string()),  # /v1/responses or /v1/completions; null: /v1/chat/completions
    ("prompt", pa.string()),  # a /v1/completions row's raw text prompt
    ("prompt_ids", pa.list_(pa.int64())),  # a /v1/completions row's prompt given as token ids
    ("n", pa.int64()),  # choices asked for, as the columnar reader writes it too; null: 1
])
# The request's columns that are not sampling parameters.
_REQUEST_FIELDS = ("row", "custom_id", "messages", "model", "endpoint", "prompt", "prompt_ids")


REJECTS_SCHEMA = pa.schema([
    ("row", pa.int64()),
    ("custom_id", pa.string()),
    ("field", pa.string()),
    ("reason", pa.string()),
])


SAMPLING_FIELDS = [f.name for f in PROMPTS_SCHEMA if f.name not in _REQUEST_FIELDS]


def request_record(req: ChatRequest) -> dict[str, Any]:
    s = req.sampling
    messages = [_message_record(m) for m in req.messages]  # the columns' dicts: what a read of the table gives
    return {"row": req.line_no, "custom_id": req.custom_id, "messages": messages, "model": req.model,
            "max_tokens": s.max_tokens, "temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k,
            "min_p": s.min_p, "seed": s.seed, "stop": list(s.stop), "stop_token_ids": list(s.stop_token_ids),
            "logprobs": s.logprobs, "ignore_eos": s.ignore_eos, "response_format": s.response_format,
            "logit_bias": [{"token": t, "bias": b} for t, b in s.logit_bias] or None,
            "presence_penalty": s.presence_penalty or None, "frequency_penalty": s.frequency_penalty or None,
            "endpoint": None if req.endpoint == CHAT_COMPLETIONS_URL else req.endpoint,
            "prompt": req.prompt if isinstance(req.prompt, str) else None,
            "prompt_ids": list(req.prompt) if isinstance(req.prompt, tuple) else None,
            "n": req.n}


def record_request(rec: Mapping[str, Any]) -> ChatRequest:
    """The inverse of :func:`request_record` (rows read back from the prompts table)."""
    sampling = SamplingParams(
        max_tokens=rec["max_tokens"], temperature=rec["temperature"], top_p=rec["top_p"], top_k=rec["top_k"],
        min_p=rec["min_p"], seed=rec["seed"], stop=tuple(rec["stop"] or ()),
        stop_token_ids=tuple(rec["stop_token_ids"] or ()), logprobs=rec["logprobs"],
        ignore_eos=bool(rec["ignore_eos"]), response_format=rec.get("response_format"),
        logit_bias=tuple((p["token"], p["bias"]) for p in rec.get("logit_bias") or ()),
        presence_penalty=rec.get("presence_penalty") or 0.0, frequency_penalty=rec.get("frequency_penalty") or 0.0)
    messages = record_messages(rec["messages"])
    prompt = rec.get("prompt")
    if prompt is None and rec.get("prompt_ids") is not None:
        prompt = tuple(rec["prompt_ids"])
    return ChatRequest(rec["row"], rec["custom_id"], messages, sampling, rec["model"],
                       endpoint=rec.get("endpoint") or CHAT_COMPLETIONS_URL, prompt=prompt, n=rec.get("n") or 1)


def _message_record(m: Mapping[str, Any]) -> dict[str, Any]:
    """A message as a PROMPT_MESSAGES_TYPE struct (the tool fields null unless set)."""
    calls = m.get("tool_calls")
    return {"role": m["role"], "content": m["content"], "tool_call_id": m.get("tool_call_id"),
            "tool_calls": None if calls is None else json.dumps(calls, ensure_ascii=False)}


def record_messages(messages: list[Mapping[str, Any]] | None) -> list[dict[str, Any]]:
    """A row's messages as the chat template gets them (:func:`~kvbatch.io.tools.history_message`'s
    dicts: the tool fields only where set, each call's ``arguments`` the parsed object)."""
    out = []
    for m in messages or ():
        message = {"role": m["role"], "content": m["content"]}
        if m.get("tool_calls") is not None:
            message["tool_calls"] = json.loads(m["tool_calls"])
        if m.get("tool_call_id") is not None:
            message["tool_call_id"] = m["tool_call_id"]
        out.append(message)
    return out


def outcome_record(item: ChatRequest | RejectedRow) -> dict[str, Any]:
    """The prompts-or-rejects row of one parsed item."""
    return reject_record(item) if isinstance(item, RejectedRow) else request_record(item)


def reject_record(r: RejectedRow) -> dict[str, Any]:
    return {"row": r.line_no, "custom_id": r.custom_id, "field": r.field, "reason": r.reason}

