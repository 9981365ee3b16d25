"""The API's objects and request bodies, as OpenAI documents them (pydantic: this is the edge).

A File: ``id, object="file", bytes, created_at, filename, purpose, status, expires_at,
status_details``. A Batch: ``id, object="batch", endpoint, errors, input_file_id,
completion_window, status, output_file_id, error_file_id, created_at, in_progress_at,
expires_at, finalizing_at, completed_at, failed_at, expired_at, cancelling_at, cancelled_at,
request_counts {total, completed, failed}, metadata, model, usage``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from kvbatch.io.batch_requests import BATCH_URLS

BATCH_STATUSES = ("validating", "failed", "in_progress", "finalizing", "completed", "expired",
                  "cancelling", "cancelled")
TERMINAL = frozenset({"failed", "completed", "expired", "cancelled"})
# The endpoints a batch may name: its rows' ``url``, and the shape of its output's response bodies.
ENDPOINTS = BATCH_URLS
COMPLETION_WINDOW = "24h"
WINDOW_S = 24 * 3600


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
    usage: dict[str, Any] | None = None


class CreateBatch(BaseModel):
    """``POST /v1/batches``: what OpenAI accepts; anything else is a 400 naming the field."""

    model_config = ConfigDict(extra="forbid", strict=True)
    input_file_id: str = Field(min_length=1)
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None

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
        # OpenAI's limits: 16 pairs, keys up to 64 characters, values up to 512.
        if v is not None:
            if len(v) > 16:
                raise ValueError(f"at most 16 pairs, got {len(v)}")
            for k, val in v.items():
                if len(k) > 64 or len(val) > 512:
                    raise ValueError(f"key {k[:64]!r}: keys are at most 64 characters, values at most 512")
        return v
