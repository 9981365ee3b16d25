"""The API's objects and request bodies, as OpenAI documents them (pydantic: this is the edge).

A File: ``id, object="file", bytes, created_at, filename, purpose, status, expires_at,
status_details``. A Batch: ``id, object="batch", endpoint, errors, input_file_id,
completion_window, status, output_file_id, error_file_id, created_at, in_progress_at,
expires_at, finalizing_at, completed_at, failed_at, expired_at, cancelling_at, cancelled_at,
request_counts {total, completed, failed}, metadata, model, usage {input_tokens,
input_tokens_details {cached_tokens}, output_tokens, output_tokens_details {reasoning_tokens},
total_tokens}``. ``POST /v1/batches`` takes ``input_file_id, endpoint, completion_window,
metadata, output_expires_after {anchor, seconds}``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from kvbatch.io.batch_requests import BATCH_URLS

BATCH_STATUSES = ("validating", "failed", "in_progress", "finalizing", "completed", "expired",
                  "cancelling", "cancelled")
TERMINAL = frozenset({"failed", "completed", "expired", "cancelled"})
# The endpoints a batch may name: its rows' ``url``, and the shape of its output's response bodies.
ENDPOINTS = BATCH_URLS
COMPLETION_WINDOW = "24h"
WINDOW_S = 24 * 3600
# OpenAI's limits on ``metadata`` and on ``output_expires_after.seconds`` (1 hour to 30 days).
METADATA_PAIRS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512
OUTPUT_EXPIRES_MIN_S, OUTPUT_EXPIRES_MAX_S = 3600, 30 * 24 * 3600


class FileObject(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: Literal["uploaded", "processed", "error"] = "processed"
    expires_at: int | None = None
    status_details: str | None = None


class RequestCounts(BaseModel):
    total: int = 0
    completed: int = 0
    failed: int = 0


class BatchErrorItem(BaseModel):
    code: str
    message: str
    line: int | None = None
    param: str | None = None


class BatchErrors(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchErrorItem] = Field(default_factory=list)


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0  # kvbatch's models answer without a hidden reasoning phase


class BatchUsage(BaseModel):
    """Tokens summed over the batch's answered rows (its output file), as each row's usage counts them."""

    input_tokens: int = 0
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int = 0
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int = 0


class BatchObject(BaseModel):
    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    errors: BatchErrors | None = None
    input_file_id: str
    completion_window: str
    status: Literal["validating", "failed", "in_progress", "finalizing", "completed", "expired",
                    "cancelling", "cancelled"]
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts = Field(default_factory=RequestCounts)
    metadata: dict[str, str] | None = None
    model: str | None = None
    usage: BatchUsage | None = None


class OutputExpiresAfter(BaseModel):
    """When a batch's output and error files expire: ``seconds`` after each file's own
    ``created_at`` (OpenAI's only anchor; the file's creation, not the batch's)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    anchor: Literal["created_at"]
    seconds: int

    @field_validator("seconds")
    @classmethod
    def _seconds(cls, v: int) -> int:
        if not OUTPUT_EXPIRES_MIN_S <= v <= OUTPUT_EXPIRES_MAX_S:
            raise ValueError(f"must be between {OUTPUT_EXPIRES_MIN_S} (1 hour) and {OUTPUT_EXPIRES_MAX_S} "
                             f"(30 days), got {v}")
        return v


class CreateBatch(BaseModel):
    """``POST /v1/batches``: what OpenAI accepts; anything else is a 400 naming the field."""

    model_config = ConfigDict(extra="forbid", strict=True)
    input_file_id: str = Field(min_length=1)
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None
    output_expires_after: OutputExpiresAfter | None = None

    @field_validator("endpoint")
    @classmethod
    def _endpoint(cls, v: str) -> str:
        if v not in ENDPOINTS:
            raise ValueError(f"must be one of {', '.join(ENDPOINTS)}, got {v!r}")
        return v

    @field_validator("completion_window")
    @classmethod
    def _window(cls, v: str) -> str:
        if v != COMPLETION_WINDOW:
            raise ValueError(f"only {COMPLETION_WINDOW!r} is supported, got {v!r}")
        return v

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        if v is None:
            return v
        if len(v) > METADATA_PAIRS:
            raise ValueError(f"at most {METADATA_PAIRS} pairs, got {len(v)}")
        for k, val in v.items():
            if len(k) > METADATA_KEY_CHARS:
                raise ValueError(f"key {k[:METADATA_KEY_CHARS]!r}... is {len(k)} characters; keys are at most "
                                 f"{METADATA_KEY_CHARS}")
            if len(val) > METADATA_VALUE_CHARS:
                raise ValueError(f"the value of key {k!r} is {len(val)} characters; values are at most "
                                 f"{METADATA_VALUE_CHARS}")
        return v
