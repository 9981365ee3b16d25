"""``echo`` on ``/v1/completions`` rows (issue 42): OpenAI's legacy semantics, each choice's ``text``
is the prompt's text followed by the completion (a prompt of token ids echoes their decoding).

Pinned: the reader accepts ``echo`` (strictly a boolean) and refuses ``echo`` with ``logprobs`` as a
400 naming both (the engine computes no prompt logprobs); ``echo`` stays out of the engine's
sampling parameters, so the response cache keys the row as the same row without it and serves one
from the other; ``kvbatch generate``, ``kvbatch serve``'s run and ``kvbatch prefill`` + ``decode``
(the manifest line carries the text) answer with the prompt before every choice's text and the
usage of the row without echo; a manifest line's ``echo`` is checked like any other field; the
prompts table keeps no ``echo`` (the pipeline's results table holds the answer as generated).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvbatch.engine.models.weights import load_checkpoint
from kvbatch.engine.runtime.llm import LLM
from kvbatch.engine.spec import EngineSpec
from kvbatch.io.batch_requests import ChatRequest, RejectedRow, parse_request_line
from kvbatch.io.endpoints import ECHO_WITH_LOGPROBS
from kvbatch.io.kvstore.store import KVStore, KVStoreConfig
from kvbatch.io.prompt_table import record_request, request_record
from kvbatch.ops.decode.generate import run_batch, run_decode
from kvbatch.ops.decode.response_cache import ResponseCache, row_key
from kvbatch.ops.jobs import Job, Rejected, tokenize_request
from kvbatch.ops.prefill.manifests import manifest_jobs
from kvbatch.ops.prefill.prefill import run_prefill
from tests.test_n_choices import _llm  # the same engine settings (block size 16)
from tests.tiny_models import build_tiny_chat_model

BLOCK = 16
PROMPT = "Once upon a time, in a hardware store far away, the rope aisle"
IDS = [9, 10, 11, 12, 0, 13]  # 0 is a special token of SmolLM2's tokenizer: echoed as written


@pytest.fixture(scope="module")
def tiny_chat(tmp_path_factory) -> Path:
    return build_tiny_chat_model(tmp_path_factory.mktemp("echo_model"), max_positions=256)


@pytest.fixture(scope="module")
def llm(tiny_chat) -> LLM:
    return _llm(tiny_chat)


def _row(cid: str, **body: Any) -> dict[str, Any]:
    return {"custom_id": cid, "method": "POST", "url": "/v1/completions", "body": {"max_tokens": 6, **body}}


def _read(body: dict[str, Any], **kw: Any) -> ChatRequest | RejectedRow:
    return parse_request_line(json.dumps(_row("r", **body)).encode(), 3, **kw)


def _write(path: Path, rows: list[dict[str, Any]]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _bodies(path: Path) -> dict[str, dict[str, Any]]:
    return {o["custom_id"]: o["response"]["body"] for o in map(json.loads, path.read_text().splitlines())}


def _texts(body: dict[str, Any]) -> list[str]:
    return [c["text"] for c in body["choices"]]


# The rows every run below answers: each echoed row beside the same row without echo.
ROWS = [
    _row("plain", prompt=PROMPT, temperature=0),
    _row("echo", prompt=PROMPT, temperature=0, echo=True),
    _row("n-plain", prompt=PROMPT, temperature=1.0, seed=5, n=3),
    _row("n-echo", prompt=PROMPT, temperature=1.0, seed=5, n=3, echo=True),
    _row("ids-plain", prompt=[IDS], temperature=0),
    _row("ids-echo", prompt=[IDS], temperature=0, echo=True),
    _row("both", prompt=PROMPT, echo=True, logprobs=0),
]


def _assert_echoed(bodies: dict[str, dict[str, Any]], ids_text: str) -> None:
    for plain, echo, prompt in (("plain", "echo", PROMPT), ("n-plain", "n-echo", PROMPT),
                                ("ids-plain", "ids-echo", ids_text)):
        assert _texts(bodies[echo]) == [prompt + t for t in _texts(bodies[plain])], echo
        assert bodies[echo]["usage"] == bodies[plain]["usage"]  # the prompt once, the generated tokens only
        assert [c["finish_reason"] for c in bodies[echo]["choices"]] == [
            c["finish_reason"] for c in bodies[plain]["choices"]]
    assert len(_texts(bodies["n-echo"])) == 3 and len(set(_texts(bodies["n-echo"]))) == 3  # every choice echoed


# ---------------------------------------------------------------- reading


def test_echo_is_read_as_an_output_field_outside_sampling() -> None:
    on, off = _read({"prompt": "x", "echo": True}, strict=True), _read({"prompt": "x"}, strict=True)
    assert isinstance(on, ChatRequest) and isinstance(off, ChatRequest)
    assert on.echo is True and off.echo is False
    assert on.sampling == off.sampling  # the engine runs the same request
    assert _read({"prompt": "x", "echo": False}).echo is False and _read({"prompt": "x", "echo": None}).echo is False
    assert _read({"prompt": "x", "echo": True, "logprobs": None}).echo is True


@pytest.mark.parametrize("logprobs", [0, 3])
def test_echo_with_logprobs_is_a_400_naming_both(logprobs: int) -> None:
    got = _read({"prompt": "x", "echo": True, "logprobs": logprobs})
    assert isinstance(got, RejectedRow) and got.field == "body.echo" and got.reason == ECHO_WITH_LOGPROBS
    assert "logprobs" in got.reason and "echo" in got.reason
    assert isinstance(_read({"prompt": "x", "echo": False, "logprobs": logprobs}), ChatRequest)


def test_echo_must_be_a_boolean() -> None:
    got = _read({"prompt": "x", "echo": "yes"})
    assert isinstance(got, RejectedRow) and got.field == "body.echo" and "valid boolean" in got.reason


# ---------------------------------------------------------------- jobs, cache key, prompts table


def test_a_job_carries_the_prompt_text_and_keys_as_the_row_without_echo(llm) -> None:
    tok = llm.tokenizer
    text = tokenize_request(tok, 256, 0, _read({"prompt": PROMPT, "echo": True, "temperature": 0}))
    same = tokenize_request(tok, 256, 0, _read({"prompt": PROMPT, "temperature": 0}))
    ids = tokenize_request(tok, 256, 0, _read({"prompt": IDS, "echo": True}))
    assert isinstance(text, Job) and isinstance(same, Job) and isinstance(ids, Job)
    assert text.echo == PROMPT and same.echo is None  # as written: not the decoding of its ids (a BOS...)
    assert ids.echo == tok.decode(IDS, skip_special_tokens=False) != tok.decode(IDS)
    assert (text.prompt_token_ids, text.sampling) == (same.prompt_token_ids, same.sampling)
    assert row_key("e", text.prompt_token_ids, text.sampling) == row_key("e", same.prompt_token_ids, same.sampling)


def test_the_prompts_table_keeps_no_echo() -> None:
    on, off = _read({"prompt": PROMPT, "echo": True}), _read({"prompt": PROMPT})
    assert request_record(on) == request_record(off) and record_request(request_record(on)) == off


# ---------------------------------------------------------------- answered, end to end


@pytest.mark.slow
def test_generate_puts_the_prompt_before_every_choice(llm, tmp_path) -> None:
    out = tmp_path / "out.jsonl"
    report = run_batch(llm, _write(tmp_path / "in.jsonl", ROWS), str(out))
    assert (report.succeeded, report.rejected) == (6, 1)
    lines = {o["custom_id"]: o for o in map(json.loads, out.read_text().splitlines())}
    assert lines["both"]["error"]["field"] == "body.echo"
    bodies = {c: o["response"]["body"] for c, o in lines.items() if c != "both"}
    _assert_echoed(bodies, llm.tokenizer.decode(IDS, skip_special_tokens=False))
    assert not _texts(bodies["plain"])[0].startswith(PROMPT)  # the control: the answer alone


@pytest.mark.slow
def test_the_response_cache_serves_an_echo_row_from_the_row_without_it(llm, tmp_path) -> None:
    cache = ResponseCache.for_llm(str(tmp_path / "rc"), llm)
    run_batch(llm, _write(tmp_path / "a.jsonl", [ROWS[0]]), str(tmp_path / "a.out"), response_cache=cache)
    cache.flush()
    again = ResponseCache.for_llm(str(tmp_path / "rc"), llm)
    run_batch(llm, _write(tmp_path / "b.jsonl", [ROWS[1]]), str(tmp_path / "b.out"), response_cache=again)
    assert (again.stats.hits, again.stats.misses) == (1, 0)  # one entry: the engine's answer
    plain = _texts(_bodies(tmp_path / "a.out")["plain"])
    assert _texts(_bodies(tmp_path / "b.out")["echo"]) == [PROMPT + t for t in plain]


@pytest.mark.slow
def test_a_serve_run_echoes(llm, tmp_path) -> None:
    from kvbatch.pipelines.batch_api import run_batch_parts

    run_batch_parts(llm, _write(tmp_path / "in.jsonl", ROWS), str(tmp_path / "w"), model_name="m")
    lines = {o["custom_id"]: o for p in sorted((tmp_path / "w").glob("part-*"))
             for o in map(json.loads, p.read_text().splitlines())}
    assert lines["both"]["error"] is not None
    _assert_echoed({c: o["response"]["body"] for c, o in lines.items() if c != "both"},
                   llm.tokenizer.decode(IDS, skip_special_tokens=False))


def _kv_store(folder: Path, url: str) -> KVStore:
    fp = EngineSpec(dtype="fp32", block_size=BLOCK).kv_fingerprint(load_checkpoint(str(folder)).fingerprint)
    return KVStore.from_config(KVStoreConfig(url=url, memory_bytes=0), fp)


@pytest.mark.slow
def test_prefill_then_decode_echoes_through_the_manifest(tiny_chat, tmp_path) -> None:
    src, manifests = _write(tmp_path / "in.jsonl", ROWS), str(tmp_path / "m.jsonl")
    run_prefill(_llm(tiny_chat, _kv_store(tiny_chat, str(tmp_path / "kv"))), src, manifests)
    lines = {m["custom_id"]: m for m in map(json.loads, Path(manifests).read_text().splitlines())}
    decoder = _llm(tiny_chat, _kv_store(tiny_chat, str(tmp_path / "kv")))
    ids_text = decoder.tokenizer.decode(IDS, skip_special_tokens=False)
    assert (lines["echo"]["echo"], lines["ids-echo"]["echo"], "echo" in lines["plain"]) == (PROMPT, ids_text, False)
    # A line altered after prefill: echo on a row that cannot have it is that row's 400.
    chat = dict(lines["echo"], endpoint="/v1/chat/completions")
    logprobs = dict(lines["echo"], sampling=dict(lines["echo"]["sampling"], logprobs=1))
    bad = list(manifest_jobs(decoder, [chat, logprobs, dict(lines["echo"], echo=5)]))
    assert [(type(j).__name__, j.row.field) for j in bad] == [("Rejected", "manifest.echo")] * 3
    assert isinstance(bad[0], Rejected)

    out = tmp_path / "d.jsonl"
    run_decode(decoder, manifests, str(out))
    _assert_echoed({c: b for c, b in _bodies_or_errors(out).items() if c != "both"}, ids_text)


def _bodies_or_errors(path: Path) -> dict[str, dict[str, Any]]:
    return {o["custom_id"]: o["response"]["body"] if o["error"] is None else o["error"]
            for o in map(json.loads, path.read_text().splitlines())}
