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
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pyarrow as pa

from kvbatch.io.batch_requests import ChatRequest, RejectedRow, SamplingParams

MESSAGES_TYPE = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))


PROMPTS_SCHEMA = pa.schema([
    ("row", pa.int64()),  # 1-based line (JSONL) or row (Parquet) of the input
    ("custom_id", pa.string()),
    ("messages", MESSAGES_TYPE),
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
])


REJECTS_SCHEMA = pa.schema([
    ("row", pa.int64()),
    ("custom_id", pa.string()),
    ("field", pa.string()),
    ("reason", pa.string()),
])


SAMPLING_FIELDS = [f.name for f in PROMPTS_SCHEMA if f.name not in ("row", "custom_id", "messages", "model")]


def request_record(req: ChatRequest) -> dict[str, Any]:
    s = req.sampling
    return {"row": req.line_no, "custom_id": req.custom_id, "messages": req.messages, "model": req.model,
            "max_tokens": s.max_tokens, "temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k,
            "min_p": s.min_p, "seed": s.seed, "stop": list(s.stop), "stop_token_ids": list(s.stop_token_ids),
            "logprobs": s.logprobs, "ignore_eos": s.ignore_eos, "response_format": s.response_format}


def record_request(rec: Mapping[str, Any]) -> ChatRequest:
    """The inverse of :func:`request_record` (rows read back from the prompts table)."""
    sampling = SamplingParams(
        max_tokens=rec["max_tokens"], temperature=rec["temperature"], top_p=rec["top_p"], top_k=rec["top_k"],
        min_p=rec["min_p"], seed=rec["seed"], stop=tuple(rec["stop"] or ()),
        stop_token_ids=tuple(rec["stop_token_ids"] or ()), logprobs=rec["logprobs"],
        ignore_eos=bool(rec["ignore_eos"]), response_format=rec.get("response_format"))
    messages = [{"role": m["role"], "content": m["content"]} for m in rec["messages"]]
    return ChatRequest(rec["row"], rec["custom_id"], messages, sampling, rec["model"])


def outcome_record(item: ChatRequest | RejectedRow) -> dict[str, Any]:
    """The prompts-or-rejects row of one parsed item."""
    return reject_record(item) if isinstance(item, RejectedRow) else request_record(item)


def reject_record(r: RejectedRow) -> dict[str, Any]:
    return {"row": r.line_no, "custom_id": r.custom_id, "field": r.field, "reason": r.reason}

