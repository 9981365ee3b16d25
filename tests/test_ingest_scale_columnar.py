"""The columnar ingest (:mod:`kvbatch.io.request_columns`) gives what the per-row parser gives,
line for line: generated lines, valid and broken in every field, are proven valid by Arrow or
handed to ``parse_request_line``, and the outcomes equal parsing every line on its own; whole
files give the same prompts and rejects tables and the same warnings either way."""

from __future__ import annotations

import gzip
import json
import logging

import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbatch.io.batch_requests import ChatRequest, parse_request_line
from kvbatch.io.prompt_table import reject_record, request_record
from kvbatch.io.request_columns import parse_block
from kvbatch.ops.ingest.prompts import ingest

ANY = [None, 0, 1, -1, 2, 0.5, 2.5, 1e308, float("nan"), True, False, "x", "", [], ["a"], [""], [1], [-1],
       {"a": 1}, 2**31, 2**40, 2**63, -(2**63) - 1, 20, 21]
# Each sampling field's values: the valid ones first, then the ones the parser refuses.
FIELD_VALUES = {
    "model": (["m", "gpt-4o", ""], [3]),
    "max_tokens": ([1, 48, 2**31 - 1], [0, 2**31, 48.0]),
    "max_completion_tokens": ([1, 7], [0, -3]),
    "temperature": ([0, 0.0, 0.7, 2], [2.0001, -0.1]),
    "top_p": ([0.9, 1], [0.0, 1.5]),
    "top_k": ([-1, 0, 40], [-2]),
    "min_p": ([0.0, 0.05], [1.01]),
    "seed": ([0, -5, 2**63 - 1], [2**63]),
    "stop": ([["\n"], ["a", "b", "c", "d"], "one"], [["a", "b", "c", "d", "e"], [""], [None]]),
    "stop_token_ids": ([[2], [0, 5]], [[-1], [2**31]]),
    "logprobs": ([True, False], ["yes"]),
    "top_logprobs": ([0, 3, 20], [21]),
    "n": ([1, 2, 128], [0, 129]),
    "ignore_eos": ([True, False], [1]),
}
CONTENTS = ["hi", "", "  spaced \n", "é 数据", "<|im_start|>x", [{"type": "text", "text": "a"}]]
BAD_CONTENTS = ["\ud800", None, 5, [{"type": "image_url"}]]
BREAKS = ["field", "any", "custom_id", "messages", "message", "role", "unknown", "envelope", "null_envelope",
          "top_level_model", "name"]


@st.composite
def line(draw) -> bytes:
    """One JSONL line: a valid row (batch or plain, with null-valued and absent fields), then,
    half the time, one thing broken; or a raw line that is not a row at all."""
    kind = draw(st.sampled_from(["batch", "batch", "plain", "plain", "raw"]))
    if kind == "raw":
        return draw(st.sampled_from([b"", b"   ", b"\t\r", b"not json", b"[1]", b"null", b'{"custom_id": "a"} {"b": 1}',
                                     b"\xff\xfe", b'{"custom_id": "a", "custom_id": "b", "messages": []}',
                                     b'{"\\u0063ustom_id": "e", "messages": [{"role": "user", "content": "x"}]}',
                                     b'{"custom_id": "q", "messages": [{"role": "user", "content": "x"}]}\r',
                                     b'\xef\xbb\xbf{"custom_id": "b", "messages": [{"role": "user", "content": "x"}]}']))
    messages = draw(st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "developer"]),
                                                    "content": st.sampled_from(CONTENTS)}), min_size=1, max_size=3))
    body: dict = {"messages": messages}
    for name in draw(st.lists(st.sampled_from(sorted(FIELD_VALUES)), max_size=3, unique=True)):
        body[name] = draw(st.sampled_from([*FIELD_VALUES[name][0], None]))
    obj: dict = {"custom_id": draw(st.sampled_from(["id-1", "id-2", "é", "x" * 40]))}
    if kind == "batch":
        obj.update(method="POST", url="/v1/chat/completions", body=body)
    else:
        obj.update(body)
    where = obj["body"] if kind == "batch" else obj
    broken = draw(st.sampled_from([None] * len(BREAKS) + BREAKS))
    if broken == "field":
        name = draw(st.sampled_from(sorted(FIELD_VALUES)))
        where[name] = draw(st.sampled_from(FIELD_VALUES[name][1]))
    elif broken == "any":
        where[draw(st.sampled_from(sorted(FIELD_VALUES)))] = draw(st.sampled_from(ANY))
    elif broken == "custom_id":
        if draw(st.booleans()):
            del obj["custom_id"]
        else:
            obj["custom_id"] = draw(st.sampled_from(["", None, 5, "\ud800"]))
    elif broken == "messages":
        where["messages"] = draw(st.sampled_from([[], *ANY]))
    elif broken == "message":
        messages[draw(st.integers(0, len(messages) - 1))]["content"] = draw(st.sampled_from(BAD_CONTENTS))
    elif broken == "role":
        messages[0]["role"] = draw(st.sampled_from(["tool", None, 1, "System"]))
    elif broken == "unknown":
        where[draw(st.sampled_from(["stream", "user", "presence_penalty"]))] = draw(st.sampled_from([True, None, "u"]))
    elif broken == "envelope" and kind == "batch":
        change = draw(st.sampled_from(["method", "url", "body", "drop"]))
        if change == "drop":
            del obj[draw(st.sampled_from(["method", "url", "body"]))]
        else:
            obj[change] = draw(st.sampled_from(["GET", "/v1/embeddings", None, "x"]))
    elif broken == "null_envelope" and kind == "plain":
        obj[draw(st.sampled_from(["body", "method", "url"]))] = None
    elif broken == "top_level_model" and kind == "batch":
        obj["model"] = draw(st.sampled_from(["top", None]))
    elif broken == "name":
        messages[0]["name"] = draw(st.sampled_from(["bob", 3]))  # ignored silently, per row too
    text = json.dumps(obj, ensure_ascii=draw(st.booleans()))
    return text.encode("utf-8", "surrogatepass")


def outcome(item):
    return ("ok", request_record(item)) if isinstance(item, ChatRequest) else ("rejected", reject_record(item))


def columnar(lines: list[bytes], first: int = 1) -> tuple[list, int]:
    table, slow = parse_block(lines, first, default_max_tokens=99, min_split=1)
    got = {rec["row"]: ("ok", rec) for rec in table.to_pylist()}
    assert not set(got) & {first + int(i) for i in slow}, "a line is either proven valid or left to the parser"
    for i in slow:
        got[first + int(i)] = outcome(parse_request_line(lines[i], first + int(i), default_max_tokens=99))
    return [got[first + i] for i in range(len(lines))], table.num_rows


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lines=st.lists(line(), min_size=1, max_size=12), first=st.sampled_from([1, 2, 1000]))
def test_columnar_outcomes_equal_per_row_outcomes(lines, first):
    expected = [outcome(parse_request_line(raw, first + i, default_max_tokens=99)) for i, raw in enumerate(lines)]
    assert columnar(lines, first)[0] == expected


def _plain(i: int, **extra) -> bytes:
    return json.dumps({"custom_id": f"r{i}", "messages": [{"role": "user", "content": f"q {i}"}], **extra}).encode()


def _batch(i: int, **body) -> bytes:
    return json.dumps({"custom_id": f"b{i}", "method": "POST", "url": "/v1/chat/completions",
                       "body": {"messages": [{"role": "developer", "content": "be brief"},
                                             {"role": "user", "content": f"é {i}"}], **body}}).encode()


def test_clean_rows_are_proven_valid_without_the_per_row_parser():
    """The fast path is taken: a test of equality alone would pass if every line went per row."""
    lines = [_plain(i, temperature=0.5, stop=["\n"]) for i in range(50)] + [_batch(i, max_tokens=5, seed=i)
                                                                           for i in range(50)]
    table, slow = parse_block(lines, 1)
    assert len(slow) == 0 and table.num_rows == 100
    assert columnar(lines)[0] == [outcome(parse_request_line(raw, i + 1, default_max_tokens=99))
                                  for i, raw in enumerate(lines)]


def test_one_bad_line_leaves_the_rest_of_its_block_on_the_fast_path():
    lines = [_plain(i) for i in range(200)]
    lines[137] = b'{"custom_id": "bad", "messages": [{"role": "user", "content": "x"}], "temperature": "hot"}'
    lines[10] = b""
    table, slow = parse_block(lines, 1)
    assert {10, 137} <= set(slow.tolist())
    assert len(slow) <= 1 + 32  # the blank line, and the bad line's block once halved down to MIN_SPLIT
    assert table.num_rows == 200 - len(slow)


MIXED = [
    b'\xef\xbb\xbf' + _plain(0),
    _plain(1),
    b"",
    b"   ",
    _plain(2, streem=True),
    _batch(3, streem=False),
    b'{"custom_id": "r1", "messages": [{"role": "user", "content": "repeat"}]}',
    b"{not json",
    _plain(4) + b"\r",
    b"\xff\xfe",
    _batch(5, temperature=3.0),
    _plain(6, usr="u", user="u"),
    _batch(6),
    _plain(7),
]


@pytest.mark.parametrize("compress", [False, True])
def test_ingest_columnar_tables_and_warnings_equal_the_per_row_ingest(tmp_path, caplog, compress):
    lines = MIXED * 30  # several blocks, ids repeated across them
    data = b"\n".join(lines) + b"\n"
    src = tmp_path / ("in.jsonl.gz" if compress else "in.jsonl")
    src.write_bytes(gzip.compress(data) if compress else data)
    tables, warnings = {}, {}
    for mode in (True, False):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="kvbatch.io.batch_requests"):
            report = ingest(str(src), str(tmp_path / f"p{mode}.parquet"), str(tmp_path / f"r{mode}.parquet"),
                            columnar=mode, batch_rows=100)
        assert report.rows == len(lines)
        tables[mode] = (pq.read_table(tmp_path / f"p{mode}.parquet"), pq.read_table(tmp_path / f"r{mode}.parquet"))
        warnings[mode] = sorted(r.getMessage() for r in caplog.records)
    assert tables[True][0].equals(tables[False][0])
    assert tables[True][1].equals(tables[False][1])
    assert warnings[True] == warnings[False] and len(warnings[True]) == 3  # streem, body.streem, usr (user: a known field that changes nothing)


def test_block_reader_keeps_lines_across_reads(tmp_path):
    from kvbatch.io.batch_requests import read_line_blocks

    lines = [f"line {i} ".encode() * (i % 7) for i in range(1000)]
    src = tmp_path / "x.jsonl"
    src.write_bytes(b"\n".join(lines))  # no newline at the end
    blocks = list(read_line_blocks(str(src), block_lines=64, read_bytes=100))
    assert [len(b) for b in blocks[:-1]] == [64] * (len(blocks) - 1)
    assert [x for b in blocks for x in b] == lines
