"""Ingest: read a prompt dataset, validate every row, write normalized rows and a rejects table.

Plain Python (no Dagster); the pipeline's ``prompts`` asset calls :func:`ingest`.

Inputs: JSONL in OpenAI Batch or plain chat format (validated by
:mod:`kvbatch.io.batch_requests`, one item per line: a blank line is a reject, as in
``kvbatch generate``, so row numbers are line numbers; unknown fields are ignored with one
warning per field name, logged by that reader), or Parquet with a column
mapping (each row is turned into a plain chat object and goes through the same validation, so
both formats accept and reject exactly the same things). Every input row ends up in exactly one
of the two outputs: ``prompts`` (valid) or ``rejects`` (row, custom_id, field, reason).

Streaming: a dataset can be many GB, so nothing holds it whole. Rows are read one line (JSONL)
or one record batch (Parquet) at a time, and both outputs are written as they come, one
Parquet row group per ``batch_rows`` rows, into a file that becomes visible only on commit
(:class:`TableStream`). Memory is bounded by one batch of each output plus the set of
``custom_id`` values seen (the duplicate check needs it). The output is the same file a
one-shot ``pa.Table.from_pylist`` of every row would give, row for row.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from kvbatch.io.batch_output import AtomicSink
from kvbatch.io.batch_requests import (
    ChatRequest,
    RejectedRow,
    parse_request_line,
    read_requests,
)
from kvbatch.io.prompt_table import (
    PROMPTS_SCHEMA,
    REJECTS_SCHEMA,
    reject_record,
    request_record,
)

# Plain chat fields a Parquet column can be mapped to (target name -> what the validator reads).
PARQUET_TARGETS = ("custom_id", "messages", "model", "max_tokens", "max_completion_tokens", "temperature", "top_p",
                   "top_k", "min_p", "seed", "stop", "stop_token_ids", "logprobs", "top_logprobs", "ignore_eos")


@dataclass
class IngestReport:
    rows: int = 0
    valid: int = 0
    rejected: int = 0
    rejects_by_field: dict[str, int] = field(default_factory=dict)
    prompts_bytes: int = 0
    rejects_bytes: int = 0

    @property
    def reject_rate(self) -> float:
        return self.rejected / self.rows if self.rows else 0.0

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "reject_rate": round(self.reject_rate, 6)}


def detect_format(url: str) -> str:
    path = url.split("?", 1)[0].lower()
    if path.endswith((".parquet", ".pq")):
        return "parquet"
    return "jsonl"


def read_parquet_requests(
    url: str,
    *,
    columns: Mapping[str, str] | None = None,
    default_max_tokens: int = 256,
    storage_options: Mapping[str, Any] | None = None,
) -> Iterator[ChatRequest | RejectedRow]:
    """Rows of a Parquet file as requests. ``columns`` maps a plain chat field (``custom_id``,
    ``messages``, ``max_tokens``...) to the file's column name; unmapped fields use their own
    name when the file has such a column. A ``prompt`` target takes a plain string column and
    makes it a single user message."""
    mapping = dict(columns or {})
    unknown = sorted(set(mapping) - set(PARQUET_TARGETS) - {"prompt"})
    if unknown:
        raise ValueError(f"column mapping has unknown target field(s) {unknown}; "
                         f"known: {', '.join(PARQUET_TARGETS + ('prompt',))}")
    with fsspec.open(url, "rb", **dict(storage_options or {})) as f:
        pf = pq.ParquetFile(f)
        names = set(pf.schema_arrow.names)
        missing = sorted(c for c in mapping.values() if c not in names)
        if missing:
            raise ValueError(f"{url}: column(s) {missing} named in the column mapping are not in the file "
                             f"(it has {sorted(names)})")
        source = {t: mapping.get(t, t) for t in (*PARQUET_TARGETS, "prompt") if mapping.get(t, t) in names}
        if "custom_id" not in source:
            raise ValueError(f"{url}: no custom_id column; map one with columns={{'custom_id': '<column>'}}")
        seen: dict[str, int] = {}
        row_no = 0
        for batch in pf.iter_batches(batch_size=4096, columns=sorted(set(source.values()))):
            for rec in batch.to_pylist():
                row_no += 1
                obj = {t: rec[c] for t, c in source.items() if rec[c] is not None}
                if "prompt" in obj:
                    prompt = obj.pop("prompt")
                    obj.setdefault("messages", [{"role": "user", "content": prompt}])
                try:
                    line = json.dumps(obj, ensure_ascii=False, allow_nan=True).encode("utf-8", "surrogatepass")
                except (TypeError, ValueError) as exc:
                    item: ChatRequest | RejectedRow = RejectedRow(row_no, None, "$", f"unreadable row: {exc}")
                else:
                    item = parse_request_line(line, row_no, default_max_tokens=default_max_tokens)
                cid = item.custom_id
                if cid is not None:
                    first = seen.setdefault(cid, row_no)
                    if first != row_no:
                        item = RejectedRow(row_no, cid, "custom_id", f"duplicate of row {first}")
                yield item


def read_dataset(
    url: str,
    *,
    fmt: str = "auto",
    columns: Mapping[str, str] | None = None,
    default_max_tokens: int = 256,
    storage_options: Mapping[str, Any] | None = None,
) -> Iterator[ChatRequest | RejectedRow]:
    """One item per input row, in input order, whatever the format."""
    kind = detect_format(url) if fmt == "auto" else fmt
    if kind == "jsonl":
        if columns:
            raise ValueError("a column mapping applies to Parquet input only")
        return read_requests(url, default_max_tokens=default_max_tokens, storage_options=storage_options)
    if kind == "parquet":
        return read_parquet_requests(url, columns=columns, default_max_tokens=default_max_tokens,
                                     storage_options=storage_options)
    raise ValueError(f"unknown dataset format {fmt!r} (use auto, jsonl or parquet)")


class _CountingSink:
    """The file-like face pyarrow's writer needs (write, tell, flush, closed) over an AtomicSink."""

    def __init__(self, sink: AtomicSink) -> None:
        self._sink = sink
        self.bytes_written = 0
        self.closed = False

    def write(self, data: bytes) -> int:
        self._sink.write(bytes(data))
        self.bytes_written += len(data)
        return len(data)

    def tell(self) -> int:
        return self.bytes_written

    def flush(self) -> None:
        pass

    def close(self) -> None:  # the writer closes its stream; the sink is committed separately
        self.closed = True


class TableStream:
    """Rows in, one Parquet file out, written a row group at a time and visible at ``url`` only
    on :meth:`commit` (an exception before that leaves the previous commit, as ``write_table``)."""

    def __init__(self, url: str, schema: pa.Schema, *, storage_options: Mapping[str, Any] | None = None,
                 batch_rows: int = 8192) -> None:
        self.schema = schema
        self.batch_rows = batch_rows
        self.rows = 0
        self._pending: list[dict[str, Any]] = []
        self._sink = AtomicSink(url, storage_options)
        self._file = _CountingSink(self._sink)
        self._writer = pq.ParquetWriter(self._file, schema, compression="zstd")

    def add(self, record: dict[str, Any]) -> None:
        self._pending.append(record)
        if len(self._pending) >= self.batch_rows:
            self._flush()

    def _flush(self) -> None:
        if self._pending:
            self._writer.write_table(pa.Table.from_pylist(self._pending, self.schema))
            self.rows += len(self._pending)
            self._pending = []

    def commit(self) -> int:
        """Write what is left, close the file and publish it; returns the bytes written."""
        self._flush()
        self._writer.close()
        self._sink.commit()
        return self._file.bytes_written

    def abort(self) -> None:
        try:
            self._writer.close()
        except Exception:  # noqa: BLE001 - the error in flight matters more
            pass
        self._sink.abort()


def ingest(
    url: str,
    prompts_url: str,
    rejects_url: str,
    *,
    fmt: str = "auto",
    columns: Mapping[str, str] | None = None,
    default_max_tokens: int = 256,
    storage_options: Mapping[str, Any] | None = None,
    output_storage_options: Mapping[str, Any] | None = None,
    batch_rows: int = 8192,
) -> IngestReport:
    """Validate every row of ``url``; stream the valid rows to ``prompts_url`` and the others to
    ``rejects_url`` (both Parquet, ``batch_rows`` rows per row group, each committed atomically;
    an error while reading, such as :class:`~kvbatch.io.batch_requests.InputStreamError` for a
    truncated ``.gz``, commits neither: a shard built from part of a file would pass for all of it)."""
    report = IngestReport()
    out_opts = output_storage_options if output_storage_options is not None else storage_options
    good = TableStream(prompts_url, PROMPTS_SCHEMA, storage_options=out_opts, batch_rows=batch_rows)
    bad = TableStream(rejects_url, REJECTS_SCHEMA, storage_options=out_opts, batch_rows=batch_rows)
    try:
        for item in read_dataset(url, fmt=fmt, columns=columns, default_max_tokens=default_max_tokens,
                                 storage_options=storage_options):
            report.rows += 1
            if isinstance(item, RejectedRow):
                report.rejected += 1
                report.rejects_by_field[item.field] = report.rejects_by_field.get(item.field, 0) + 1
                bad.add(reject_record(item))
            else:
                report.valid += 1
                good.add(request_record(item))
    except BaseException:
        good.abort()
        bad.abort()
        raise
    report.prompts_bytes = good.commit()
    report.rejects_bytes = bad.commit()
    return report
