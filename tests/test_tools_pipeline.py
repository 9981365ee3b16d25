"""Tool rows through the pipeline's steps (ingest, shards, prefill, decode of a shard), on the tiny
random model with Qwen2.5's chat template of tests/test_tools.py: the prompts and shards tables carry
a row's tools (its ``response_format``) and its tool-call history (the message columns' ``tool_calls``
and ``tool_call_id``), the shard step renders both into the prompt exactly as ``kvbatch generate``
does, and the results table gives a ``tool_choice: required`` row's calls as ``tool_calls``."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kvbatch.engine.models.weights import load_tokenizer_source
from kvbatch.engine.text.tokenizer import ChatTokenizer
from kvbatch.io.batch_output import result_line
from kvbatch.io.batch_requests import ChatRequest, parse_request_line
from kvbatch.io.prompt_table import PROMPTS_SCHEMA, record_request, request_record
from kvbatch.ops.ingest.prompts import ingest
from kvbatch.ops.jobs import Job, tokenize_request
from kvbatch.ops.shards.build import RowTokenizer
from tests.test_tools import HISTORY, MESSAGES, SCHEMAS, TOOLS, build_qwen_tool_model

BAD_TOOLS = [{"type": "function", "function": {"name": "broken", "parameters": {"type": "frobnicate"}}}]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Path, Path]:
    """(the tiny model with Qwen2.5's template, a tokenizer-only folder with SmolLM2's own)."""
    smol = tmp_path_factory.mktemp("smol_tokenizer")
    return build_qwen_tool_model(tmp_path_factory.mktemp("qwen_tools"), smol), smol


def _line(cid: str, **body) -> str:
    body = {"model": "m", "messages": MESSAGES, "max_tokens": 8, "temperature": 0, **body}
    return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": body})


LINES = {
    "required": _line("required", tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=64),
    "history": _line("history", messages=HISTORY, tools=TOOLS, tool_choice="none"),
    "history-no-tools": _line("history-no-tools", messages=HISTORY),
    "plain": _line("plain"),
}


def _request(cid: str) -> ChatRequest:
    item = parse_request_line(LINES[cid].encode(), 1)
    assert isinstance(item, ChatRequest), item
    return item


def _generate_ids(tokenizer: ChatTokenizer, cid: str) -> list[int]:
    """The prompt ``kvbatch generate`` renders for the row (its tokenizing step, ops.jobs)."""
    job = tokenize_request(tokenizer, 4096, 0, _request(cid))
    assert isinstance(job, Job), job
    return job.prompt_token_ids


def test_prompt_table_keeps_tools_and_tool_call_history():
    for cid in LINES:
        req = _request(cid)
        table = pa.Table.from_pylist([request_record(req)], PROMPTS_SCHEMA)
        back = record_request(table.to_pylist()[0])
        assert back.messages == req.messages and back.sampling == req.sampling
    stored = pa.Table.from_pylist([request_record(_request(cid)) for cid in ("history", "plain")], PROMPTS_SCHEMA)
    history, plain = stored.column("messages").to_pylist()
    assert [(m["tool_calls"] is None, m["tool_call_id"]) for m in history] == [(True, None), (False, None),
                                                                               (True, "call_1")]
    assert json.loads(history[1]["tool_calls"]) == _request("history").messages[1]["tool_calls"]  # JSON text
    assert all(m["tool_calls"] is None and m["tool_call_id"] is None for m in plain)
    messages = record_request(stored.to_pylist()[0]).messages
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris", "days": 3}


def test_shard_tokenizer_renders_tool_rows_as_generate_and_splices_plain_rows(models):
    qwen, smol = models
    table = pa.Table.from_pylist([request_record(_request(cid)) for cid in LINES], PROMPTS_SCHEMA)
    # Qwen2.5's template reads content (never spliced): every row per row, tools and calls rendered.
    tokenizer = ChatTokenizer.from_model(str(qwen))
    got = RowTokenizer(load_tokenizer_source(str(qwen)), 4096, "ab" * 32, 16).columnar().tokenize(table)
    assert got.ok.all()
    ids = got.take(list(range(len(LINES))))[0].to_pylist()
    assert ids == [_generate_ids(tokenizer, cid) for cid in LINES]
    assert ids[0] != _generate_ids(tokenizer, "plain")  # the tools are in the prompt
    # SmolLM2's template is spliced, and has no tool-call format: the plain row stays columnar and
    # the tool rows take the per-row path, which refuses them as generate does.
    got = RowTokenizer(load_tokenizer_source(str(smol)), 4096, "ab" * 32, 16).columnar().tokenize(table)
    assert got.ok.tolist() == [False, False, False, True] and got.fast_rows == 1
    assert [(r.custom_id, r.field) for r in got.rejects] == [
        ("required", "body.tools"), ("history", "body.tools"), ("history-no-tools", "body.messages")]
    assert all("no tool-call format" in r.reason for r in got.rejects)


def test_ingest_rejects_a_tool_whose_parameters_cannot_compile(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join([_line("bad", tools=BAD_TOOLS), LINES["history"]]) + "\n")
    report = ingest(str(src), str(tmp_path / "prompts.parquet"), str(tmp_path / "rejects.parquet"))
    assert (report.valid, report.rejected) == (1, 1)
    (bad,) = pq.read_table(tmp_path / "rejects.parquet").to_pylist()
    assert bad["field"] == "body.tools.0.function.parameters" and "'broken'" in bad["reason"]


def test_ingest_parquet_carries_tools_rows(tmp_path):
    """A Parquet night's ``tools`` (JSON text), ``tool_choice`` (a mode, or a named
    function as JSON text) and ``parallel_tool_calls`` columns: each row's prompts-table record is the
    one its JSONL chat row gives; tools that are not JSON, or cannot compile, are rejects naming them."""
    named = {"type": "function", "function": {"name": "get_time"}}
    rows = [("required", json.dumps(TOOLS), "required", False), ("named", json.dumps(TOOLS), json.dumps(named), None),
            ("auto", json.dumps(TOOLS), None, None), ("plain", None, None, None),
            ("not-json", "[{oops", "auto", None), ("broken", json.dumps(BAD_TOOLS), None, None)]
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": [r[0] for r in rows], "q": [MESSAGES[0]["content"]] * len(rows),
                             "tools": [r[1] for r in rows], "tool_choice": [r[2] for r in rows],
                             "parallel_tool_calls": pa.array([r[3] for r in rows], pa.bool_()),
                             "model": ["m"] * len(rows), "max_tokens": [8] * len(rows),
                             "temperature": [0.0] * len(rows)}), src)
    report = ingest(str(src), str(tmp_path / "p.parquet"), str(tmp_path / "r.parquet"),
                    columns={"custom_id": "id", "prompt": "q"})
    assert (report.valid, report.rejected) == (4, 2)
    got = {r["custom_id"]: r for r in pq.read_table(tmp_path / "p.parquet").to_pylist()}
    for cid, tools, choice, parallel in rows[:4]:
        body = {k: v for k, v in (("tools", TOOLS if tools else None), ("parallel_tool_calls", parallel),
                                  ("tool_choice", named if cid == "named" else choice)) if v is not None}
        want = request_record(parse_request_line(_line(cid, **body).encode(), 1))
        assert {**got[cid], "row": 1} == want, cid
    assert got["required"]["response_format"] != got["auto"]["response_format"] != got["named"]["response_format"]
    assert got["plain"]["response_format"] is None
    rejects = {r["custom_id"]: (r["field"], r["reason"]) for r in pq.read_table(tmp_path / "r.parquet").to_pylist()}
    assert rejects["not-json"][0] == "tools" and rejects["not-json"][1].startswith("malformed JSON")
    assert rejects["broken"][0].endswith("tools.0.function.parameters") and "'broken'" in rejects["broken"][1]


CALL_W = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>'
CALL_T = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'


def test_results_row_keeps_every_choices_tool_calls():
    """A tools row of n choices: ``choices[i].tool_calls`` are choice i's calls with the ids of its output
    line's ``choices[i].message.tool_calls``; the top-level ``tool_calls`` stay choice 0's, as ``text`` is."""
    import dataclasses

    from kvbatch.engine.runtime.llm import Result
    from kvbatch.ops.decode.generate import answer_line
    from kvbatch.ops.decode.loop import Answered
    from kvbatch.ops.decode.shard import RESULTS_SCHEMA, results_row
    from kvbatch.ops.jobs import to_engine_sampling

    req = dataclasses.replace(_request("required"), n=3)
    job = Job(0, req.custom_id, req.line_no, [1, 2, 3], to_engine_sampling(req), n=3)
    texts = [CALL_W, CALL_W + "\n" + CALL_T, "no call, cut"]
    results = [Result(f"0.{i}", [1, 2, 3], [5] * (i + 1), t, "length" if i == 2 else "stop", 0, 0.0, None)
               for i, t in enumerate(texts)]
    answered = Answered(job, results, [False] * 3)
    row = results_row(answered)
    table = pa.Table.from_pylist([row], RESULTS_SCHEMA)  # the row fits the table's schema
    back = table.to_pylist()[0]
    assert [len(c["tool_calls"] or ()) for c in back["choices"]] == [1, 2, 0]
    assert back["choices"][2]["tool_calls"] is None  # cut by max_tokens: text, as in the output line
    assert back["tool_calls"] == back["choices"][0]["tool_calls"]
    assert [c["name"] for c in back["choices"][1]["tool_calls"]] == ["get_weather", "get_time"]

    class _NoTokenizer:  # answer_line reads the engine for logprobs and drafts only
        tokenizer = None
        spec = None

    line = answer_line(_NoTokenizer(), answered, "m")  # the output line generate writes for the row
    for i, choice in enumerate(line["response"]["body"]["choices"]):
        calls = choice["message"].get("tool_calls")
        want = None if calls is None else [{"id": c["id"], **c["function"]} for c in calls]
        assert back["choices"][i]["tool_calls"] == want, i
    ids = [c["id"] for c in back["choices"][0]["tool_calls"] + back["choices"][1]["tool_calls"]]
    assert len(set(ids)) == 3  # each choice's calls have their own ids
    one = results_row(Answered(dataclasses.replace(job, n=1), results[:1], [False]))
    assert one["choices"] is None and len(one["tool_calls"]) == 1


@pytest.mark.slow
def test_pipeline_steps_answer_tool_rows_with_tool_calls(models, tmp_path):
    """A ``tool_choice: required`` row comes back with calls that validate against their tool's
    parameters; a row with a tool-call history is prefilled with the prompt generate renders."""
    from kvbatch.engine import LLM
    from kvbatch.engine.runtime.engine_config import EngineConfig
    from kvbatch.engine.spec import EngineSpec
    from kvbatch.io.kvstore.store import KVStore, KVStoreConfig
    from kvbatch.io.shard_tables import read_table, shard_url
    from kvbatch.ops.decode.shard import decode_shard
    from kvbatch.ops.prefill.prefill import prefill_shard
    from kvbatch.ops.shards.build import build_shards

    qwen = str(models[0])
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(LINES.values()) + "\n")
    prompts = str(tmp_path / "prompts.parquet")
    assert ingest(str(src), prompts, str(tmp_path / "rejects.parquet")).valid == len(LINES)

    def engine(store: KVStore | None = None) -> LLM:
        return LLM(qwen, engine_config=EngineConfig(batch_invariant=True, max_num_seqs=8), kv_store=store)

    llm = engine()
    shard_ids = {}
    for path in ("columnar", "rows"):
        root = str(tmp_path / path)
        built = build_shards(llm, prompts, root, 1, path=path, rejects_url=str(tmp_path / f"{path}-rejects.parquet"))
        assert built.tokenized == len(LINES)
        shard = read_table(shard_url(root, "shards", "0000"))
        shard_ids[path] = dict(zip(shard.column("custom_id").to_pylist(),
                                   shard.column("prompt_token_ids").to_pylist(), strict=True))
    assert shard_ids["columnar"] == shard_ids["rows"] == {cid: _generate_ids(llm.tokenizer, cid) for cid in LINES}

    root = str(tmp_path / "columnar")
    fp = EngineSpec(dtype="fp32", block_size=16).kv_fingerprint(llm.checkpoint.fingerprint)
    store = KVStore.from_config(KVStoreConfig(url=str(tmp_path / "kv"), memory_bytes=0), fp)
    manifests = shard_url(root, "manifests", "0000", "manifests.jsonl")
    prefill_shard(engine(store), shard_url(root, "shards", "0000"), manifests)
    results_url = shard_url(root, "results", "0000")
    assert decode_shard(engine(store), manifests, results_url)["succeeded"] == len(LINES)
    results = {r["custom_id"]: r for r in read_table(results_url).to_pylist()}
    required = results["required"]
    assert required["finish_reason"] == "stop" and len(required["tool_calls"]) == 1, required["text"]
    call = required["tool_calls"][0]
    assert call["id"].startswith("call_") and call["name"] in SCHEMAS
    jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
    assert f'"name": "{call["name"]}"' in required["text"]  # the text is the answer as generated
    line = result_line("required", required["row"], text=required["text"], finish_reason="stop", prompt_tokens=0,
                       completion_tokens=0, model="m", response_format=_request("required").sampling.response_format)
    message = line["response"]["body"]["choices"][0]["message"]  # the output line generate writes
    assert [{"id": c["id"], **c["function"]} for c in message["tool_calls"]] == required["tool_calls"]
    for cid in ("history", "history-no-tools", "plain"):  # no tools, or tool_choice none: text
        assert results[cid]["tool_calls"] is None
