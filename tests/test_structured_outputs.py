"""Structured outputs: ``response_format`` json_schema (strict and not) and json_object decoded
under llguidance's grammar masks, on a tiny random chat model that speaks SmolLM2's tokenizer.

Random weights mean the model has no idea what JSON is: every valid answer below is the mask's
doing. Pinned: every row parses and validates (greedy and seeded sampling), a schema that cannot
compile (or compiles too slowly) is a per-row 400 naming the problem while the other rows
succeed, the mask is exactly as wide as the logits, a mask that allows nothing ends its row
with an error (no NaN, the batch goes on), compiled grammars are cached by schema, constrained
rows stay valid under speculative decoding, and ``kvbatch generate`` and the pipeline's stages
(ingest, shards, prefill, decode) honour it end to end.
"""

from __future__ import annotations

import json
from pathlib import Path

import llguidance
import jsonschema
import pytest
import torch

from kvbatch.cli.main import main
from kvbatch.engine import LLM, GenerationRequest, SamplingParams
from kvbatch.engine.runtime.grammar_mask import apply_token_bitmask, fill_token_bitmask
from kvbatch.engine.speculative.controller import SpecConfig
from kvbatch.engine.text import structured
from kvbatch.io.batch_requests import ChatRequest, RejectedRow, parse_request_line, parse_response_format
from kvbatch.ops.decode.loop import Answered, DecodeLoop, Refused
from kvbatch.ops.decode.report import BatchReport
from kvbatch.ops.jobs import Job
from tests.tiny_models import build_tiny_chat_model

SCHEMAS = {
    "enum": {"type": "object", "properties": {"label": {"enum": ["positive", "negative", "neutral"]}},
             "required": ["label"], "additionalProperties": False},
    "int_range": {"type": "object", "properties": {"stars": {"type": "integer", "minimum": 1, "maximum": 5}},
                  "required": ["stars"], "additionalProperties": False},
    "array_bounds": {"type": "object", "properties": {"tags": {
        "type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 1, "maxItems": 3}},
        "required": ["tags"], "additionalProperties": False},
    "bool_number": {"type": "object", "properties": {"ok": {"type": "boolean"},
                                                     "score": {"type": "integer", "minimum": -9, "maximum": 9}},
                    "required": ["ok", "score"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {
        "person": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                                    "age": {"type": "integer", "minimum": 0, "maximum": 120}},
                   "required": ["name", "age"], "additionalProperties": False},
        "kind": {"enum": ["a", "b"]}}, "required": ["person", "kind"], "additionalProperties": False},
}
MESSAGES = [{"role": "user", "content": "Classify: the food was great."}]


@pytest.fixture(scope="module")
def tiny_chat(tmp_path_factory) -> Path:
    return build_tiny_chat_model(tmp_path_factory.mktemp("tiny_chat_structured"), max_positions=512)


@pytest.fixture(scope="module")
def llm(tiny_chat) -> LLM:
    return LLM(str(tiny_chat))


def _schema_format(schema: dict, strict: bool = True) -> str:
    rf = parse_response_format({"type": "json_schema", "json_schema": {"name": "x", "schema": schema,
                                                                        "strict": strict}})
    assert isinstance(rf, str)
    return rf


def _req(rid: str, rf: str | None, temperature: float = 0.0, seed: int | None = None, max_tokens: int = 96):
    return GenerationRequest(rid, SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed,
                                                 response_format=rf), messages=MESSAGES)


def test_schema_rows_parse_and_validate_greedy_and_sampled(llm):
    reqs, expect = [], {}
    for name, schema in SCHEMAS.items():
        for strict in (True, False):
            for temperature, seed in ((0.0, None), (1.0, 7)):
                rid = f"{name}-{strict}-{temperature}"
                reqs.append(_req(rid, _schema_format(schema, strict), temperature, seed))
                expect[rid] = schema
    reqs.append(_req("free", None, max_tokens=8))
    for r in llm.generate(reqs):
        if r.request_id == "free":
            assert r.error is None and r.finish_reason == "length"
            continue
        assert r.error is None and r.finish_reason == "stop", (r.request_id, r.text)
        jsonschema.validate(json.loads(r.text), expect[r.request_id])


def test_json_object_rows_are_json_objects(llm):
    """A random model wanders inside strings, so some seeded rows hit max_tokens; every token of
    every row is still one the grammar accepts, and every row that ends is a JSON object."""
    rf = parse_response_format({"type": "json_object"})
    results = llm.generate([_req(f"s{s}", rf, temperature=1.0, seed=s, max_tokens=48) for s in range(8)])
    lltok = llm.grammars.lltokenizer
    stopped = 0
    for r in results:
        assert r.error is None
        m = llguidance.LLMatcher(lltok, structured.grammar_of(rf), log_level=0)
        body = r.output_token_ids[:-1] if r.finish_reason == "stop" else r.output_token_ids
        assert m.consume_tokens(body), r.text
        if r.finish_reason == "stop":
            stopped += 1
            assert isinstance(json.loads(r.text), dict)
    assert stopped >= 1


def test_grammar_cache_compiles_once_per_schema(tiny_chat):
    llm = LLM(str(tiny_chat))
    formats = [_schema_format(SCHEMAS[n]) for n in ("enum", "int_range", "bool_number")]
    for _ in range(2):  # a second batch with the same schemas compiles nothing
        results = llm.generate([_req(f"r{i}", formats[i % 3], max_tokens=32) for i in range(12)])
        assert all(r.error is None for r in results)
    assert llm.grammars.compiles == 3


def test_uncompilable_schema_is_a_row_error_and_other_rows_succeed(llm):
    bad = _schema_format({"type": "frobnicate"})
    problem = structured.schema_error(bad)
    assert problem is not None and "cannot be compiled" in problem and "frobnicate" in problem
    assert structured.schema_error(_schema_format(SCHEMAS["enum"])) is None
    # The engine's own backstop (rows that skipped the tokenizing step's check): a per-row error.
    results = {r.request_id: r for r in llm.generate([_req("bad", bad), _req("good", _schema_format(SCHEMAS["enum"])),
                                                      _req("free", None, max_tokens=4)])}
    assert results["bad"].finish_reason == "error" and "frobnicate" in results["bad"].error
    assert results["good"].error is None and json.loads(results["good"].text)["label"]
    assert results["free"].error is None


def test_strict_refuses_unimplemented_keywords_and_non_strict_ignores_them():
    schema = {"type": "object", "properties": {"x": {"type": "string", "format": "no-such-format"}}}
    assert structured.schema_error(_schema_format(schema, strict=True)) is not None
    assert structured.schema_error(_schema_format(schema, strict=False)) is None


def test_slow_compile_is_refused(monkeypatch):
    assert structured.COMPILE_TIME_LIMIT_S == 2.0
    monkeypatch.setattr(structured, "COMPILE_TIME_LIMIT_S", 0.0)
    problem = structured.schema_error(_schema_format({"type": "object", "properties": {"slow": {"type": "integer"}}}))
    assert problem is not None and "over the 0s limit" in problem


def test_mask_is_as_wide_as_the_logits():
    tok_vocab = 70  # three words, the last one partial
    bitmask = torch.zeros(2, 3, dtype=torch.int32)
    bitmask[0, 0] = 1 << 5  # row 0 allows token 5
    bitmask[1, 2] = 1 << 4  # row 1 allows token 68 only
    wide = torch.zeros(2, 128)
    wide[:, 96:] = 1e9  # ids past the tokenizer's vocabulary (a padded embedding) would win
    out = apply_token_bitmask(wide, bitmask)
    assert out.argmax(1).tolist() == [5, 68]
    assert torch.isinf(out[:, 96:]).all()
    narrow = apply_token_bitmask(torch.zeros(2, 64), bitmask)  # bits past the logits are dropped
    assert narrow.shape == (2, 64) and torch.isfinite(narrow[0, 5]) and torch.isinf(narrow[1]).all()
    assert tok_vocab <= 3 * 32


def test_vocab_wider_than_tokenizer_never_samples_extra_ids(tiny_chat, monkeypatch):
    llm = LLM(str(tiny_chat))
    real = llm.runner.execute
    extra = 64

    def wider(step):  # the model's vocabulary padded past the tokenizer's, the extra ids favoured
        logits, sampled = real(step)
        pad = torch.full((logits.shape[0], extra), 1e4, dtype=logits.dtype, device=logits.device)
        return torch.cat([logits, pad], dim=1), sampled

    monkeypatch.setattr(llm.runner, "execute", wider)
    rf = _schema_format(SCHEMAS["nested"])
    for r in llm.generate([_req("g", rf), _req("s", rf, temperature=1.0, seed=3)]):
        assert r.error is None and max(r.output_token_ids) < llm.tokenizer.vocab_size
        jsonschema.validate(json.loads(r.text), SCHEMAS["nested"])


def test_mask_that_allows_nothing_ends_the_row_with_an_error(tiny_chat, monkeypatch):
    llm = LLM(str(tiny_chat))
    real = llm.runner.execute

    def narrow(step):  # a model vocabulary of 100 ids: no token that starts a JSON object ('{' is 107)
        logits, sampled = real(step)
        return logits[:, :100].contiguous(), sampled

    monkeypatch.setattr(llm.runner, "execute", narrow)
    rf = _schema_format(SCHEMAS["enum"])
    results = {r.request_id: r for r in llm.generate([_req("g", rf), _req("s", rf, temperature=1.0, seed=1),
                                                      _req("free", None, max_tokens=5)])}
    for rid in ("g", "s"):
        assert results[rid].finish_reason == "error" and "allows no token" in results[rid].error
        assert results[rid].output_token_ids == []
    assert results["free"].error is None and len(results["free"].output_token_ids) == 5


@pytest.mark.parametrize("with_cache", [False, True])
def test_decode_loop_turns_a_grammar_error_into_a_rejected_row(tiny_chat, monkeypatch, tmp_path, with_cache):
    """Every answering path runs the decode loop: a row the grammar ended is a per-row 400
    (field ``body.response_format``) in its place, counted as rejected; the other rows answer.
    With the response cache too (the refused row is not stored)."""
    llm = LLM(str(tiny_chat))
    real = llm.runner.execute
    def narrow(step):
        logits, sampled = real(step)
        return logits[:, :100].contiguous(), sampled

    monkeypatch.setattr(llm.runner, "execute", narrow)
    prompt = llm.tokenizer.encode_chat(MESSAGES)
    jobs = [Job(0, "c", 1, prompt, SamplingParams(max_tokens=8, temperature=0.0,
                                                  response_format=_schema_format(SCHEMAS["enum"]))),
            Job(1, "f", 2, prompt, SamplingParams(max_tokens=3, temperature=0.0))]
    report = BatchReport()
    cache = None
    if with_cache:
        from kvbatch.ops.decode.response_cache import ResponseCache

        cache = ResponseCache.for_llm(str(tmp_path / "responses"), llm)
    loop = DecodeLoop(llm, jobs, report, response_cache=cache) if cache is not None else DecodeLoop(llm, jobs, report)
    out = {(o.job.index if isinstance(o, Answered) else o.index): o for o in loop}
    assert isinstance(out[0], Refused) and out[0].row.field == "body.response_format"
    assert out[0].row.custom_id == "c" and "allows no token" in out[0].row.reason
    assert isinstance(out[1], Answered) and out[1].result.error is None
    assert report.rejected == 1 and report.rejects_by_field == {"body.response_format": 1}


def test_fill_reports_empty_rows_and_reopens_them(llm):
    rf = _schema_format(SCHEMAS["enum"])
    m, err = llm._grammar_matcher(rf)
    assert err is None and m is not None
    bitmask, empty = fill_token_bitmask([m, None], llm.grammars.vocab_size, 100)
    assert empty == [0] and (bitmask == -1).all()
    bitmask, empty = fill_token_bitmask([m, None], llm.grammars.vocab_size, llm.grammars.vocab_size)
    assert empty == [] and (bitmask[1] == -1).all() and (bitmask[0] != -1).any()


def test_speculative_decoding_keeps_constrained_rows_valid(tiny_chat):
    """Constrained rows draft too, their drafts checked against the grammar (tests/test_grammar_drafts.py
    pins the details): greedy answers equal plain decoding's, sampled ones validate."""
    llm = LLM(str(tiny_chat), speculative=SpecConfig("ngram", max_len=4, adaptive=False))
    rf = _schema_format(SCHEMAS["array_bounds"])
    results = {r.request_id: r for r in llm.generate([_req("c", rf), _req("cs", rf, temperature=1.0, seed=2),
                                                      _req("free", None, max_tokens=24)])}
    for rid in ("c", "cs"):
        assert results[rid].error is None and results[rid].spec_target_steps > 0
        jsonschema.validate(json.loads(results[rid].text), SCHEMAS["array_bounds"])
    (plain,) = LLM(str(tiny_chat)).generate([_req("c", rf)])
    assert results["c"].output_token_ids == plain.output_token_ids
    assert results["free"].error is None


def test_response_format_parsing():
    def line(rf):
        return json.dumps({"custom_id": "x", "method": "POST", "url": "/v1/chat/completions",
                           "body": {"messages": MESSAGES, "response_format": rf}}).encode()

    text = parse_request_line(line({"type": "text"}), 1)
    assert isinstance(text, ChatRequest) and text.sampling.response_format is None and not text.unknown_fields
    obj = parse_request_line(line({"type": "json_object"}), 1, strict=True)  # a known field, even under --strict
    assert isinstance(obj, ChatRequest) and json.loads(obj.sampling.response_format) == {"type": "json_object"}
    a = parse_request_line(line({"type": "json_schema", "json_schema": {"name": "a", "strict": True,
                                                                        "schema": {"type": "object", "required": []}}}), 1)
    b = parse_request_line(line({"type": "json_schema", "json_schema": {"schema": {"required": [], "type": "object"},
                                                                        "strict": True, "name": "b"}}), 1)
    assert a.sampling.response_format == b.sampling.response_format  # one spelling per schema: one cache key
    for rf, field in (({"type": "yaml"}, "body.response_format.type"),
                      ({"type": "json_schema"}, "body.response_format.json_schema"),
                      ({"type": "json_schema", "json_schema": {"schema": []}}, "body.response_format.json_schema.schema"),
                      ({"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}},
                       "body.response_format.json_schema.strict"),
                      ("json", "body.response_format")):
        got = parse_request_line(line(rf), 1)
        assert isinstance(got, RejectedRow) and got.field == field, (rf, got)


def test_ingest_rejects_uncompilable_schemas_checking_each_distinct_format_once(tmp_path, monkeypatch):
    """The pipeline's ingest refuses a schema llguidance cannot compile (a per-row reject naming
    ``body.response_format.json_schema.schema``), and asks the grammar engine once per distinct
    format, not per row: 300 constrained rows over three formats compile three grammars."""
    from collections import OrderedDict

    import pyarrow.parquet as pq

    from kvbatch.ops.ingest.prompts import SCHEMA_FIELD, ingest

    monkeypatch.setattr(structured, "_checked", OrderedDict())  # no answer kept from another test
    built: list[str] = []
    real_grammar_of = structured.grammar_of

    def counting_grammar_of(rf: str) -> str:
        built.append(rf)
        return real_grammar_of(rf)

    monkeypatch.setattr(structured, "grammar_of", counting_grammar_of)
    formats = [{"type": "json_schema", "json_schema": {"name": "a", "strict": True, "schema": SCHEMAS["enum"]}},
               {"type": "json_schema", "json_schema": {"name": "b", "schema": SCHEMAS["nested"]}},
               {"type": "json_schema", "json_schema": {"name": "bad", "strict": True,
                                                       "schema": {"type": "frobnicate"}}}]
    lines = []
    for i in range(300):
        lines.append(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
                                 "body": {"messages": MESSAGES, "response_format": formats[i % 3]}}))
        lines.append(json.dumps({"custom_id": f"f{i}", "messages": MESSAGES}))
    lines += [json.dumps({"custom_id": "yaml", "messages": MESSAGES, "response_format": {"type": "yaml"}}),
              json.dumps({"custom_id": "list", "messages": MESSAGES,
                          "response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}})]
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(lines) + "\n")
    report = ingest(str(src), str(tmp_path / "prompts.parquet"), str(tmp_path / "rejects.parquet"))
    assert len(built) == 3 and len(set(built)) == 3
    rejects = pq.read_table(tmp_path / "rejects.parquet").to_pylist()
    malformed = {r["custom_id"]: r for r in rejects if r["custom_id"] in ("yaml", "list")}
    assert malformed["yaml"]["field"] == "response_format.type" and "'json_schema'" in malformed["yaml"]["reason"]
    assert malformed["list"]["field"] == "response_format.json_schema.schema"
    bad = [r for r in rejects if r["field"] == SCHEMA_FIELD]
    assert [r["custom_id"] for r in bad] == [f"c{i}" for i in range(2, 300, 3)]
    assert all("the JSON schema cannot be compiled: Invalid type: frobnicate" in r["reason"] for r in bad)
    free = [r["custom_id"] for r in pq.read_table(tmp_path / "prompts.parquet").to_pylist()
            if r["custom_id"].startswith("f")]
    assert free == [f"f{i}" for i in range(300)] and report.rows == 602


def test_generate_end_to_end_mixes_constrained_and_free_rows(tiny_chat, tmp_path):
    def row(cid, **body):
        body = {"model": "gpt-4o-mini", "messages": MESSAGES, "max_tokens": 96, "temperature": 0, **body}
        return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": body})

    def schema_rf(schema, strict=True):
        return {"type": "json_schema", "json_schema": {"name": "out", "strict": strict, "schema": schema}}

    lines = [
        row("enum", response_format=schema_rf(SCHEMAS["enum"])),
        row("free", max_tokens=6),
        row("nested", response_format=schema_rf(SCHEMAS["nested"], strict=False)),
        row("bad", response_format=schema_rf({"type": "frobnicate"})),
        row("sampled", temperature=1.0, seed=11, response_format=schema_rf(SCHEMAS["bool_number"])),
        row("obj", temperature=1.0, seed=1, max_tokens=48, response_format={"type": "json_object"}),
        row("text", max_tokens=4, response_format={"type": "text"}),
    ]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(lines) + "\n")
    code = main(["generate", "--model", str(tiny_chat), "--input", str(src), "--output", str(out), "--no-progress",
                 "--strict"])
    got = {o["custom_id"]: o for o in map(json.loads, out.read_text().splitlines())}
    assert code == 1 and list(got) == ["enum", "free", "nested", "bad", "sampled", "obj", "text"]
    assert got["bad"]["response"]["status_code"] == 400
    assert got["bad"]["error"]["field"] == "body.response_format.json_schema.schema"
    assert "the JSON schema cannot be compiled: Invalid type: frobnicate" in got["bad"]["error"]["message"]
    for cid, schema in (("enum", SCHEMAS["enum"]), ("nested", SCHEMAS["nested"]), ("sampled", SCHEMAS["bool_number"])):
        choice = got[cid]["response"]["body"]["choices"][0]
        assert choice["finish_reason"] == "stop"
        content = choice["message"]["content"]
        jsonschema.validate(json.loads(content), schema)
        assert json.dumps(json.loads(content), separators=(",", ":"), ensure_ascii=False) == content  # no spaces
    obj = got["obj"]["response"]["body"]["choices"][0]
    assert obj["finish_reason"] == "length" or isinstance(json.loads(obj["message"]["content"]), dict)
    for cid in ("free", "text"):
        assert got[cid]["error"] is None


@pytest.mark.slow
def test_pipeline_stages_decode_constrained_rows_under_their_grammar(tiny_chat, tmp_path):
    """A batch file written for OpenAI, constrained and free rows mixed in one shard, through the
    pipeline's stage functions (ingest, shards, prefill, decode of the shard): the format rides in
    the prompts and shards tables' ``response_format`` column (the canonical JSON, dictionary-encoded
    by Parquet, null for a free row), and every constrained row's answer parses and validates."""
    import pyarrow.parquet as pq

    from kvbatch.engine.runtime.engine_config import EngineConfig
    from kvbatch.engine.spec import EngineSpec
    from kvbatch.io.kvstore.store import KVStore, KVStoreConfig
    from kvbatch.io.shard_tables import read_table, shard_url
    from kvbatch.ops.decode.shard import decode_shard
    from kvbatch.ops.ingest.prompts import SCHEMA_FIELD, ingest
    from kvbatch.ops.prefill.prefill import prefill_shard
    from kvbatch.ops.shards.build import build_shards

    def row(cid, rf=None, **body):
        body = {"model": "gpt-4o-mini", "messages": MESSAGES, "max_tokens": 96, "temperature": 0, **body}
        if rf is not None:
            body["response_format"] = rf
        return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": body})

    def schema_rf(name, strict=True):
        return {"type": "json_schema", "json_schema": {"name": name, "strict": strict, "schema": SCHEMAS[name]}}

    expect = {}
    lines = []
    for i, name in enumerate(SCHEMAS):
        for strict in (True, False):
            cid = f"{name}-{strict}"
            lines += [row(cid, schema_rf(name, strict), **({"temperature": 1.0, "seed": i} if strict else {})),
                      row(f"free-{cid}", max_tokens=5)]
            expect[cid] = SCHEMAS[name]
    lines += [row("obj", {"type": "json_object"}, max_tokens=64), row("text", {"type": "text"}, max_tokens=4),
              row("bad", {"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "frobnicate"}}})]
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(lines) + "\n")
    prompts = str(tmp_path / "prompts.parquet")
    report = ingest(str(src), prompts, str(tmp_path / "rejects.parquet"))
    assert (report.valid, report.rejected) == (len(lines) - 1, 1)
    assert report.rejects_by_field == {SCHEMA_FIELD: 1}
    table = pq.read_table(prompts)
    formats = dict(zip(table.column("custom_id").to_pylist(), table.column("response_format").to_pylist(),
                       strict=True))
    assert {cid for cid, rf in formats.items() if rf is not None} == {*expect, "obj"}
    assert json.loads(formats["enum-True"])["schema"] == SCHEMAS["enum"]  # the canonical JSON of the format
    group = pq.ParquetFile(prompts).metadata.row_group(0)
    chunk = next(group.column(i) for i in range(group.num_columns) if group.column(i).path_in_schema == "response_format")
    assert "RLE_DICTIONARY" in chunk.encodings  # each distinct format stored once per row group

    llm = LLM(str(tiny_chat), engine_config=EngineConfig(batch_invariant=True, max_num_seqs=8))
    root = str(tmp_path / "out")
    shards = build_shards(llm, prompts, root, 1, rejects_url=str(tmp_path / "shard_rejects.parquet"))
    assert shards.tokenized == len(lines) - 1
    shard_table = read_table(shard_url(root, "shards", "0000"))
    assert dict(zip(shard_table.column("custom_id").to_pylist(), shard_table.column("response_format").to_pylist(),
                    strict=True)) == formats
    fp = EngineSpec(dtype="fp32", block_size=16).kv_fingerprint(llm.checkpoint.fingerprint)
    store = KVStore.from_config(KVStoreConfig(url=str(tmp_path / "kv"), memory_bytes=0), fp)
    manifests = shard_url(root, "manifests", "0000", "manifests.jsonl")
    prefill_shard(LLM(str(tiny_chat), engine_config=EngineConfig(batch_invariant=True, max_num_seqs=8),
                      kv_store=store), shard_url(root, "shards", "0000"), manifests)
    results_url = shard_url(root, "results", "0000")
    stats = decode_shard(LLM(str(tiny_chat), engine_config=EngineConfig(batch_invariant=True, max_num_seqs=8),
                             kv_store=store), manifests, results_url)
    assert stats["succeeded"] == len(lines) - 1
    results = {r["custom_id"]: r for r in read_table(results_url).to_pylist()}
    for cid, schema in expect.items():
        assert results[cid]["finish_reason"] == "stop", (cid, results[cid]["text"])
        jsonschema.validate(json.loads(results[cid]["text"]), schema)
    assert results["obj"]["finish_reason"] == "stop" and isinstance(json.loads(results["obj"]["text"]), dict)
    for cid in results:  # the free rows decode as before: free text up to max_tokens
        if cid.startswith("free-") or cid == "text":
            assert results[cid]["finish_reason"] == "length"


def test_ingest_parquet_response_format_column_holds_the_object_or_its_json_text(tmp_path):
    """A Parquet dataset's ``response_format`` column: JSON text (how a table holds a schema) becomes
    the canonical format; text that is not JSON, or a schema that cannot compile, is a reject."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from kvbatch.ops.ingest.prompts import SCHEMA_FIELD, ingest

    rf = {"type": "json_schema", "json_schema": {"name": "e", "strict": True, "schema": SCHEMAS["enum"]}}
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": ["a", "b", "c", "d"], "q": ["x", "y", "z", "w"],
                             "response_format": [json.dumps(rf), "{not json", None,
                                                 json.dumps({"type": "json_schema",
                                                             "json_schema": {"schema": {"type": "nope"}}})]}), src)
    ingest(str(src), str(tmp_path / "p.parquet"), str(tmp_path / "r.parquet"),
           columns={"custom_id": "id", "prompt": "q"})
    prompts = {r["custom_id"]: r["response_format"] for r in pq.read_table(tmp_path / "p.parquet").to_pylist()}
    assert prompts == {"a": _schema_format(SCHEMAS["enum"]), "c": None}
    rejects = {r["custom_id"]: (r["field"], r["reason"]) for r in pq.read_table(tmp_path / "r.parquet").to_pylist()}
    assert rejects["b"][0] == "response_format" and rejects["b"][1].startswith("malformed JSON")
    assert rejects["d"][0] == SCHEMA_FIELD and "nope" in rejects["d"][1]
