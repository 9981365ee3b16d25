"""The columnar twin of :func:`~kvbatch.io.batch_requests.parse_request_line`: a block of JSONL
lines parsed by Arrow's JSON reader and validated with Arrow compute, a column at a time.

Why: ingest spent ~70% of its time in per-row ``json.loads`` and pydantic (about 9,000 rows/s on
one core). The per-row parser stays the specification; this module only *proves* rows valid.
:func:`parse_block` returns (the rows it proved valid, as ``PROMPTS_SCHEMA`` columns; the
positions of every other line). The caller sends the others through ``parse_request_line``,
which gives each one its exact reason (or accepts it: a row this module is unsure of is never
rejected here). tests/test_ingest_columnar.py holds the two paths equal, row for row, on
generated lines, valid and invalid.

What makes a row "unsure" (and so per-row):

- anything Arrow cannot read with the expected types: a wrong type anywhere (Arrow's reader is
  strict: no string for a number, no number for a bool, no float for an integer, no integer
  out of int64), content given as a list of parts, malformed JSON, a repeated key, an invalid
  surrogate. Arrow fails a whole block on one such line, so the block is split in halves until
  the bad lines are alone (blocks of ``MIN_SPLIT`` lines or fewer go per-row);
- lines that are blank, do not look like one object (``{...}``), do not decode as UTF-8, or
  start the file with a byte-order mark;
- fields the per-row parser would warn about (unknown names at the top or in ``body``), a key
  written with an escaped ASCII letter (Arrow decodes ``"\\u0062ody"`` to ``body``), and
  ``"body"``/``"method"``/``"url"`` given as null (a plain row with such a key is a batch row to the
  per-row parser, and Arrow cannot tell null from absent);
- any value outside the rules of ``_ChatBody`` (ranges, roles, ``n``, ``stop`` lengths,
  ``top_logprobs`` without ``logprobs``), NaN included;
- a tool-call history (a message with ``tool_calls`` or ``tool_call_id``, which the message columns
  do not hold; a ``tool`` role or a null content already fail the role and content checks), and
  ``tools``/``tool_choice`` (not columns, so per row like every unknown body field);
- the body fields read only per row (:data:`PER_ROW_FIELDS`: ``logit_bias``, an object keyed by
  token ids, which Arrow would read as a struct of its keys, and the penalties beside it): rare
  rows, not worth columns here.
"""

from __future__ import annotations

import io
import re

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pj

from kvbatch.io.batch_requests import (
    _BODY_FIELDS,
    _ENVELOPE_FIELDS,
    CHAT_COMPLETIONS_URL,
    INT32_MAX,
    MAX_STOP_SEQUENCES,
    MAX_TOP_LOGPROBS,
)
from kvbatch.io.endpoints import MAX_CHOICES
from kvbatch.io.prompt_table import MESSAGES_TYPE, PROMPTS_SCHEMA

MIN_SPLIT = 32  # a failing block this small goes per-row instead of being split again

_MESSAGE = pa.struct([("role", pa.string()), ("content", pa.string())])
_BODY = [
    ("model", pa.string()), ("messages", pa.list_(_MESSAGE)), ("max_tokens", pa.int64()),
    ("max_completion_tokens", pa.int64()), ("temperature", pa.float64()), ("top_p", pa.float64()),
    ("top_k", pa.int64()), ("min_p", pa.float64()), ("seed", pa.int64()), ("stop", pa.list_(pa.string())),
    ("stop_token_ids", pa.list_(pa.int64())), ("logprobs", pa.bool_()), ("top_logprobs", pa.int64()),
    ("n", pa.int64()), ("ignore_eos", pa.bool_()),
]
# Body fields no column holds: a row that sets one goes to the per-row parser, which reads it.
PER_ROW_FIELDS = frozenset({"logit_bias", "presence_penalty", "frequency_penalty"})
_BODY_COLUMNS = frozenset(name for name, _ in _BODY)
assert _BODY_COLUMNS == set(_BODY_FIELDS) - PER_ROW_FIELDS, "the columns are the per-row body's fields"
# One schema for both shapes: a batch row fills custom_id/method/url/body, a plain row custom_id
# and the body's fields at the top level.
READ_SCHEMA = pa.schema([("custom_id", pa.string()), ("method", pa.string()), ("url", pa.string()),
                         ("body", pa.struct(_BODY)), *_BODY])
_ROLES = pa.array(["system", "user", "assistant", "developer"])
_ESCAPED_ASCII = re.compile(rb"\\u00[2-7][0-9a-fA-F]")
_NULL_ENVELOPE = re.compile(rb'"(?:body|method|url)"\s*:\s*null')
_TOOL_HISTORY = (b'"tool_calls"', b'"tool_call_id"')  # message keys the message columns do not hold


def parse_block(lines: list[bytes], first_line_no: int, *, default_max_tokens: int = 256,
                min_split: int = MIN_SPLIT) -> tuple[pa.Table, np.ndarray]:
    """(rows proven valid as ``PROMPTS_SCHEMA`` columns, in line order; the 0-based positions of
    the other lines, which need the per-row parser). Line ``i`` is input line ``first_line_no + i``;
    a block Arrow cannot read is halved down to ``min_split`` lines."""
    slow = np.zeros(len(lines), dtype=bool)
    candidates = _screen(lines, first_line_no, slow)
    tables: list[pa.Table] = []
    positions: list[np.ndarray] = []
    for table, where in _read(lines, candidates, slow, min_split):
        valid, prompts = _validate(table, first_line_no + where, default_max_tokens)
        slow[where[~valid]] = True
        tables.append(prompts)
        positions.append(where[valid])
    if not tables:
        return PROMPTS_SCHEMA.empty_table(), np.flatnonzero(slow)
    out = pa.concat_tables(tables)
    order = np.argsort(np.concatenate(positions), kind="stable")
    return out.take(pa.array(order)), np.flatnonzero(slow)


def _screen(lines: list[bytes], first_line_no: int, slow: np.ndarray) -> np.ndarray:
    """Positions of the lines worth giving Arrow; marks the others in ``slow``."""
    keep = []
    for i, line in enumerate(lines):
        text = line.strip(b" \t\r\n")
        if text[:1] == b"{" and text[-1:] == b"}":
            keep.append(i)
        else:
            slow[i] = True
    if first_line_no == 1 and keep[:1] == [0] and lines[0].startswith(b"\xef\xbb\xbf"):  # a BOM
        slow[0] = True
        keep = keep[1:]
    block = b"\n".join(lines)
    suspects: set[int] = set()
    try:
        block.decode("utf-8")
    except UnicodeDecodeError:
        suspects.update(i for i in keep if not _utf8(lines[i]))
    # The substring tests first: they scan the block at memory speed, the patterns do not.
    if (b"\\u00" in block and _ESCAPED_ASCII.search(block)) or (b"null" in block and _NULL_ENVELOPE.search(block)):
        suspects.update(i for i in keep if _ESCAPED_ASCII.search(lines[i]) or _NULL_ENVELOPE.search(lines[i]))
    if any(key in block for key in _TOOL_HISTORY):
        suspects.update(i for i in keep if any(key in lines[i] for key in _TOOL_HISTORY))
    if suspects:
        slow[list(suspects)] = True
        keep = [i for i in keep if i not in suspects]
    return np.asarray(keep, dtype=np.int64)


def _utf8(line: bytes) -> bool:
    try:
        line.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _read(lines: list[bytes], where: np.ndarray, slow: np.ndarray, min_split: int):
    """(table, positions) for the lines at ``where`` Arrow can read with the expected types;
    a block that fails is halved until its bad lines are alone (those are marked slow)."""
    if not len(where):
        return
    try:
        table = pj.read_json(io.BytesIO(b"\n".join(lines[i] for i in where)),
                             read_options=pj.ReadOptions(use_threads=True, block_size=1 << 26),
                             parse_options=pj.ParseOptions(explicit_schema=READ_SCHEMA,
                                                           unexpected_field_behavior="infer"))
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        table = None
    if table is not None and table.num_rows == len(where):  # two objects on one line: not equal
        table = _without_unknown_fields(table, lines, where, slow)
        if table is not None:
            yield table, where[~slow[where]]
        return
    if len(where) <= min_split:
        slow[where] = True
        return
    half = len(where) // 2
    yield from _read(lines, where[:half], slow, min_split)
    yield from _read(lines, where[half:], slow, min_split)


def _without_unknown_fields(table: pa.Table, lines: list[bytes], where: np.ndarray, slow: np.ndarray):
    """The known columns of ``table``; a line that names an unknown top or body field (the
    per-row parser warns about those) is marked slow, and ``None`` when none is left."""
    extra = [n for n in table.schema.names if n not in READ_SCHEMA.names]
    body_type = table.schema.field("body").type
    extra += [body_type.field(i).name for i in range(body_type.num_fields)
              if body_type.field(i).name not in _BODY_COLUMNS]
    extra = [n for n in extra if n not in _ENVELOPE_FIELDS]
    if not extra:
        return table if table.schema == READ_SCHEMA else _known(table)
    needles = [f'"{n}"'.encode() for n in extra]
    named = np.array([any(nd in lines[i] for nd in needles) for i in where], dtype=bool)
    slow[where[named]] = True
    if named.all():
        return None
    return _known(table).filter(pa.array(~named))


def _known(table: pa.Table) -> pa.Table:
    """Only READ_SCHEMA's columns (extra fields inside messages are dropped, as per row)."""
    cols = []
    for field in READ_SCHEMA:
        col = table.column(field.name)
        if field.name == "body":
            col = pa.chunked_array([_body_known(chunk) for chunk in col.chunks], field.type)
        elif field.name == "messages":
            col = pa.chunked_array([_messages_known(chunk) for chunk in col.chunks], field.type)
        cols.append(col)
    return pa.Table.from_arrays(cols, schema=READ_SCHEMA)


def _messages_known(arr: pa.Array) -> pa.Array:
    items = arr.values
    inner = pa.StructArray.from_arrays([items.field("role"), items.field("content")], fields=list(_MESSAGE),
                                       mask=items.is_null())
    return pa.ListArray.from_arrays(arr.offsets, inner, mask=arr.is_null())


def _body_known(arr: pa.Array) -> pa.Array:
    fields = [pa.field(n, t) for n, t in _BODY]
    children = [_messages_known(arr.field(n)) if n == "messages" else arr.field(n) for n, _ in _BODY]
    return pa.StructArray.from_arrays(children, fields=fields, mask=arr.is_null())


# ---------------------------------------------------------------- validation, a column at a time


def _ok(mask: pa.Array) -> np.ndarray:
    """A boolean column as numpy, null counted as False."""
    return np.asarray(_fill(mask, False), dtype=bool)


def _fill(col: pa.Array, value) -> pa.Array:
    """``fill_null`` that costs nothing on a column without nulls (most of them)."""
    return col if col.null_count == 0 else pc.fill_null(col, value)


def _between(col: pa.Array, lo: float, hi: float, *, lo_open: bool = False) -> np.ndarray:
    """Null (absent) or within [lo, hi] ((lo, hi] with ``lo_open``); NaN is outside."""
    low = pc.greater(col, lo) if lo_open else pc.greater_equal(col, lo)
    inside = pc.and_kleene(low, pc.less_equal(col, hi))
    return _ok(pc.or_kleene(pc.is_null(col), inside))


def _list_all(lists: pa.Array, item_ok: np.ndarray) -> np.ndarray:
    """Per row: every item of the list passes (null and empty lists pass)."""
    bad = np.zeros(len(lists), dtype=np.int64)
    if len(item_ok):
        parents = np.asarray(pc.list_parent_indices(lists))
        np.add.at(bad, parents, ~item_ok[: len(parents)])
    return bad == 0


def _validate(table: pa.Table, line_nos: np.ndarray, default_max_tokens: int) -> tuple[np.ndarray, pa.Table]:
    """(rows proven valid, those rows as ``PROMPTS_SCHEMA`` columns)."""
    t = table.combine_chunks()
    body = t.column("body").chunk(0) if t.column("body").num_chunks else pa.nulls(0, READ_SCHEMA.field("body").type)
    is_batch = _ok(pc.is_valid(body))
    envelope_ok = np.where(
        is_batch,
        _ok(pc.equal(t.column("method"), "POST")) & _ok(pc.equal(t.column("url"), CHAT_COMPLETIONS_URL)),
        _ok(pc.is_null(t.column("method"))) & _ok(pc.is_null(t.column("url"))))
    mask = pa.array(is_batch)

    def field(name: str) -> pa.Array:
        top = t.column(name).combine_chunks() if t.num_rows else pa.nulls(0, READ_SCHEMA.field(name).type)
        return pc.if_else(mask, body.field(name), top)

    cid = t.column("custom_id").combine_chunks() if t.num_rows else pa.nulls(0, pa.string())
    ok = envelope_ok & _ok(pc.greater(pc.utf8_length(cid), 0))
    # A batch row with a body field also at the top level: the per-row parser warns about it.
    for name, _ in _BODY:
        ok &= ~(is_batch & _ok(pc.is_valid(t.column(name))))
    messages = field("messages")
    ok &= _ok(pc.greater(pc.list_value_length(messages), 0))
    items = pc.list_flatten(messages)
    roles, contents = items.field("role"), items.field("content")
    item_ok = _ok(pc.is_in(roles, value_set=_ROLES)) & _ok(pc.is_valid(contents)) & _ok(pc.is_valid(items))
    ok &= _list_all(messages, item_ok)
    for name in ("max_tokens", "max_completion_tokens"):
        ok &= _between(field(name), 1, INT32_MAX)
    ok &= _between(field("temperature"), 0.0, 2.0)
    ok &= _between(field("top_p"), 0.0, 1.0, lo_open=True)
    ok &= _between(field("top_k"), -1, INT32_MAX)
    ok &= _between(field("min_p"), 0.0, 1.0)
    ok &= _between(field("top_logprobs"), 0, MAX_TOP_LOGPROBS)
    ok &= _between(field("n"), 1, MAX_CHOICES)
    stop = field("stop")
    ok &= _ok(pc.less_equal(_fill(pc.list_value_length(stop), 0), MAX_STOP_SEQUENCES))
    ok &= _list_all(stop, _ok(pc.greater(pc.utf8_length(pc.list_flatten(stop)), 0)))
    stop_ids = field("stop_token_ids")
    flat_ids = pc.list_flatten(stop_ids)
    ok &= _list_all(stop_ids, _ok(pc.and_kleene(pc.greater_equal(flat_ids, 0), pc.less_equal(flat_ids, INT32_MAX))))
    logprobs, top_logprobs = field("logprobs"), field("top_logprobs")
    wants_top = _ok(pc.greater(_fill(top_logprobs, 0), 0))
    ok &= ~wants_top | _ok(logprobs)

    keep = pa.array(ok)
    t_ok = {name: pc.filter(field(name), keep) for name in
            ("model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p", "seed",
             "stop", "stop_token_ids", "logprobs", "top_logprobs", "ignore_eos", "n")}
    msgs = pc.filter(messages, keep)
    flat = pc.list_flatten(msgs)
    role = pc.replace_substring_regex(flat.field("role"), "^developer$", "system")
    messages_out = pa.ListArray.from_arrays(
        pc.subtract(msgs.offsets, msgs.offsets[0]),
        pa.StructArray.from_arrays([role, flat.field("content")], fields=list(MESSAGES_TYPE.value_type)))
    max_tokens = pc.coalesce(t_ok["max_completion_tokens"], t_ok["max_tokens"], pa.scalar(default_max_tokens))
    logprobs_ok = _ok(t_ok["logprobs"])
    columns = {
        "row": pa.array(line_nos[ok], pa.int64()),
        "custom_id": pc.filter(cid, keep),
        "messages": messages_out,
        "model": t_ok["model"],
        "max_tokens": max_tokens,
        "temperature": _fill(t_ok["temperature"], 1.0),
        "top_p": _fill(t_ok["top_p"], 1.0),
        "top_k": pc.max_element_wise(_fill(t_ok["top_k"], 0), 0),
        "min_p": _fill(t_ok["min_p"], 0.0),
        "seed": t_ok["seed"],
        "stop": _fill(t_ok["stop"], pa.scalar([], pa.list_(pa.string()))),
        "stop_token_ids": _fill(t_ok["stop_token_ids"], pa.scalar([], pa.list_(pa.int64()))),
        "logprobs": pc.if_else(pa.array(logprobs_ok), _fill(t_ok["top_logprobs"], 0),
                               pa.nulls(len(logprobs_ok), pa.int64())),
        "ignore_eos": _fill(t_ok["ignore_eos"], False),
        "n": _fill(t_ok["n"], 1),  # the prompts table's choices per row, where it has the column
        # A row with a response_format never gets here: the field is not one of this reader's
        # columns, so the row goes to the per-row parser (which canonicalizes the format).
        "response_format": pa.nulls(int(ok.sum()), pa.string()),
        # Only chat rows get here: another endpoint's url sends its row to the per-row parser.
        "endpoint": pa.nulls(int(ok.sum()), pa.string()),
        "prompt": pa.nulls(int(ok.sum()), pa.string()),
        "prompt_ids": pa.nulls(int(ok.sum()), pa.list_(pa.int64())),
    }
    # A row that sets a per-row field never gets here: those columns (where the table has them) are
    # null, their neutral value.
    out = pa.Table.from_arrays([pa.nulls(int(ok.sum()), f.type) if f.name in PER_ROW_FIELDS
                                else columns[f.name].cast(f.type) for f in PROMPTS_SCHEMA], schema=PROMPTS_SCHEMA)
    return ok, out
