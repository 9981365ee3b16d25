"""Batch request parsing (every rejection names line, field, reason) and ordered, atomic output."""

from __future__ import annotations

import gzip
import json
import math
import re
import uuid
from pathlib import Path
from typing import Any

import fsspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbatch.io.batch_output import (
    JsonlWriter,
    OrderedJsonlWriter,
    TokenLogprob,
    error_line,
    result_line,
)
from kvbatch.io.batch_requests import (
    _BODY_FIELDS,
    IGNORED_FIELDS,
    REFUSED_FIELDS,
    ChatRequest,
    RejectedRow,
    SamplingParams,
    parse_request_line,
    read_requests,
    reject,
)
from tests.prompt_sets import MT_BENCH  # the 80 MT-Bench questions, kept in tests/data/

USER = [{"role": "user", "content": "hi"}]


def batch_line(body: dict[str, Any] | Any, custom_id: Any = "r1", **envelope: Any) -> bytes:
    row = {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}
    row.update(envelope)
    return json.dumps(row).encode()


def body(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": USER, **fields}


def write_lines(path: Path, lines: list[bytes]) -> None:
    path.write_bytes(b"".join(line + b"\n" for line in lines))


# ------------------------------------------------------------------------------------------
# Rejections: one case per kind, with the exact field


REJECTIONS: list[tuple[str, bytes, str, str]] = [
    # whole-line problems
    ("bad utf-8", b'{"custom_id": "a\xff", "messages": []}', "$", "invalid UTF-8 at byte offset 16"),
    ("malformed json", b'{"custom_id": "a",', "$", "malformed JSON"),
    ("trailing garbage", b'{"custom_id": "a"} x', "$", "malformed JSON"),
    ("array line", b"[1, 2]", "$", "must be a JSON object, got array"),
    ("string line", b'"hello"', "$", "must be a JSON object, got string"),
    ("null line", b"null", "$", "must be a JSON object, got null"),
    # custom_id
    ("missing custom_id", json.dumps({"body": body()}).encode(), "custom_id", "missing"),
    ("empty custom_id", batch_line(body(), custom_id=""), "custom_id", "must not be empty"),
    ("int custom_id", batch_line(body(), custom_id=7), "custom_id", "must be a string, got number"),
    ("null custom_id", batch_line(body(), custom_id=None), "custom_id", "must be a string, got null"),
    ("surrogate custom_id", b'{"custom_id": "\\udc80", "messages": []}', "custom_id", "surrogate"),
    # envelope
    ("wrong method", batch_line(body(), method="GET"), "method", "'POST'"),
    ("wrong url", batch_line(body(), url="/v1/embeddings"), "url", "/v1/chat/completions"),
    ("missing body", json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions"}).encode(), "body", "missing"),
    ("body not object", batch_line("hello"), "body", "valid dictionary"),
    # messages
    ("missing messages", batch_line({"model": "m"}), "body.messages", "missing"),
    ("empty messages", batch_line(body(messages=[])), "body.messages", "at least 1 item"),
    ("messages not list", batch_line(body(messages="hi")), "body.messages", "valid list"),
    ("message not object", batch_line(body(messages=USER + ["hi"])), "body.messages.1", "valid dictionary"),
    ("unknown role", batch_line(body(messages=USER + [{"role": "function", "content": "x"}])), "body.messages.1.role", '"function"'),
    ("missing role", batch_line(body(messages=[{"content": "x"}])), "body.messages.0.role", "missing"),
    ("missing content", batch_line(body(messages=[{"role": "user"}])), "body.messages.0.content", "missing"),
    ("null content", batch_line(body(messages=[{"role": "assistant", "content": None}])), "body.messages.0.content", "got null"),
    ("image part", batch_line(body(messages=[{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "x"}}]}])),
     "body.messages.0.content", "part 1 has type 'image_url'"),
    ("text part without text", batch_line(body(messages=[{"role": "user", "content": [{"type": "text"}]}])), "body.messages.0.content", "part 0 text"),
    ("surrogate content", b'{"custom_id": "a", "messages": [{"role": "user", "content": "\\ud800"}]}', "messages.0.content", "surrogate"),
    # sampling values
    ("temperature < 0", batch_line(body(temperature=-1)), "body.temperature", "greater than or equal to 0, got -1"),
    ("temperature > 2", batch_line(body(temperature=2.5)), "body.temperature", "less than or equal to 2, got 2.5"),
    ("temperature string", batch_line(body(temperature="0.5")), "body.temperature", 'valid number, got "0.5"'),
    ("temperature bool", batch_line(body(temperature=True)), "body.temperature", "got true"),
    ("temperature NaN", b'{"custom_id": "a", "messages": [{"role": "user", "content": "x"}], "temperature": NaN}', "temperature", "finite"),
    ("top_p 0", batch_line(body(top_p=0)), "body.top_p", "greater than 0"),
    ("top_p > 1", batch_line(body(top_p=1.5)), "body.top_p", "less than or equal to 1"),
    ("top_k < -1", batch_line(body(top_k=-2)), "body.top_k", "greater than or equal to -1"),
    ("top_k float", batch_line(body(top_k=1.5)), "body.top_k", "valid integer"),
    ("min_p > 1", batch_line(body(min_p=1.5)), "body.min_p", "less than or equal to 1"),
    ("min_p < 0", batch_line(body(min_p=-0.1)), "body.min_p", "greater than or equal to 0"),
    ("max_tokens 0", batch_line(body(max_tokens=0)), "body.max_tokens", "greater than or equal to 1"),
    ("max_tokens float", batch_line(body(max_tokens=5.0)), "body.max_tokens", "valid integer, got 5.0"),
    ("max_completion_tokens 0", batch_line(body(max_completion_tokens=0)), "body.max_completion_tokens", "greater than or equal to 1"),
    ("n 129", batch_line(body(n=129)), "body.n", "less than or equal to 128, got 129"),
    ("n string", batch_line(body(n="1")), "body.n", "valid integer"),
    ("stop 5 strings", batch_line(body(stop=["a", "b", "c", "d", "e"])), "body.stop", "at most 4 items"),
    ("stop empty string", batch_line(body(stop=["a", ""])), "body.stop.1", "at least 1 character"),
    ("stop lone empty string", batch_line(body(stop="")), "body.stop.0", "at least 1 character"),
    ("stop number", batch_line(body(stop=5)), "body.stop", "valid list"),
    ("stop_token_ids negative", batch_line(body(stop_token_ids=[2, -1])), "body.stop_token_ids.1", "greater than or equal to 0"),
    ("stop_token_ids string", batch_line(body(stop_token_ids="2")), "body.stop_token_ids", "valid list"),
    ("seed > int64", batch_line(body(seed=2**63)), "body.seed", "less than or equal to 9223372036854775807"),
    ("seed < int64", batch_line(body(seed=-(2**63) - 1)), "body.seed", "greater than or equal to"),
    ("logprobs int", batch_line(body(logprobs=5)), "body.logprobs", "valid boolean"),
    ("top_logprobs > 20", batch_line(body(logprobs=True, top_logprobs=21)), "body.top_logprobs", "less than or equal to 20"),
    ("top_logprobs without logprobs", batch_line(body(top_logprobs=3)), "body.top_logprobs", "requires logprobs: true"),
    ("model number", batch_line(body(model=3)), "body.model", "valid string"),
    ("ignore_eos string", batch_line(body(ignore_eos="yes")), "body.ignore_eos", "valid boolean"),
    # plain chat rows: same checks, no "body." prefix
    ("plain temperature", json.dumps({"custom_id": "p", "messages": USER, "temperature": -1}).encode(), "temperature", "got -1"),
    ("plain missing messages", json.dumps({"custom_id": "p", "prompt": "hi"}).encode(), "messages", "missing"),
    ("plain role", json.dumps({"custom_id": "p", "messages": [{"role": "bot", "content": "x"}]}).encode(), "messages.0.role", '"bot"'),
]


@pytest.mark.parametrize(("line", "field", "reason"), [r[1:] for r in REJECTIONS], ids=[r[0] for r in REJECTIONS])
def test_rejection_names_field_and_reason(line: bytes, field: str, reason: str) -> None:
    got = parse_request_line(line, 7)
    assert isinstance(got, RejectedRow), got
    assert got.line_no == 7
    assert got.field == field
    assert reason in got.reason, got.reason
    # the message must itself be writable as UTF-8 JSON (no lone surrogates leak through)
    json.dumps(error_line(got), ensure_ascii=False).encode("utf-8")


def test_rejection_keeps_custom_id_when_it_is_valid() -> None:
    got = parse_request_line(batch_line(body(temperature=9), custom_id="keep-me"), 3)
    assert isinstance(got, RejectedRow)
    assert got.custom_id == "keep-me"
    whole_line = parse_request_line(b"[]", 3)
    assert isinstance(whole_line, RejectedRow) and whole_line.custom_id is None


def test_several_errors_report_every_reason() -> None:
    got = parse_request_line(batch_line(body(temperature=-1, top_p=0, min_p=2)), 1)
    assert isinstance(got, RejectedRow)
    assert got.field == "body.temperature"
    assert "more error" not in got.reason  # no reason hidden behind a count
    first, *rest = got.reason.split("; ")
    assert "got -1" in first
    assert [r.split(":", 1)[0] for r in rest] == ["body.top_p", "body.min_p"]
    assert "got 0" in rest[0] and "got 2" in rest[1]


# ------------------------------------------------------------------------------------------
# Valid rows


def test_full_batch_row_parses_to_sampling_params() -> None:
    line = batch_line(
        {
            "model": "smollm2",
            "messages": [
                {"role": "developer", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "name": "u1"},
                {"role": "assistant", "content": "ok"},
                {"role": "user", "content": "again"},
            ],
            "max_tokens": 64,
            "temperature": 0.7,
            "top_p": 0.9,
            "top_k": 40,
            "min_p": 0.05,
            "seed": 1234,
            "stop": ["\n\n", "END"],
            "stop_token_ids": [2],
            "logprobs": True,
            "top_logprobs": 5,
            "n": 1,
            "ignore_eos": True,
            # unknown fields that OpenAI clients send: ignored
            "stream": False,
            "user": "someone",
            "metadata": {"x": 1},
            "response_format": {"type": "text"},
        },
        custom_id="req-1",
    )
    got = parse_request_line(line, 12)
    assert got == ChatRequest(
        line_no=12,
        custom_id="req-1",
        messages=[
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "a\nb"},
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": "again"},
        ],
        sampling=SamplingParams(
            max_tokens=64,
            temperature=0.7,
            top_p=0.9,
            top_k=40,
            min_p=0.05,
            seed=1234,
            stop=("\n\n", "END"),
            stop_token_ids=(2,),
            logprobs=5,
            ignore_eos=True,
        ),
        model="smollm2",
    )


def test_defaults_and_default_max_tokens() -> None:
    got = parse_request_line(batch_line({"messages": USER}), 1, default_max_tokens=99)
    assert isinstance(got, ChatRequest)
    assert got.model is None
    assert got.sampling == SamplingParams(max_tokens=99)


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"max_tokens": 10, "max_completion_tokens": 20}, {"max_tokens": 20}),
        ({"max_tokens": 10}, {"max_tokens": 10}),
        ({"temperature": 0}, {"temperature": 0.0}),
        ({"temperature": 2}, {"temperature": 2.0}),
        ({"top_p": 1}, {"top_p": 1.0}),
        ({"top_k": -1}, {"top_k": 0}),
        ({"top_k": 0}, {"top_k": 0}),
        ({"stop": "###"}, {"stop": ("###",)}),
        ({"stop": None}, {"stop": ()}),
        ({"stop": []}, {"stop": ()}),
        ({"logprobs": True}, {"logprobs": 0}),
        ({"logprobs": False}, {"logprobs": None}),
        ({"logprobs": False, "top_logprobs": 0}, {"logprobs": None}),
        ({"seed": -(2**63)}, {"seed": -(2**63)}),
        ({"seed": 2**63 - 1}, {"seed": 2**63 - 1}),
        ({"n": None, "temperature": None}, {}),
    ],
)
def test_sampling_field_mapping(fields: dict[str, Any], expected: dict[str, Any]) -> None:
    got = parse_request_line(batch_line(body(**fields)), 1)
    assert isinstance(got, ChatRequest), got
    assert got.sampling == SamplingParams(**expected)
    assert isinstance(got.sampling.temperature, float)


def test_plain_chat_row() -> None:
    line = json.dumps(
        {"custom_id": "q-81", "messages": USER, "max_tokens": 1024, "temperature": 0, "question_id": 81}
    ).encode()
    got = parse_request_line(line, 1)
    assert got == ChatRequest(1, "q-81", USER, SamplingParams(max_tokens=1024, temperature=0.0), None)


def test_bom_and_crlf_are_tolerated() -> None:
    line = b"\xef\xbb\xbf" + json.dumps({"custom_id": "a", "messages": USER}).encode() + b"\r\n"
    assert isinstance(parse_request_line(line, 1), ChatRequest)


def test_reject_helper_keeps_line_and_id() -> None:
    req = parse_request_line(batch_line(body(), custom_id="long"), 5)
    assert isinstance(req, ChatRequest)
    assert reject(req, "body.messages", "prompt is 9000 tokens; the model takes 8192") == RejectedRow(
        5, "long", "body.messages", "prompt is 9000 tokens; the model takes 8192"
    )


# ------------------------------------------------------------------------------------------
# Streaming reader


def mixed_lines() -> list[bytes]:
    return [
        batch_line(body(), custom_id="a"),  # 1 ok
        b"",  # 2 blank: rejected, so output lines stay aligned with input lines
        b"{not json",  # 3 bad JSON
        batch_line(body(temperature=5), custom_id="b"),  # 4 bad value
        b"   \t",  # 5 blank
        batch_line(body(), custom_id="a"),  # 6 duplicate of 1
        batch_line(body(), custom_id="b"),  # 7 duplicate of a rejected row: still a duplicate
        json.dumps({"custom_id": "c", "messages": USER}).encode(),  # 8 ok, plain
        b"\xfe\xff",  # 9 bad UTF-8
    ]


EXPECTED_MIXED = [
    (1, "a", None),
    (2, None, "$"),
    (3, None, "$"),
    (4, "b", "body.temperature"),
    (5, None, "$"),
    (6, "a", "custom_id"),
    (7, "b", "custom_id"),
    (8, "c", None),
    (9, None, "$"),
]


def summarize(items: list[ChatRequest | RejectedRow]) -> list[tuple[int, str | None, str | None]]:
    return [(i.line_no, i.custom_id, i.field if isinstance(i, RejectedRow) else None) for i in items]


def test_mixed_file_yields_one_item_per_line_in_order(tmp_path: Path) -> None:
    path = tmp_path / "requests.jsonl"
    write_lines(path, mixed_lines())
    items = list(read_requests(str(path)))
    assert summarize(items) == EXPECTED_MIXED
    assert [i.reason for i in items if i.line_no in (2, 5)] == ["blank line", "blank line"]
    dup = items[5]
    assert isinstance(dup, RejectedRow) and dup.reason == "duplicate of line 1"
    assert isinstance(items[6], RejectedRow) and items[6].reason == "duplicate of line 4"


def test_last_line_without_newline(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    path.write_bytes(batch_line(body(), custom_id="a") + b"\n" + batch_line(body(), custom_id="b"))
    assert [i.custom_id for i in read_requests(str(path))] == ["a", "b"]


def test_reads_memory_url_and_gzip() -> None:
    base = f"memory://kvbatch-test-{uuid.uuid4().hex}"
    with fsspec.open(f"{base}/requests.jsonl", "wb") as f:
        f.write(b"\n".join(mixed_lines()))
    assert summarize(list(read_requests(f"{base}/requests.jsonl"))) == EXPECTED_MIXED
    with fsspec.open(f"{base}/requests.jsonl.gz", "wb") as f:
        f.write(gzip.compress(b"\n".join(mixed_lines())))
    assert summarize(list(read_requests(f"{base}/requests.jsonl.gz"))) == EXPECTED_MIXED


def test_reader_streams_lazily(tmp_path: Path) -> None:
    """The reader is a generator: the first item comes before the rest of the file is parsed."""
    path = tmp_path / "r.jsonl"
    write_lines(path, [batch_line(body(), custom_id=f"id-{i}") for i in range(1000)])
    it = read_requests(str(path))
    first = next(it)
    assert first.custom_id == "id-0"
    it.close()


# ------------------------------------------------------------------------------------------
# Loopback S3 (moto's threaded server, real s3fs client)


@pytest.fixture(scope="module")
def s3() -> Any:
    moto_server = pytest.importorskip("moto.server")
    s3fs = pytest.importorskip("s3fs")
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    host, port = server.get_host_and_port()
    opts = {"key": "testing", "secret": "testing", "endpoint_url": f"http://{host}:{port}"}
    fs = s3fs.S3FileSystem(**opts)
    fs.mkdir("kvbatch-test")
    try:
        yield fs, opts
    finally:
        server.stop()


def test_reads_from_s3(s3: Any) -> None:
    fs, opts = s3
    fs.pipe_file("kvbatch-test/in/requests.jsonl", b"\n".join(mixed_lines()) + b"\n")
    items = list(read_requests("s3://kvbatch-test/in/requests.jsonl", storage_options=opts))
    assert summarize(items) == EXPECTED_MIXED


def test_ordered_writer_on_s3_commits_whole_or_nothing(s3: Any) -> None:
    fs, opts = s3
    url = "s3://kvbatch-test/out/results.jsonl"
    with OrderedJsonlWriter(url, storage_options=opts) as w:
        for i in (2, 0, 1):
            w.put(i, {"i": i})
    fs.invalidate_cache()
    assert fs.cat_file("kvbatch-test/out/results.jsonl") == b'{"i":0}\n{"i":1}\n{"i":2}\n'

    crashed = "s3://kvbatch-test/out/crashed.jsonl"
    with pytest.raises(RuntimeError, match="boom"), OrderedJsonlWriter(crashed, storage_options=opts) as w:
        w.put(0, {"i": 0})
        raise RuntimeError("boom")
    fs.invalidate_cache()
    assert not fs.exists("kvbatch-test/out/crashed.jsonl")
    assert fs.ls("kvbatch-test/out/", detail=False) == ["kvbatch-test/out/results.jsonl"]
    assert fs.list_multipart_uploads("kvbatch-test") == []  # the aborted upload is gone too


def test_large_output_on_s3_goes_through_multipart(s3: Any) -> None:
    fs, opts = s3
    url = "s3://kvbatch-test/out/large.jsonl"
    text = "x" * 1000
    n = 6 * 1024  # ~6 MiB: more than one 5 MiB part
    with OrderedJsonlWriter(url, storage_options=opts) as w:
        for i in reversed(range(n)):
            w.put(i, {"i": i, "t": text})
    fs.invalidate_cache()
    data = fs.cat_file("kvbatch-test/out/large.jsonl")
    assert [json.loads(line)["i"] for line in data.splitlines()] == list(range(n))


# ------------------------------------------------------------------------------------------
# Ordered and plain writers


@settings(max_examples=60, deadline=None)
@given(st.integers(min_value=0, max_value=40).flatmap(lambda n: st.permutations(list(range(n)))))
def test_ordered_writer_writes_any_permutation_in_order(order: list[int]) -> None:
    url = f"memory://kvbatch-test-{uuid.uuid4().hex}/out.jsonl"
    put: set[int] = set()
    with OrderedJsonlWriter(url) as w:
        for i in order:
            w.put(i, {"index": i, "text": f"line {i}"})
            put.add(i)
            prefix = 0
            while prefix in put:
                prefix += 1
            # eager: every line of the complete prefix is written, only the tail is held
            assert w.lines_written == prefix
            assert w.pending_count == len(put) - prefix
    with fsspec.open(url, "rb") as f:
        lines = f.read().splitlines()
    assert [json.loads(line)["index"] for line in lines] == sorted(order)
    fsspec.filesystem("memory").rm(url)


def test_ordered_writer_start_offset(tmp_path: Path) -> None:
    path = tmp_path / "o.jsonl"
    with OrderedJsonlWriter(str(path), start=1, total=3) as w:
        for i in (3, 1, 2):
            w.put(i, {"i": i})
    assert path.read_text() == '{"i":1}\n{"i":2}\n{"i":3}\n'


def test_crash_inside_with_block_leaves_no_file(tmp_path: Path) -> None:
    path = tmp_path / "out.jsonl"
    with pytest.raises(RuntimeError, match="worker died"), OrderedJsonlWriter(str(path)) as w:
        w.put(0, {"i": 0})
        w.put(1, {"i": 1})
        raise RuntimeError("worker died")
    assert list(tmp_path.iterdir()) == []  # no final file, no temp file either


def test_crash_keeps_the_previous_complete_output(tmp_path: Path) -> None:
    path = tmp_path / "out.jsonl"
    path.write_text('{"old":true}\n')
    with pytest.raises(KeyboardInterrupt), JsonlWriter(str(path)) as w:
        w.write({"new": True})
        raise KeyboardInterrupt
    assert path.read_text() == '{"old":true}\n'
    assert list(tmp_path.iterdir()) == [path]


def test_close_with_missing_index_raises_and_discards(tmp_path: Path) -> None:
    path = tmp_path / "out.jsonl"
    with pytest.raises(ValueError, match="index 1 is missing"), OrderedJsonlWriter(str(path)) as w:
        w.put(0, {"i": 0})
        w.put(2, {"i": 2})
    assert list(tmp_path.iterdir()) == []


def test_close_short_of_total_raises(tmp_path: Path) -> None:
    path = tmp_path / "out.jsonl"
    w = OrderedJsonlWriter(str(path), total=3)
    w.put(0, {"i": 0})
    with pytest.raises(ValueError, match="got 1 of 3 lines"):
        w.close()
    assert list(tmp_path.iterdir()) == []


def test_duplicate_and_out_of_range_puts_raise(tmp_path: Path) -> None:
    with OrderedJsonlWriter(str(tmp_path / "o.jsonl"), total=3) as w:
        w.put(0, {})
        w.put(2, {})
        with pytest.raises(ValueError, match="already put"):
            w.put(0, {})
        with pytest.raises(ValueError, match="already put"):
            w.put(2, {})
        with pytest.raises(ValueError, match="beyond total"):
            w.put(3, {})
        w.put(1, {})
    with pytest.raises(ValueError, match="closed"):
        w.put(3, {})


def test_max_pending_bounds_the_tail(tmp_path: Path) -> None:
    w = OrderedJsonlWriter(str(tmp_path / "o.jsonl"), max_pending=2)
    w.put(1, {})
    w.put(2, {})
    with pytest.raises(ValueError, match="max_pending is 2"):
        w.put(3, {})
    w.abort()
    assert list(tmp_path.iterdir()) == []


def test_nan_is_refused_before_buffering(tmp_path: Path) -> None:
    with OrderedJsonlWriter(str(tmp_path / "o.jsonl")) as w:
        with pytest.raises(ValueError):
            w.put(0, {"x": math.nan})
        w.put(0, {"x": 1})
    assert (tmp_path / "o.jsonl").read_text() == '{"x":1}\n'


def test_plain_writer_keeps_write_order_and_creates_dirs(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "errors.jsonl"
    with JsonlWriter(str(path)) as w:
        w.write({"b": 2})
        w.write({"a": "é"})
    assert path.read_text(encoding="utf-8") == '{"b":2}\n{"a":"é"}\n'
    assert w.lines_written == 2


def test_memory_writer_commits_by_rename() -> None:
    base = f"memory://kvbatch-test-{uuid.uuid4().hex}"
    with pytest.raises(RuntimeError), JsonlWriter(f"{base}/e.jsonl") as w:
        w.write({"a": 1})
        fs = fsspec.filesystem("memory")
        assert not fs.exists(f"{base}/e.jsonl")  # not visible while being written
        raise RuntimeError
    assert fs.find(base) == []


# ------------------------------------------------------------------------------------------
# Output lines


def test_result_line_shape() -> None:
    line = result_line(
        "req-1",
        4,
        text="Hello",
        finish_reason="stop",
        prompt_tokens=10,
        completion_tokens=2,
        model="smollm2",
        token_ids=[9906, 2],
        logprobs=[TokenLogprob("Hello", -0.5, (("Hello", -0.5), ("Hi", -1.5))), TokenLogprob("", -math.inf)],
        created=1700000000,
    )
    json.dumps(line, allow_nan=False)
    assert line["custom_id"] == "req-1"
    assert line["id"].startswith("batch_req_") and line["error"] is None
    resp = line["response"]
    assert resp["status_code"] == 200
    b = resp["body"]
    assert b["object"] == "chat.completion" and b["created"] == 1700000000 and b["model"] == "smollm2"
    assert b["usage"] == {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12}
    choice = b["choices"][0]
    assert choice["index"] == 0
    assert choice["message"] == {"role": "assistant", "content": "Hello"}
    assert choice["finish_reason"] == "stop"
    assert choice["token_ids"] == [9906, 2]
    content = choice["logprobs"]["content"]
    assert content[0] == {
        "token": "Hello",
        "logprob": -0.5,
        "bytes": list(b"Hello"),
        "top_logprobs": [
            {"token": "Hello", "logprob": -0.5, "bytes": list(b"Hello")},
            {"token": "Hi", "logprob": -1.5, "bytes": list(b"Hi")},
        ],
    }
    assert content[1]["logprob"] == -9999.0
    # stable: same request, same ids; different request, different ids
    again = result_line("req-1", 4, text="x", finish_reason="length", prompt_tokens=1, completion_tokens=1, model="m")
    other = result_line("req-2", 5, text="x", finish_reason="length", prompt_tokens=1, completion_tokens=1, model="m")
    assert again["id"] == line["id"] and other["id"] != line["id"]
    assert again["response"]["body"]["choices"][0]["logprobs"] is None
    assert "token_ids" not in again["response"]["body"]["choices"][0]


def test_result_line_refuses_unknown_finish_reason() -> None:
    with pytest.raises(ValueError, match="finish_reason"):
        result_line("a", 1, text="", finish_reason="eos", prompt_tokens=1, completion_tokens=0, model="m")


def test_error_line_shape() -> None:
    line = error_line(RejectedRow(7, "r7", "body.temperature", "Input should be less than or equal to 2, got 9"))
    assert line["custom_id"] == "r7"
    assert line["error"] == {
        "code": "invalid_request",
        "message": "line 7: body.temperature: Input should be less than or equal to 2, got 9",
        "line": 7,
        "field": "body.temperature",
    }
    assert line["response"]["status_code"] == 400
    assert line["response"]["body"]["error"]["param"] == "body.temperature"
    no_id = error_line(RejectedRow(3, None, "$", "malformed JSON"))
    assert no_id["custom_id"] is None and no_id["id"] != line["id"]


# ------------------------------------------------------------------------------------------
# Realistic input: MT-Bench turned into batch lines, then a full read -> write round trip


def test_mt_bench_round_trip(tmp_path: Path) -> None:
    questions = [json.loads(line) for line in MT_BENCH.read_text(encoding="utf-8").splitlines() if line.strip()]
    assert len(questions) == 80
    lines: list[bytes] = []
    for q in questions:  # turn 1, as the dataset README's recipe, in the OpenAI Batch envelope
        lines.append(
            batch_line(
                {"model": "smollm2", "messages": [{"role": "user", "content": q["turns"][0]}], "max_tokens": 1024},
                custom_id=f"mtbench-{q['question_id']}-t1",
            )
        )
    for q in questions:  # turn 2 as plain chat rows, with a stand-in turn-1 answer
        messages = [
            {"role": "user", "content": q["turns"][0]},
            {"role": "assistant", "content": [{"type": "text", "text": "(answer)"}]},
            {"role": "user", "content": q["turns"][1]},
        ]
        lines.append(json.dumps({"custom_id": f"mtbench-{q['question_id']}-t2", "messages": messages, "max_tokens": 1024}).encode())
    lines.insert(40, b'{"custom_id": "broken", "body": ')  # one bad line in the middle
    src = tmp_path / "requests.jsonl"
    write_lines(src, lines)

    items = list(read_requests(str(src)))
    assert len(items) == 161
    rejected = [i for i in items if isinstance(i, RejectedRow)]
    assert [(r.line_no, r.field) for r in rejected] == [(41, "$")]
    requests = [i for i in items if isinstance(i, ChatRequest)]
    assert all(r.sampling.max_tokens == 1024 for r in requests)
    assert requests[0].messages == [{"role": "user", "content": questions[0]["turns"][0]}]
    assert requests[-1].messages[1] == {"role": "assistant", "content": "(answer)"}

    # finish in reverse order (as a real engine might), write in input order
    out = tmp_path / "results.jsonl"
    errors = tmp_path / "errors.jsonl"
    with OrderedJsonlWriter(str(out), total=len(items)) as w, JsonlWriter(str(errors)) as e:
        for index in reversed(range(len(items))):
            item = items[index]
            if isinstance(item, RejectedRow):
                w.put(index, error_line(item))
                e.write(error_line(item))
            else:
                w.put(index, result_line(item.custom_id, item.line_no, text="ok", finish_reason="stop",
                                         prompt_tokens=3, completion_tokens=1, model="smollm2"))
    written = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert [o["custom_id"] for o in written] == [i.custom_id for i in items]
    assert [o["response"]["status_code"] for o in written].count(400) == 1
    assert len(errors.read_text().splitlines()) == 1


# ------------------------------------------------------------------------------------------
# The request-field table of docs/batch-api.md: every OpenAI chat-completions field honoured,
# refused (a 400 naming it) or ignored (changes nothing), held to the code

DOCS = Path(__file__).resolve().parents[1] / "docs" / "batch-api.md"

# A value of each refused field that would change the answer (tests/test_serve.py sends these too).
REFUSED_SAMPLES: dict[str, Any] = {
    "functions": [{"name": "lookup"}],
    "function_call": "auto",
    "audio": {"voice": "alloy", "format": "wav"},
    "modalities": ["text", "audio"],
    "moderation": {"model": "omni-moderation-latest"},
    "reasoning_effort": "high",
    "verbosity": "low",
    "web_search_options": {},
}
# Values an OpenAI client sends for the fields that change nothing.
IGNORED_SAMPLES: dict[str, Any] = {
    "user": "user-1", "metadata": {"team": "search"}, "store": True, "service_tier": "flex",
    "safety_identifier": "hash-1", "prompt_cache_key": "k", "prompt_cache_retention": "24h",
    "prompt_cache_options": {"mode": "explicit"}, "stream": False, "stream_options": {"include_usage": True},
    "prediction": {"type": "content", "content": "x"},
}


def request_field_table() -> dict[str, str]:
    """{field: "honoured" | "refused" | "ignored"} as docs/batch-api.md's table says."""
    section = DOCS.read_text().split("## Request fields", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(\w+)` \| (\w+) \|", section, re.M)
    table = dict(rows)
    assert len(table) == len(rows), "a field is in the table twice"
    return table


def test_request_field_table_is_the_code_and_covers_the_openai_request() -> None:
    from openai.types.chat import completion_create_params as params

    table = request_field_table()
    assert set(table.values()) == {"honoured", "refused", "ignored"}
    openai_fields = set(params.CompletionCreateParamsBase.__annotations__) | set(
        params.CompletionCreateParamsNonStreaming.__annotations__)
    assert openai_fields - set(table) == set()  # every field of the installed client's request
    assert {f for f, k in table.items() if k == "refused"} == set(REFUSED_FIELDS) == set(REFUSED_SAMPLES)
    assert {f for f, k in table.items() if k == "ignored"} == IGNORED_FIELDS | {"model"} == set(IGNORED_SAMPLES) | {"model"}
    assert {f for f, k in table.items() if k == "honoured"} == (_BODY_FIELDS - {"model"}) | {
        "response_format", "tools", "tool_choice", "parallel_tool_calls"}


@pytest.mark.parametrize("name", sorted(REFUSED_SAMPLES))
def test_each_refused_field_is_a_rejected_row_naming_it(name: str) -> None:
    got = parse_request_line(batch_line(body(**{name: REFUSED_SAMPLES[name]})), 3)
    assert isinstance(got, RejectedRow) and (got.line_no, got.custom_id, got.field) == (3, "r1", f"body.{name}")
    plain = parse_request_line(json.dumps({"custom_id": "p", "messages": USER, name: REFUSED_SAMPLES[name]}).encode(), 1)
    assert isinstance(plain, RejectedRow) and plain.field == name


def test_neutral_values_of_refused_fields_and_ignored_fields_pass_even_strict() -> None:
    neutral = {"tools": [], "tool_choice": "none", "functions": None, "function_call": "none", "logit_bias": {},
               "presence_penalty": 0, "frequency_penalty": 0.0, "modalities": ["text"], "audio": None, "n": 1,
               "moderation": None, "reasoning_effort": None, "verbosity": None, "web_search_options": None}
    plain = parse_request_line(batch_line(body()), 1)
    for fields in (neutral, IGNORED_SAMPLES):
        got = parse_request_line(batch_line(body(**fields)), 1, strict=True)
        assert isinstance(got, ChatRequest) and got.unknown_fields == () and got == plain
    assert isinstance(parse_request_line(batch_line(body(presence_penalty=False)), 1), RejectedRow)  # not 0 in JSON


def test_several_refused_fields_give_every_reason() -> None:
    got = parse_request_line(batch_line(body(functions=REFUSED_SAMPLES["functions"], function_call="auto")), 1)
    assert isinstance(got, RejectedRow) and got.field == "body.functions"
    assert got.reason.startswith("function calling is not supported, got [{") and "; body.function_call: " in got.reason
    bad_too = parse_request_line(batch_line(body(temperature=-1, verbosity="low")), 1)
    assert isinstance(bad_too, RejectedRow) and bad_too.field == "body.temperature"
    assert "; body.verbosity: verbosity is not supported" in bad_too.reason


def test_ingest_refuses_the_same_fields(tmp_path: Path) -> None:
    """The pipeline's ingest (its columnar reader sends such rows to the per-row parser) refuses what
    the reader refuses and keeps the rows whose fields change nothing."""
    import pyarrow.parquet as pq

    from kvbatch.ops.ingest.prompts import ingest

    lines = [batch_line(body(**{name: value}), custom_id=name) for name, value in REFUSED_SAMPLES.items()]
    lines += [batch_line(body(**IGNORED_SAMPLES), custom_id="ignored"), batch_line(body(), custom_id="plain")]
    write_lines(tmp_path / "in.jsonl", lines)
    ingest(str(tmp_path / "in.jsonl"), str(tmp_path / "p.parquet"), str(tmp_path / "r.parquet"))
    rejects = pq.read_table(tmp_path / "r.parquet").to_pylist()
    assert [(r["custom_id"], r["field"]) for r in rejects] == [(n, f"body.{n}") for n in REFUSED_SAMPLES]
    assert pq.read_table(tmp_path / "p.parquet").column("custom_id").to_pylist() == ["ignored", "plain"]
