"""Ingest: read a prompt dataset, validate every row, write normalized rows and a rejects table.

Plain Python (no Dagster); the pipeline's ``prompts`` asset calls :func:`ingest`.

Inputs: JSONL in OpenAI Batch or plain chat format (validated by
:mod:`kvbatch.io.batch_requests`, one item per line: a blank line is a reject, as in
``kvbatch generate``, so row numbers are line numbers; unknown fields are ignored with one
warning per field name, logged by that reader), or Parquet with a column
mapping (each row is turned into a plain chat object and goes through the same validation, so
both formats accept and reject exactly the same things). Every input row ends up in exactly one
of the two outputs: ``prompts`` (valid) or ``rejects`` (row, custom_id, field, reason).

Structured outputs: a constrained row (``response_format`` json_schema or json_object) whose
schema the grammar engine cannot compile is a reject here (field
``body.response_format.json_schema.schema``), checked once per distinct format, not per row
(:func:`~kvbatch.engine.text.structured.schema_error` keeps its answers by the format's hash): a
night of ten million rows sharing three schemas compiles three. Any other row goes to the prompts
table as :func:`~kvbatch.io.prompt_table.outcome_record` writes it. A row without a format pays
nothing: it never reaches the check, and the grammar engine is not even imported. A row with tools
(its tools spec is its ``response_format``) is a reject when a tool's ``parameters`` cannot be
compiled (field ``body.tools.<i>.function.parameters``); its tool-call history is kept in the
message columns (:mod:`kvbatch.io.prompt_table`).

Streaming: a dataset can be many GB, so nothing holds it whole. Rows are read one line (JSONL)
or one record batch (Parquet) at a time. Memory is bounded by a batch, whatever the row count:

1. every row's outcome (the valid row, or its reject) goes to a local temporary Parquet file in
   input order, and every parsed ``(row, custom_id)`` to one of ``DUPLICATE_PARTITIONS`` spill
   files chosen by a hash of the id, so all rows of one id land in the same file;
2. each spill file alone is searched for repeated ids (polars), which holds one file's ids at a
   time, not every id of the dataset: a row whose id appeared on an earlier row is a duplicate
   of the first one (a rejected row's id counts too, as in ``kvbatch generate``);
3. the outcomes are streamed again into both outputs, duplicates turned into rejects, one
   Parquet row group per ``batch_rows`` rows, into files visible only on commit
   (:class:`TableStream`).

The outputs are those of one pass with a set of seen ids (the readers' ``check_duplicates``),
row for row and reason for reason.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import fsspec
import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from kvbatch.io.batch_output import AtomicSink, ParquetSinkFile
from kvbatch.io.batch_requests import (
    CHAT_COMPLETIONS_URL,
    RESPONSES_URL,
    ChatRequest,
    RejectedRow,
    parse_request_line,
    read_line_blocks,
    read_requests,
    reject,
    warn_unknown_fields,
)
from kvbatch.io.endpoints import schema_field
from kvbatch.io.prompt_table import (
    PROMPTS_SCHEMA,
    REJECTS_SCHEMA,
    outcome_record,
    reject_record,
)
from kvbatch.io.request_columns import parse_block

# Spill files of (row, custom_id) for the duplicate search; a 10M-row dataset puts ~600k ids in each.
DUPLICATE_PARTITIONS = 16
# One input row's outcome: a valid row (field null) or a reject (row, custom_id, field, reason).
OUTCOME_SCHEMA = pa.schema([*PROMPTS_SCHEMA, ("field", pa.string()), ("reason", pa.string())])
ID_SCHEMA = pa.schema([("row", pa.int64()), ("custom_id", pa.string())])

# Plain chat fields a Parquet column can be mapped to (target name -> what the validator reads).
PARQUET_TARGETS = ("custom_id", "messages", "model", "max_tokens", "max_completion_tokens", "temperature", "top_p",
                   "top_k", "min_p", "seed", "stop", "stop_token_ids", "logprobs", "top_logprobs", "ignore_eos",
                   "response_format", "tools", "tool_choice", "parallel_tool_calls")
# Targets a string column may hold as JSON text (a table's usual way to store an object whose shape
# varies by row: a schema, a list of tools whose ``parameters`` differ). ``tool_choice`` is JSON text
# only when it spells an object: ``auto``, ``required`` and ``none`` are its plain strings.
JSON_TEXT_TARGETS = ("response_format", "tools", "tool_choice")
# The field a chat row's schema the grammar engine refuses is rejected under (as ops.jobs names it;
# a /v1/responses row's: io.endpoints.schema_field).
SCHEMA_FIELD = schema_field(CHAT_COMPLETIONS_URL)


def outcome(item: ChatRequest | RejectedRow) -> dict[str, Any]:
    """The prompts-or-rejects record of one parsed item: a constrained row whose schema cannot be
    compiled (or compiles too slowly) is a reject naming the problem. The check is asked once per
    distinct format (``schema_error`` keeps its answers), and only for a constrained row. A row with
    tools is checked tool by tool (``tools_error``, cached per tool), its reject naming the tool's
    ``parameters`` as ``kvbatch generate`` does (:func:`~kvbatch.ops.jobs.tokenize_request`)."""
    if isinstance(item, ChatRequest) and item.sampling.response_format is not None:
        # Only a constrained row loads the grammar engine.
        from kvbatch.engine.text.structured import schema_error, tools_error
        from kvbatch.engine.text.tool_calls import is_tools_spec

        if is_tools_spec(item.sampling.response_format):
            bad_tool = tools_error(item.sampling.response_format)
            if bad_tool is not None:
                flat = item.endpoint == RESPONSES_URL  # a Responses tool spells its fields flat
                where = f"body.tools.{bad_tool[0]}.{'' if flat else 'function.'}parameters"
                return reject_record(reject(item, where, bad_tool[1]))
            return outcome_record(item)
        problem = schema_error(item.sampling.response_format)
        if problem is not None:
            return reject_record(reject(item, schema_field(item.endpoint), problem))
    return outcome_record(item)


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
    check_duplicates: bool = True,
) -> Iterator[ChatRequest | RejectedRow]:
    """Rows of a Parquet file as requests. ``columns`` maps a plain chat field (``custom_id``,
    ``messages``, ``max_tokens``...) to the file's column name; unmapped fields use their own
    name when the file has such a column. A ``prompt`` target takes a plain string column and
    makes it a single user message. A ``response_format`` column holds the object, or its JSON
    text (a string column is how most tables hold a schema); so does a ``tools`` column (the chat
    ``tools`` array, best as JSON text: a struct column gives every row every tool field, null where
    a row has none) and a ``tool_choice`` column (a mode string, or a named function as an object or
    its JSON text). ``parallel_tool_calls`` is a boolean column. A row with tools is read as a chat
    row with them (:mod:`kvbatch.io.tools`)."""
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
                item = _json_text_fields(obj, row_no)
                if item is None:
                    try:
                        line = json.dumps(obj, ensure_ascii=False, allow_nan=True).encode("utf-8", "surrogatepass")
                    except (TypeError, ValueError) as exc:
                        item = RejectedRow(row_no, None, "$", f"unreadable row: {exc}")
                    else:
                        item = parse_request_line(line, row_no, default_max_tokens=default_max_tokens)
                cid = item.custom_id
                if cid is not None and check_duplicates:
                    first = seen.setdefault(cid, row_no)
                    if first != row_no:
                        item = RejectedRow(row_no, cid, "custom_id", f"duplicate of row {first}")
                yield item


def _json_text_fields(obj: dict[str, Any], row_no: int) -> RejectedRow | None:
    """Parse, in place, the :data:`JSON_TEXT_TARGETS` a row holds as JSON text; the first that is not
    JSON is the row's reject, naming that field (a plain row's field, as the validator names them)."""
    for target in JSON_TEXT_TARGETS:
        text = obj.get(target)
        if not isinstance(text, str) or (target == "tool_choice" and not text.lstrip().startswith("{")):
            continue
        try:
            obj[target] = json.loads(text)
        except ValueError as exc:
            cid = obj.get("custom_id") if isinstance(obj.get("custom_id"), str) else None
            return RejectedRow(row_no, cid, target, f"malformed JSON: {exc}")
    return None


def read_dataset(
    url: str,
    *,
    fmt: str = "auto",
    columns: Mapping[str, str] | None = None,
    default_max_tokens: int = 256,
    storage_options: Mapping[str, Any] | None = None,
    check_duplicates: bool = True,
) -> Iterator[ChatRequest | RejectedRow]:
    """One item per input row, in input order, whatever the format (``check_duplicates``: a
    repeated ``custom_id`` is rejected here, which keeps every id seen in memory)."""
    kind = detect_format(url) if fmt == "auto" else fmt
    if kind == "jsonl":
        if columns:
            raise ValueError("a column mapping applies to Parquet input only")
        return read_requests(url, default_max_tokens=default_max_tokens, storage_options=storage_options,
                             check_duplicates=check_duplicates)
    if kind == "parquet":
        return read_parquet_requests(url, columns=columns, default_max_tokens=default_max_tokens,
                                     storage_options=storage_options, check_duplicates=check_duplicates)
    raise ValueError(f"unknown dataset format {fmt!r} (use auto, jsonl or parquet)")


class TableStream:
    """Rows in, one Parquet file out, written a row group at a time and visible at ``url`` only
    on :meth:`commit` (an exception before that leaves the previous commit, as ``write_table``).
    ``spool``: an object-store file is written locally and uploaded at commit (:class:`AtomicSink`),
    for a step that holds many files open at once. ``statistics``: the columns whose min/max each
    row group records (all by default); a writer keeps every row group's statistics in memory until
    it closes, so long strings (message contents, block keys) are left out where many files stay
    open."""

    def __init__(self, url: str, schema: pa.Schema, *, storage_options: Mapping[str, Any] | None = None,
                 batch_rows: int = 8192, spool: bool = False, statistics: bool | list[str] = True) -> None:
        self.schema = schema
        self.batch_rows = batch_rows
        self.rows = 0
        self._pending: list[dict[str, Any]] = []
        self._sink = AtomicSink(url, storage_options, spool=spool)
        self._file = ParquetSinkFile(self._sink)
        self._writer = pq.ParquetWriter(self._file, schema, compression="zstd", write_statistics=statistics)

    def add(self, record: dict[str, Any]) -> None:
        self._pending.append(record)
        if len(self._pending) >= self.batch_rows:
            self._flush()

    def add_table(self, table: pa.Table) -> None:
        """Rows already in a table (after any pending records, so the order is kept)."""
        self._flush()
        if table.num_rows:
            self._writer.write_table(table.cast(self.schema))
            self.rows += table.num_rows

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


class IdSpill:
    """``(row, custom_id)`` pairs spilled to ``partitions`` local Parquet files by a hash of the
    id, so that :meth:`duplicates` searches one file at a time."""

    def __init__(self, folder: str, partitions: int = DUPLICATE_PARTITIONS, batch_rows: int = 65536) -> None:
        self.folder, self.partitions, self.batch_rows = folder, partitions, batch_rows
        self._rows: list[int] = []
        self._ids: list[str] = []
        self._writers: dict[int, pq.ParquetWriter] = {}

    def add(self, row: int, custom_id: str) -> None:
        self._rows.append(row)
        self._ids.append(custom_id)
        if len(self._rows) >= self.batch_rows:
            self._flush()

    def add_columns(self, rows: pa.Array, custom_ids: pa.Array) -> None:
        """Many pairs at once (the columnar ingest's block)."""
        self._flush()
        if len(rows):
            self._rows, self._ids = rows.to_pylist(), custom_ids.to_pylist()
            self._flush()

    def _path(self, part: int) -> str:
        return os.path.join(self.folder, f"ids-{part:03d}.parquet")

    def _flush(self) -> None:
        if not self._rows:
            return
        df = pl.DataFrame({"row": self._rows, "custom_id": self._ids}, schema={"row": pl.Int64, "custom_id": pl.String})
        df = df.with_columns(part=(pl.col("custom_id").hash(seed=0) % self.partitions).cast(pl.Int64))
        for (part,), piece in df.partition_by("part", as_dict=True).items():
            writer = self._writers.get(part)
            if writer is None:
                writer = self._writers[part] = pq.ParquetWriter(self._path(part), ID_SCHEMA)
            writer.write_table(piece.drop("part").to_arrow().cast(ID_SCHEMA))
        self._rows, self._ids = [], []

    def duplicates(self) -> tuple[np.ndarray, np.ndarray]:
        """(rows that repeat an earlier row's id, that earlier first row), sorted by row."""
        self._flush()
        for writer in self._writers.values():
            writer.close()
        found = [
            pl.read_parquet(self._path(part))
            .with_columns(first=pl.col("row").min().over("custom_id"))
            .filter(pl.col("row") != pl.col("first"))
            .select("row", "first")
            for part in sorted(self._writers)
        ]
        dups = pl.concat(found).sort("row") if found else pl.DataFrame(schema={"row": pl.Int64, "first": pl.Int64})
        return dups["row"].to_numpy(), dups["first"].to_numpy()


def _split_outcomes(batch: pa.RecordBatch, dup_rows: np.ndarray, dup_first: np.ndarray,
                    unit: str) -> tuple[pa.Table, pa.Table]:
    """(valid rows, rejects) of one batch of outcomes, a repeated id made a reject."""
    rows = batch.column("row").to_numpy(zero_copy_only=False)
    at = np.minimum(np.searchsorted(dup_rows, rows), max(len(dup_rows) - 1, 0))
    is_dup = (dup_rows[at] == rows) if len(dup_rows) else np.zeros(len(rows), dtype=bool)
    table = pa.Table.from_batches([batch])
    valid = pc.and_(pc.is_null(table.column("field")), pa.array(~is_dup))
    prompts = table.filter(valid).select(PROMPTS_SCHEMA.names)
    bad = pc.invert(valid)
    rejects = table.filter(bad).select(REJECTS_SCHEMA.names)
    dup_of = is_dup[np.asarray(bad)]
    if dup_of.any():
        first = pa.array(dup_first[at][np.asarray(bad)].astype(str))
        reason = pc.binary_join_element_wise(pa.scalar(f"duplicate of {unit} "), first, "")
        dup_mask = pa.array(dup_of)
        rejects = rejects.set_column(2, "field", pc.if_else(dup_mask, pa.scalar("custom_id"), rejects.column("field")))
        rejects = rejects.set_column(3, "reason", pc.if_else(dup_mask, reason, rejects.column("reason")))
    return prompts, rejects


def _outcomes_columnar(url: str, outcomes: TableStream, ids: IdSpill, default_max_tokens: int,
                       storage_options: Mapping[str, Any] | None, block_lines: int = 8192) -> int:
    """Every line of a JSONL file as an outcome row, a block of lines at a time: the rows
    :func:`~kvbatch.io.request_columns.parse_block` proves valid, and the others parsed one by
    one, merged back into line order. Returns the line count."""
    warned: set[str] = set()
    line_no = 1
    for lines in read_line_blocks(url, block_lines=block_lines, storage_options=storage_options):
        valid, slow = parse_block(lines, line_no, default_max_tokens=default_max_tokens)
        block = valid.append_column("field", pa.nulls(valid.num_rows, pa.string())).append_column(
            "reason", pa.nulls(valid.num_rows, pa.string())).cast(OUTCOME_SCHEMA)
        if len(slow):
            items = [parse_request_line(lines[i], line_no + int(i), default_max_tokens=default_max_tokens)
                     for i in slow]
            for item in items:
                warn_unknown_fields(url, item, warned)
            records = [outcome(i) for i in items]
            block = pa.concat_tables([block, pa.Table.from_pylist(records, OUTCOME_SCHEMA)])
            block = block.take(pc.sort_indices(block.column("row")))
        outcomes.add_table(block)
        has_id = pc.is_valid(block.column("custom_id"))
        ids.add_columns(pc.filter(block.column("row"), has_id).combine_chunks(),
                        pc.filter(block.column("custom_id"), has_id).combine_chunks())
        line_no += len(lines)
    return line_no - 1


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
    columnar: bool = True,
) -> IngestReport:
    """Validate every row of ``url``; stream the valid rows to ``prompts_url`` and the others to
    ``rejects_url`` (both Parquet, ``batch_rows`` rows per row group, each committed atomically;
    an error while reading, such as :class:`~kvbatch.io.batch_requests.InputStreamError` for a
    truncated ``.gz``, commits neither: a shard built from part of a file would pass for all of it).
    Repeated ids are found through a spill to local temporary files (module docstring).
    ``columnar`` (JSONL): blocks of lines are validated by :mod:`kvbatch.io.request_columns`
    and only the lines it cannot prove valid are parsed one by one; ``False``: every line is
    (the reference path; both give the same tables)."""
    report = IngestReport()
    out_opts = output_storage_options if output_storage_options is not None else storage_options
    kind = detect_format(url) if fmt == "auto" else fmt
    with tempfile.TemporaryDirectory(prefix="kvbatch-ingest-") as tmp:
        outcomes_path = os.path.join(tmp, "outcomes.parquet")
        outcomes = TableStream(outcomes_path, OUTCOME_SCHEMA, batch_rows=batch_rows)
        ids = IdSpill(tmp)
        try:
            if kind == "jsonl" and columnar and not columns:
                report.rows = _outcomes_columnar(url, outcomes, ids, default_max_tokens, storage_options)
            else:
                for item in read_dataset(url, fmt=fmt, columns=columns, default_max_tokens=default_max_tokens,
                                         storage_options=storage_options, check_duplicates=False):
                    report.rows += 1
                    outcomes.add(outcome(item))
                    if item.custom_id is not None:
                        ids.add(item.line_no, item.custom_id)
        except BaseException:
            outcomes.abort()
            raise
        outcomes.commit()
        dup_rows, dup_first = ids.duplicates()
        good = TableStream(prompts_url, PROMPTS_SCHEMA, storage_options=out_opts, batch_rows=batch_rows)
        bad = TableStream(rejects_url, REJECTS_SCHEMA, storage_options=out_opts, batch_rows=batch_rows)
        try:
            for batch in pq.ParquetFile(outcomes_path).iter_batches(batch_size=batch_rows):
                prompts, rejects = _split_outcomes(batch, dup_rows, dup_first, "line" if kind == "jsonl" else "row")
                good.add_table(prompts)
                bad.add_table(rejects)
                report.valid += prompts.num_rows
                report.rejected += rejects.num_rows
                for entry in pc.value_counts(rejects.column("field")).to_pylist():
                    report.rejects_by_field[entry["values"]] = report.rejects_by_field.get(entry["values"], 0) + \
                        entry["counts"]
        except BaseException:
            good.abort()
            bad.abort()
            raise
    report.prompts_bytes = good.commit()
    report.rejects_bytes = bad.commit()
    return report
