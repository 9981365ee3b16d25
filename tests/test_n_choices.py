"""``n`` > 1: a row of n choices is n engine requests over one prompt, gathered into one answer.

Pinned: ``kvbatch generate`` answers a row of n choices with ``choices[i].index == i`` and usage
counting the prompt once and every choice's output; greedy choices are equal, seeded ones are
reproducible, differ from each other, and choice i is the row's answer under the seed derived from
(seed, i) (choice 0: the row's own); the prompt's full blocks are computed once (engine counters and
each choice's cached tokens); the prompts and shard tables and the manifests carry n, a decode of
stored KV loads each stored block once and answers as ``kvbatch generate``; the pipeline's results
table keeps one row per request (cost counts the prompt once); ``kvbatch serve``'s run and the
response cache (each choice under its own key); a choice ending in an error fails its row; n is
bounded (``MAX_CHOICES``) with a 400 naming ``body.n``; the columnar reader agrees with the per-row
parser on ``n``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from kvbatch.engine.models.weights import load_checkpoint
from kvbatch.engine.runtime.engine_config import EngineConfig
from kvbatch.engine.runtime.llm import LLM, Result
from kvbatch.engine.runtime.sampling_params import SamplingParams
from kvbatch.engine.spec import EngineSpec
from kvbatch.io.batch_requests import ChatRequest, RejectedRow, parse_request_line
from kvbatch.io.endpoints import MAX_CHOICES
from kvbatch.io.kvstore.store import KVStore, KVStoreConfig
from kvbatch.io.prompt_table import reject_record, request_record
from kvbatch.io.request_columns import parse_block
from kvbatch.ops.decode.generate import run_batch, run_decode, run_jobs
from kvbatch.ops.decode.loop import Answered, DecodeLoop, Refused
from kvbatch.ops.decode.report import BatchReport
from kvbatch.ops.decode.response_cache import ResponseCache
from kvbatch.ops.jobs import Job, choice_seed
from kvbatch.ops.prefill.manifests import manifest_jobs, read_manifests
from kvbatch.ops.prefill.prefill import run_prefill
from kvbatch.ops.results.cost import results_figures
from tests.tiny_models import build_tiny_chat_model

SYSTEM = "You answer questions about a hardware store in one short sentence, citing the aisle. " * 2
BLOCK = 16


@pytest.fixture(scope="module")
def tiny_chat(tmp_path_factory) -> Path:
    return build_tiny_chat_model(tmp_path_factory.mktemp("n_choices_model"), max_positions=256)


def _llm(folder: Path, store: KVStore | None = None) -> LLM:
    return LLM(load_checkpoint(str(folder)), engine_config=EngineConfig(max_num_seqs=8, block_size=BLOCK),
               kv_store=store)


@pytest.fixture(scope="module")
def llm(tiny_chat) -> LLM:
    """One engine for the tests without a KV store (each test's prompts are its own)."""
    return _llm(tiny_chat)


def _row(cid: str, question: str, url: str = "/v1/chat/completions", **body) -> str:
    if url == "/v1/completions":
        payload = {"prompt": SYSTEM + question, "max_tokens": 6, **body}
    else:
        payload = {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
                   "max_tokens": 6, **body}
    return json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": payload})


def _write(path: Path, rows: list[str]) -> str:
    path.write_text("\n".join(rows) + "\n")
    return str(path)


def _lines(path: Path) -> dict[str, dict]:
    return {o["custom_id"]: o for o in map(json.loads, path.read_text().splitlines())}


def _texts(line: dict) -> list[str]:
    choices = line["response"]["body"]["choices"]
    assert [c["index"] for c in choices] == list(range(len(choices)))
    return [c["message"]["content"] if "message" in c else c["text"] for c in choices]


def test_generate_n_choices_greedy_seeded_and_bounded(llm, tmp_path) -> None:
    seed = 1234
    rows = [_row("g1", "hammers?", temperature=0), _row("g3", "hammers?", temperature=0, n=3),
            _row("s1", "rope?", temperature=1.0, seed=seed), _row("s3", "rope?", temperature=1.0, seed=seed, n=3),
            *[_row(f"d{i}", "rope?", temperature=1.0, seed=choice_seed(seed, i)) for i in (1, 2)],
            _row("c2", "nails?", url="/v1/completions", temperature=1.0, seed=seed, n=2),
            _row("c1", "nails?", url="/v1/completions", temperature=1.0, seed=seed),
            _row("big", "x", n=MAX_CHOICES + 1)]
    report = run_batch(llm, _write(tmp_path / "in.jsonl", rows), str(tmp_path / "a.jsonl"))
    run_batch(llm, _write(tmp_path / "again.jsonl", [rows[3], rows[6]]), str(tmp_path / "b.jsonl"))
    a, b = _lines(tmp_path / "a.jsonl"), _lines(tmp_path / "b.jsonl")
    assert (report.succeeded, report.rejected) == (len(rows) - 1, 1)

    # Above the bound: the row's 400, naming body.n.
    assert a["big"]["error"]["field"] == "body.n" and a["big"]["response"]["status_code"] == 400
    assert a["big"]["error"]["message"].endswith(
        f"body.n: Input should be less than or equal to {MAX_CHOICES}, got {MAX_CHOICES + 1}")

    # Greedy: n equal answers, the n = 1 answer; usage counts the prompt once, the output n times.
    g1, g3 = a["g1"]["response"]["body"], a["g3"]["response"]["body"]
    assert _texts(a["g3"]) == _texts(a["g1"]) * 3
    assert g3["usage"]["prompt_tokens"] == g1["usage"]["prompt_tokens"]
    assert g3["usage"]["completion_tokens"] == 3 * g1["usage"]["completion_tokens"]
    assert g3["usage"]["total_tokens"] == g3["usage"]["prompt_tokens"] + g3["usage"]["completion_tokens"]

    # Seeded: reproducible from run to run (another batch around it); choice 0 is the row's own answer, choice i the answer under
    # the seed derived from (seed, i); the choices differ.
    s3 = _texts(a["s3"])
    assert s3 == _texts(b["s3"])
    assert s3 == [_texts(a["s1"])[0], _texts(a["d1"])[0], _texts(a["d2"])[0]]
    assert len(set(s3)) == 3
    digest = hashlib.sha256(f"kvbatch-choice:{seed}:1".encode()).digest()
    assert choice_seed(seed, 1) == int.from_bytes(digest[:8], "big", signed=True)
    assert a["s3"]["response"]["body"]["usage"]["completion_tokens"] == sum(
        a[c]["response"]["body"]["usage"]["completion_tokens"] for c in ("s1", "d1", "d2"))

    # /v1/completions takes n too: text completions, choice 0 the row of one choice.
    c2 = _texts(a["c2"])
    assert a["c2"]["response"]["body"]["object"] == "text_completion"
    assert c2[0] == _texts(a["c1"])[0] and c2 == _texts(b["c2"]) and len(c2) == 2


def _loop_row(llm: LLM, prompt: list[int], n: int, **sampling) -> Answered:
    job = Job(0, "x", 1, prompt, SamplingParams(max_tokens=4, **sampling), n=n)
    out = list(DecodeLoop(llm, [job], BatchReport.start(llm)))
    assert len(out) == 1 and isinstance(out[0], Answered)
    return out[0]


def test_the_prompt_is_computed_once_for_n_choices(llm) -> None:
    # Two prompts no other test uses, of five full blocks and a partial one.
    four_prompt, one_prompt = ([(k * i) % 900 + 1000 for i in range(5 * BLOCK + 3)] for k in (7, 11))
    full = len(four_prompt) // BLOCK * BLOCK
    before = llm.stats["computed_prompt_tokens"]
    row = _loop_row(llm, four_prompt, 4, temperature=1.0, seed=3)
    four = llm.stats["computed_prompt_tokens"] - before
    single = _loop_row(llm, one_prompt, 1, temperature=1.0, seed=3)
    one = llm.stats["computed_prompt_tokens"] - before - four
    assert one == len(one_prompt) and single.result.num_cached_tokens == 0

    assert [r.num_cached_tokens for r in row.choices] == [0] + [full] * 3  # the full blocks: computed once
    # Only the partial last block is computed again, by each of the other three choices.
    assert four == len(four_prompt) + 3 * (len(four_prompt) - full) < 2 * one
    # The row's figures count the prompt once: its lead choice computed all of it.
    assert row.prompt_tokens == len(four_prompt) and row.cached_prompt_tokens == 0
    assert row.completion_tokens == sum(len(r.output_token_ids) for r in row.choices)
    assert row.totals().output_token_ids == [t for r in row.choices for t in r.output_token_ids]


def _kv_store(folder: Path, url: str) -> KVStore:
    fp = EngineSpec(dtype="fp32", block_size=BLOCK).kv_fingerprint(load_checkpoint(str(folder)).fingerprint)
    return KVStore.from_config(KVStoreConfig(url=url, memory_bytes=0), fp)


def _manifest_lines(path: str) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def test_prefill_then_decode_loads_the_prompt_once_and_answers_as_generate(llm, tiny_chat, tmp_path) -> None:
    rows = [_row("q0", "paint?", temperature=1.0, seed=5, n=3), _row("q1", "glue?", temperature=0, n=2),
            _row("q2", "tape?", temperature=0)]
    src = _write(tmp_path / "in.jsonl", rows)
    manifests = str(tmp_path / "manifests.jsonl")
    run_prefill(_llm(tiny_chat, _kv_store(tiny_chat, str(tmp_path / "kv"))), src, manifests)
    lines = _manifest_lines(manifests)
    assert [line.get("n") for line in lines] == [3, 2, None]  # a row of one choice: no field

    decoder = _llm(tiny_chat, _kv_store(tiny_chat, str(tmp_path / "kv")))
    # A manifest line's n is checked as the request's was: out of bounds or mistyped, the row's 400.
    bad = list(manifest_jobs(decoder, [dict(lines[0], n=v) for v in (0, MAX_CHOICES + 1, "2", True)]))
    assert [(type(j).__name__, j.row.field) for j in bad] == [("Rejected", "manifest.n")] * 4

    # kvbatch decode's loop over the stored KV: each stored block is loaded once, by the first
    # choice that needs it; the other choices find it in the prefix cache. Only the partial last
    # block is computed, once per choice.
    out = sorted((o for o in DecodeLoop(decoder, manifest_jobs(decoder, read_manifests(manifests)),
                                        BatchReport.start(decoder)) if isinstance(o, Answered)),
                 key=lambda o: o.job.index)  # in the order rows finish: put back in input order
    prompts = [len(line["prompt_token_ids"]) for line in lines]
    stored = [p // BLOCK * BLOCK for p in prompts]
    assert [len(row.choices) for row in out] == [3, 2, 1]
    assert [r.num_loaded_tokens for r in out[0].choices] == [stored[0], 0, 0]
    assert [r.num_cached_tokens for r in out[0].choices] == [0, stored[0], stored[0]]
    for row, full in zip(out, stored):
        assert full > 0
        assert [r.num_loaded_tokens + r.num_cached_tokens for r in row.choices] == [full] * len(row.choices)
        assert all(r.num_loaded_tokens == 0 for r in row.choices[1:])
        assert row.cached_prompt_tokens == full
    distinct = {k for line in lines for k in line["block_keys"]}  # the rows share the system prompt's blocks
    assert sum(r.num_loaded_tokens for row in out for r in row.choices) == len(distinct) * BLOCK
    assert decoder.stats["computed_prompt_tokens"] == sum(len(row.choices) * (p - f)
                                                           for row, p, f in zip(out, prompts, stored))

    # `kvbatch decode` of the manifests answers as `kvbatch generate` of the rows: every choice.
    run_decode(_llm(tiny_chat, _kv_store(tiny_chat, str(tmp_path / "kv"))), manifests, str(tmp_path / "d.jsonl"))
    run_batch(llm, src, str(tmp_path / "g.jsonl"))
    decoded, generated = _lines(tmp_path / "d.jsonl"), _lines(tmp_path / "g.jsonl")
    assert [len(_texts(decoded[c])) for c in ("q0", "q1", "q2")] == [3, 2, 1]
    assert {c: _texts(decoded[c]) for c in decoded} == {c: _texts(generated[c]) for c in generated}
    usage = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert ({c: [o["response"]["body"]["usage"][k] for k in usage] for c, o in decoded.items()}
            == {c: [o["response"]["body"]["usage"][k] for k in usage] for c, o in generated.items()})


def test_a_pipeline_shard_answers_every_choice_and_counts_the_prompt_once(tiny_chat, tmp_path) -> None:
    from kvbatch.io.shard_tables import shard_url
    from kvbatch.ops.decode.shard import decode_shard
    from kvbatch.ops.ingest.prompts import ingest
    from kvbatch.ops.prefill.prefill import prefill_shard
    from kvbatch.ops.shards.build import build_shards

    src = _write(tmp_path / "in.jsonl", [_row("three", "paint?", temperature=1.0, seed=5, n=3),
                                         _row("one", "glue?", temperature=0)])
    prompts, root = str(tmp_path / "prompts.parquet"), str(tmp_path / "out")
    ingest(src, prompts, str(tmp_path / "rejects.parquet"))
    assert pq.read_table(prompts).column("n").to_pylist() == [3, 1]
    build_shards(_llm(tiny_chat), prompts, root, 1, rejects_url=str(tmp_path / "shard_rejects.parquet"))
    shard = pq.read_table(shard_url(root, "shards", "0000"))
    assert dict(zip(shard.column("custom_id").to_pylist(), shard.column("n").to_pylist())) == {"three": 3, "one": 1}

    manifests, results = str(tmp_path / "manifests.jsonl"), str(tmp_path / "results.parquet")
    prefill_shard(_llm(tiny_chat, _kv_store(tiny_chat, str(tmp_path / "kv"))), shard_url(root, "shards", "0000"),
                  manifests)
    assert {line["custom_id"]: line.get("n") for line in _manifest_lines(manifests)} == {"three": 3, "one": None}
    decode_shard(_llm(tiny_chat, _kv_store(tiny_chat, str(tmp_path / "kv"))), manifests, results)

    # One results row per request, every choice in `choices`; the prompt counted once.
    table = pq.read_table(results)
    by_id = {r["custom_id"]: r for r in table.to_pylist()}
    three, one = by_id["three"], by_id["one"]
    assert len(three["choices"]) == 3 and one["choices"] is None  # null for a row of one choice
    assert len({c["text"] for c in three["choices"]}) == 3  # seeded choices differ
    assert (three["text"], three["output_token_ids"]) == (three["choices"][0]["text"],
                                                          three["choices"][0]["output_token_ids"])
    assert three["completion_tokens"] == sum(len(c["output_token_ids"]) for c in three["choices"])
    assert three["prompt_tokens"] == len(shard.column("prompt_token_ids")[
        shard.column("custom_id").to_pylist().index("three")])
    sums = results_figures(table)
    assert sums["prompt_tokens"] == sum(len(ids) for ids in shard.column("prompt_token_ids").to_pylist())
    assert sums["completion_tokens"] == sum(r["completion_tokens"] for r in table.to_pylist())


def test_serve_run_and_response_cache_answer_every_choice(llm, tmp_path) -> None:
    from kvbatch.pipelines.batch_api import run_batch_parts

    src = _write(tmp_path / "in.jsonl", [_row("s", "rope?", temperature=1.0, seed=9, n=3),
                                         _row("g", "rope?", temperature=0, n=2)])
    cache = ResponseCache.for_llm(str(tmp_path / "rc"), llm)
    first = run_batch_parts(llm, src, str(tmp_path / "w1"), model_name="m", response_cache=cache)
    lines = {o["custom_id"]: o for p in sorted((tmp_path / "w1").glob("part-*"))
             for o in map(json.loads, p.read_text().splitlines())}
    assert [len(_texts(lines[c])) for c in ("s", "g")] == [3, 2]
    assert len(set(_texts(lines["s"]))) == 3
    usage = lines["s"]["response"]["body"]["usage"]
    assert first.prompt_tokens == usage["prompt_tokens"] + lines["g"]["response"]["body"]["usage"]["prompt_tokens"]
    assert first.output_tokens == sum(o["response"]["body"]["usage"]["completion_tokens"] for o in lines.values())
    # Each choice is written under its own key: the seeded row's three, the greedy row's one
    # (its two choices have the same parameters and the same answer).
    cache.flush()
    assert cache.stats.writes == 4 and cache.stats.hits == 0

    # A second batch: every choice served from the cache; the rows' prompts all count as cached.
    again = ResponseCache.for_llm(str(tmp_path / "rc"), llm)
    second = run_batch_parts(llm, src, str(tmp_path / "w2"), model_name="m", response_cache=again)
    assert again.stats.hits == 5 and again.stats.misses == 0
    served = {o["custom_id"]: o for p in sorted((tmp_path / "w2").glob("part-*"))
              for o in map(json.loads, p.read_text().splitlines())}
    assert {c: _texts(served[c]) for c in "sg"} == {c: _texts(lines[c]) for c in "sg"}
    assert served["s"]["response"]["body"]["usage"]["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"]
    assert second.cached_tokens == second.prompt_tokens == first.prompt_tokens

    # A row part served, part computed: the same seeded row with a fourth choice.
    more = ResponseCache.for_llm(str(tmp_path / "rc"), llm)
    run_batch(llm, _write(tmp_path / "more.jsonl", [_row("s", "rope?", temperature=1.0, seed=9, n=4)]),
              str(tmp_path / "more.out.jsonl"), response_cache=more)
    assert (more.stats.hits, more.stats.misses) == (3, 1)
    assert _texts(_lines(tmp_path / "more.out.jsonl")["s"])[:3] == _texts(lines["s"])


class _FailingChoiceEngine:
    """Finishes requests in reverse order; the request with id ``fail`` ends with an error."""

    spec = None

    def __init__(self, fail: str) -> None:
        self.fail = fail
        self.stats = {"draft_s": 0.0, "step_s": 0.0}

    def stream(self, requests: Iterable, max_waiting: int | None = None) -> Iterator[Result]:
        for r in reversed(list(requests)):
            error = "the grammar allows no token" if r.request_id == self.fail else None
            yield Result(r.request_id, list(r.prompt_token_ids), [5, 6], "ok", "error" if error else "stop",
                         0, 0.01, 0.002, error=error)


def test_an_error_in_one_choice_fails_the_row_once() -> None:
    jobs = [Job(0, "a", 1, [1, 2, 3], SamplingParams(max_tokens=2), n=3),
            Job(1, "b", 2, [1, 2, 3], SamplingParams(max_tokens=2), n=2)]
    report = BatchReport()
    out = list(DecodeLoop(_FailingChoiceEngine("0.1"), jobs, report))
    refused = [o for o in out if isinstance(o, Refused)]
    answered = [o for o in out if isinstance(o, Answered)]
    assert [(r.index, r.row.field, r.row.reason) for r in refused] == [
        (0, "body.response_format", "the grammar allows no token")]
    assert [(a.job.index, [r.request_id for r in a.choices]) for a in answered] == [(1, ["1", "1.1"])]
    assert (report.requests, report.succeeded, report.rejected) == (2, 1, 1)
    assert report.output_tokens == 4 and report.prompt_tokens == 3  # the prompt once, both choices' output


N_VALUES = [None, 1, 2, MAX_CHOICES, MAX_CHOICES + 1, 0, -3]


@pytest.mark.parametrize("url", ["/v1/chat/completions", "/v1/completions"])
def test_n_is_bounded_and_the_columnar_reader_agrees(url) -> None:
    lines = []
    for n in N_VALUES:
        body = {"messages": [{"role": "user", "content": "hi"}]} if url.endswith("chat/completions") else \
            {"prompt": "hi"}
        if n is not None:
            body["n"] = n
        lines.append(json.dumps({"custom_id": f"r{n}", "method": "POST", "url": url, "body": body}).encode())
    parsed = [parse_request_line(line, i + 1) for i, line in enumerate(lines)]
    for n, item in zip(N_VALUES, parsed):
        if n is None or 1 <= n <= MAX_CHOICES:
            assert isinstance(item, ChatRequest) and item.n == (n or 1)
        else:
            assert not isinstance(item, ChatRequest) and item.field == "body.n"
            assert (f"less than or equal to {MAX_CHOICES}" if n > MAX_CHOICES else "greater than or equal to 1") \
                in item.reason
    # The columnar twin proves valid exactly the rows the parser accepts, with the same records.
    table, slow = parse_block(lines, 1, min_split=1)
    got = {rec["row"]: request_record_or_reject(rec) for rec in table.to_pylist()}
    for i in slow:
        got[int(i) + 1] = request_record_or_reject(parsed[int(i)])
    assert [got[i + 1] for i in range(len(lines))] == [request_record_or_reject(p) for p in parsed]
    if url.endswith("chat/completions"):  # chat rows within the bound need no per-row parse
        assert sorted(int(i) for i in slow) == [i for i, n in enumerate(N_VALUES)
                                                if n is not None and not 1 <= n <= MAX_CHOICES]


def request_record_or_reject(item) -> tuple:
    """A prompts-table record (a message's null fields and absent ones alike), or a rejects record."""
    if isinstance(item, RejectedRow):
        return ("rejected", reject_record(item))
    rec = dict(item) if isinstance(item, dict) else request_record(item)
    rec["messages"] = [{k: v for k, v in m.items() if v is not None} for m in rec["messages"]]
    return ("ok", rec)


class _ChoiceLengthEngine:
    """Answers choice ``i`` of a row with ``i + 1`` tokens, prompt cached on every choice but the first."""

    spec = None
    tokenizer = None

    def __init__(self) -> None:
        self.stats = {"draft_s": 0.0, "step_s": 0.0}

    def stream(self, requests: Iterable, max_waiting: int | None = None) -> Iterator[Result]:
        for r in requests:
            choice = int(r.request_id.partition(".")[2] or 0)
            yield Result(r.request_id, list(r.prompt_token_ids), [9] * (choice + 1), "x", "stop",
                         0 if choice == 0 else 2, 0.01, 0.002)


def test_a_worker_ranks_figures_count_a_row_of_choices_once(tmp_path) -> None:
    from kvbatch.ops.decode.group_outputs import RankPartSink

    sink = RankPartSink(str(tmp_path / "parts"), 0, 1, "a", 10, {}, "k")
    jobs = [Job(0, "a", 1, [1, 2, 3], SamplingParams(max_tokens=4), n=3), Job(1, "b", 2, [1, 2], SamplingParams())]
    run_jobs(_ChoiceLengthEngine(), iter(jobs), sink, on_answered=sink.note)
    rows = pq.read_table(sorted((tmp_path / "parts").rglob("*.parquet"))).to_pylist()
    assert [(r["prompt_tokens"], r["cached_prompt_tokens"], r["output_tokens"]) for r in rows] == [(3, 0, 6), (2, 0, 1)]
    assert sink.figures == {}  # every choice's figures taken, none left behind
