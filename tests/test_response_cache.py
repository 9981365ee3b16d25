"""The exact response cache across runs (ops/decode/response_cache.py, docs/response-cache.md):
a second run is served from it bit for bit; every rule of the key; corruption is a miss; verify
mode catches a wrong-but-valid entry; the cache on S3."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from kvbatch.cli.main import main
from kvbatch.engine.runtime.sampling_params import SamplingParams
from kvbatch.ops.decode.response_cache import decode_entry, encode_entry, row_key
from tests.tiny_models import build_tiny_chat_model


@pytest.fixture(scope="module")
def tiny_chat(tmp_path_factory) -> Path:
    return build_tiny_chat_model(tmp_path_factory.mktemp("tiny_chat"), max_positions=96)


@pytest.fixture(scope="module")
def other_chat(tmp_path_factory) -> Path:
    return build_tiny_chat_model(tmp_path_factory.mktemp("other_chat"), seed=1, max_positions=96)


def _row(cid: str, content: str, **body) -> dict:
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": content}], "max_tokens": 6, **body}}


GREEDY = [_row(f"g{i}", f"Hello number {i}", temperature=0) for i in range(6)]
LOGPROBS = [_row("lp", "Tell me more", temperature=0, logprobs=True, top_logprobs=2)]
SEEDED = [_row("s", "Pick a word", temperature=0.9, seed=7)]
UNSEEDED = [_row("u", "Pick a word", temperature=0.9)]
BAD = [_row("bad", "x", temperature=-1)]
ROWS = GREEDY + LOGPROBS + SEEDED + UNSEEDED + BAD
REUSABLE = len(GREEDY) + len(LOGPROBS) + len(SEEDED)


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _run(model: Path, tmp_path: Path, name: str, rows: list[dict], cache: str | None, *extra: str,
         deterministic: bool = True) -> tuple[int, list[dict], dict]:
    src = _write(tmp_path / f"{name}.in.jsonl", rows)
    out, metrics = tmp_path / f"{name}.out.jsonl", tmp_path / f"{name}.metrics.json"
    args = ["generate", "--model", str(model), "--input", str(src), "--output", str(out), "--metrics", str(metrics),
            "--no-progress", *(["--deterministic"] if deterministic else []), *(["--response-cache", cache] if cache else []), *extra]
    code = main(args)
    lines = [json.loads(x) for x in out.read_text().splitlines()] if out.exists() else []
    return code, lines, json.loads(metrics.read_text()) if metrics.exists() else {}


def _answers(lines: list[dict]) -> dict[str, str]:
    """Each line as bytes, less the one field that is the wall clock (``created``)."""
    out = {}
    for line in lines:
        if line["response"]["status_code"] == 200:
            line = json.loads(json.dumps(line))
            del line["response"]["body"]["created"]
        out[line["custom_id"]] = json.dumps(line, sort_keys=True)
    return out


def _entries(cache: Path) -> list[Path]:
    """The rows' entries (not the copies kept by family key for a shorter ``max_tokens``)."""
    return sorted(p for p in cache.rglob("*.json") if "longest" not in p.parts)


def _family_copies(cache: Path) -> list[Path]:
    return sorted(p for p in cache.rglob("*.json") if "longest" in p.parts)


def test_second_run_is_all_hits_and_equals_a_fresh_run_bit_for_bit(tiny_chat, tmp_path):
    cache = tmp_path / "cache"
    code1, first, m1 = _run(tiny_chat, tmp_path, "first", ROWS, str(cache))
    assert code1 == 1  # the bad row
    assert m1["response_cache"]["hits"] == 0
    assert m1["response_cache"]["misses"] == REUSABLE
    assert m1["response_cache"]["writes"] == REUSABLE
    assert m1["response_cache"]["not_reusable"] == 1
    # Errors and unseeded sampled rows are never stored.
    assert len(_entries(cache)) == REUSABLE
    code2, second, m2 = _run(tiny_chat, tmp_path, "second", ROWS, str(cache))
    rc = m2["response_cache"]
    assert code2 == 1
    assert (rc["hits"], rc["misses"], rc["writes"], rc["not_reusable"]) == (REUSABLE, 0, 0, 1)
    # One GET per reusable row; no entry written: the one PUT is the run's usage file (for gc).
    assert rc["requests"] == {"GET": REUSABLE, "PUT": 1} and rc["usage_files"] == 1
    assert m2["succeeded"] == m1["succeeded"] and m2["rejected"] == m1["rejected"] == 1
    # Only the unseeded row ran in the engine; the served rows' tokens are counted apart, at no compute.
    u = next(x for x in second if x["custom_id"] == "u")
    assert m2["output_tokens"] == u["response"]["body"]["usage"]["completion_tokens"]
    served = [x["response"]["body"]["usage"] for x in first if x["custom_id"] not in ("u", "bad")]
    assert m2["response_cache_rows"] == REUSABLE and m1["response_cache_rows"] == 0
    assert m2["response_cache_output_tokens"] == sum(x["completion_tokens"] for x in served) > 0
    assert m2["response_cache_prompt_tokens"] == sum(x["prompt_tokens"] for x in served)
    assert m2["prompt_tokens"] == u["response"]["body"]["usage"]["prompt_tokens"]
    a1, a2 = _answers(first), _answers(second)
    fresh = _answers(_run(tiny_chat, tmp_path, "fresh", ROWS, None)[1])
    reusable = [r["custom_id"] for r in GREEDY + LOGPROBS + SEEDED]
    for cid in reusable + ["bad"]:
        assert a2[cid] == a1[cid] == fresh[cid], cid
    lp = json.loads(a2["lp"])["response"]["body"]["choices"][0]["logprobs"]
    assert lp is not None and lp["content"] and len(lp["content"][0]["top_logprobs"]) == 2


def test_every_rule_of_the_key_misses(tiny_chat, other_chat, tmp_path):
    cache = str(tmp_path / "cache")
    rows = GREEDY[:2] + SEEDED
    assert _run(tiny_chat, tmp_path, "warm", rows, cache)[0] == 0
    code, _, m = _run(tiny_chat, tmp_path, "same", rows, cache)
    assert code == 0 and m["response_cache"]["hits"] == 3

    def misses(name: str, rows: list[dict], model: Path = tiny_chat, *extra: str, deterministic: bool = True) -> dict:
        code, _, m = _run(model, tmp_path, name, rows, cache, *extra, deterministic=deterministic)
        assert code == 0, name
        rc = m["response_cache"]
        assert rc["hits"] == 0 and rc["misses"] == len(rows), (name, rc)
        return rc

    def changed(row: dict, **body) -> dict:
        return {**row, "body": {**row["body"], **body}}

    # A smaller max_tokens is served by cutting the longer answers (--deterministic, no drafter).
    code, _, m = _run(tiny_chat, tmp_path, "shorter", [changed(r, max_tokens=2) for r in rows], cache)
    assert code == 0 and m["response_cache"]["hits"] == 3 and m["response_cache"]["truncated"] >= 1, m
    # A changed sampling field, a larger max_tokens, a stop string, another seed: misses.
    misses("top_p", [changed(r, top_p=0.5) for r in rows])
    misses("max_tokens", [changed(r, max_tokens=7) for r in rows])
    misses("stop", [changed(r, stop=["zz"]) for r in rows])
    misses("seed", [changed(SEEDED[0], seed=8)])
    misses("logprobs", [changed(r, logprobs=True) for r in rows])
    # Other weights (another tiny model, same tokenizer) and another weight format: misses.
    misses("other_weights", rows, other_chat)
    # Batch-invariant numerics are part of the key; int8 weights run without them, so the
    # full-weight entries they must not hit are written without them too.
    misses("not_deterministic", rows, deterministic=False)
    code, _, m = _run(tiny_chat, tmp_path, "full_again", rows, cache, deterministic=False)
    assert code == 0 and m["response_cache"]["hits"] == 3
    misses("int8", rows, tiny_chat, "--weights", "int8", deterministic=False)


def test_every_sampling_field_is_in_the_key_and_so_is_a_new_one():
    base = SamplingParams(max_tokens=8, temperature=0.0, seed=1)
    key = row_key("engine", [1, 2, 3], base)
    other = {"max_tokens": 9, "temperature": 0.5, "top_p": 0.9, "top_k": 5, "min_p": 0.1, "seed": 2,
             "stop": ("x",), "stop_token_ids": (7,), "logprobs": 1, "ignore_eos": True,
             "logit_bias": ((7, 1.0),), "presence_penalty": 0.5, "frequency_penalty": -0.5}
    for f in dataclasses.fields(SamplingParams):
        # A field added since (structured outputs' response_format): another value of its kind.
        if f.name in other:
            value = other[f.name]
        elif f.default is None:
            value = '{"type": "json_object"}'
        else:
            value = (not f.default) if isinstance(f.default, bool) else f.default + 1
        assert row_key("engine", [1, 2, 3], dataclasses.replace(base, **{f.name: value})) != key, f.name
    assert row_key("engine", [1, 2, 4], base) != key
    assert row_key("engine2", [1, 2, 3], base) != key
    # temperature 0 and 0.0 are one value; the key is stable across processes (no hash seeds).
    assert row_key("engine", [1, 2, 3], dataclasses.replace(base, temperature=0)) == key

    @dataclasses.dataclass(frozen=True)
    class WithGrammar(SamplingParams):  # a field another engineer adds (structured outputs)
        grammar: str | None = None

    g1 = row_key("engine", [1, 2, 3], WithGrammar(max_tokens=8, temperature=0.0, seed=1, grammar="a"))
    g2 = row_key("engine", [1, 2, 3], WithGrammar(max_tokens=8, temperature=0.0, seed=1, grammar="b"))
    assert g1 is not None and g2 is not None and g1 != g2
    # A field value with no canonical form makes the row uncacheable, never a key that ignores it.
    assert row_key("engine", [1], WithGrammar(temperature=0.0, grammar=object())) is None  # type: ignore[arg-type]
    # Sampled rows without a seed are never keyed.
    assert row_key("engine", [1], SamplingParams(temperature=0.7)) is None


def test_an_unseeded_sampled_row_never_hits(tiny_chat, tmp_path):
    cache = tmp_path / "cache"
    for name in ("a", "b"):
        code, _, m = _run(tiny_chat, tmp_path, name, UNSEEDED, str(cache))
        assert code == 0
        rc = m["response_cache"]
        assert (rc["hits"], rc["misses"], rc["writes"], rc["not_reusable"]) == (0, 0, 0, 1)
        assert rc["requests"] == {}
    assert _entries(cache) == []


def test_corrupt_and_truncated_entries_are_misses_recomputed(tiny_chat, tmp_path):
    cache = tmp_path / "cache"
    rows = GREEDY[:4]
    _, first, _ = _run(tiny_chat, tmp_path, "first", rows, str(cache))
    entries = _entries(cache)
    assert len(entries) == 4
    data = entries[0].read_bytes()
    mid = len(data) // 2
    entries[0].write_bytes(data[:mid] + bytes([data[mid] ^ 0x01]) + data[mid + 1:])  # one flipped bit
    entries[1].write_bytes(entries[1].read_bytes()[:40])  # cut short
    for copy in _family_copies(cache):  # (else the longest-answer copies would serve the damaged rows)
        copy.unlink()
    code, second, m = _run(tiny_chat, tmp_path, "second", rows, str(cache))
    rc = m["response_cache"]
    assert code == 0
    assert (rc["hits"], rc["misses"], rc["corrupt"], rc["writes"]) == (2, 2, 2, 2)
    assert _answers(second) == _answers(first)
    # The corrupt entries were replaced: the next run is all hits.
    rc = _run(tiny_chat, tmp_path, "third", rows, str(cache))[2]["response_cache"]
    assert (rc["hits"], rc["misses"], rc["corrupt"]) == (4, 0, 0)


def test_verify_mode_catches_a_wrong_but_valid_entry(tiny_chat, tmp_path, capsys):
    cache = tmp_path / "cache"
    rows = GREEDY[:3]
    _, first, _ = _run(tiny_chat, tmp_path, "first", rows, str(cache))
    # A clean cache verifies.
    code, _, m = _run(tiny_chat, tmp_path, "clean", rows, str(cache), "--response-cache-verify", "1")
    assert code == 0 and m["response_cache"]["verified"] == 3 and m["response_cache"]["hits"] == 3
    # Tamper with one entry and give it a valid checksum: only a recomputation can tell.
    path = _entries(cache)[0]
    doc = json.loads(path.read_bytes())
    body = {**doc["body"], "text": doc["body"]["text"] + " (tampered)"}
    path.write_bytes(encode_entry(doc["key"], body))
    assert decode_entry(doc["key"], path.read_bytes()) == body
    candidates = _cid_of(first, doc["body"]["text"])  # the row(s) whose answer it holds
    capsys.readouterr()
    code, lines, _ = _run(tiny_chat, tmp_path, "verify", rows, str(cache), "--response-cache-verify", "1")
    err = capsys.readouterr().err
    assert code == 2
    assert any(f"custom_id {cid!r}" in err for cid in candidates), err
    assert "differs from its recomputation" in err and "(tampered)" in err
    assert lines == []  # nothing committed
    # Without verify the same tampered entry would have been served; after the failure it holds
    # the recomputed answer again.
    code, lines, m = _run(tiny_chat, tmp_path, "after", rows, str(cache), "--response-cache-verify", "1")
    assert code == 0 and m["response_cache"]["verified"] == 3
    assert _answers(lines) == _answers(first)


def _cid_of(lines: list[dict], text: str) -> set[str]:
    return {x["custom_id"] for x in lines if x["response"]["body"]["choices"][0]["message"]["content"] == text}


def test_decode_takes_the_cache_too(tiny_chat, tmp_path):
    store = (tmp_path / "kv").as_uri()
    src = _write(tmp_path / "in.jsonl", GREEDY[:3])
    manifests = tmp_path / "m.jsonl"
    common = ["--model", str(tiny_chat), "--store", store, "--deterministic", "--no-progress"]
    assert main(["prefill", *common, "--input", str(src), "--manifests", str(manifests)]) == 0
    outs = []
    for name in ("d1", "d2"):
        out, metrics = tmp_path / f"{name}.jsonl", tmp_path / f"{name}.json"
        assert main(["decode", *common, "--manifests", str(manifests), "--output", str(out), "--metrics", str(metrics),
                     "--response-cache", str(tmp_path / "cache")]) == 0
        outs.append(_answers([json.loads(x) for x in out.read_text().splitlines()]))
        rc = json.loads(metrics.read_text())["response_cache"]
        assert (rc["hits"], rc["misses"]) == ((0, 3) if name == "d1" else (3, 0))
    assert outs[0] == outs[1]


def test_the_cache_on_s3(tiny_chat, tmp_path, s3, s3_endpoint, monkeypatch):
    import s3fs

    url, _, fs = s3
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    s3fs.S3FileSystem.clear_instance_cache()
    try:
        cache = url.rsplit("/", 1)[0] + "/responses"
        rows = GREEDY[:3] + SEEDED
        _, first, m1 = _run(tiny_chat, tmp_path, "first", rows, cache)
        # Each miss also looks for a longer answer, and each answer is also kept for a shorter
        # max_tokens (--deterministic, no drafter: docs/response-cache.md): a GET and a PUT more.
        assert m1["response_cache"]["writes"] == 4 and m1["response_cache"]["requests"] == {"GET": 8, "PUT": 8}
        objects = [p for p in fs.find(cache.removeprefix("s3://")) if p.endswith(".json")]
        stored = [p for p in objects if "/longest/" not in p]
        assert len(stored) == 4 and len(objects) == 8
        for p in objects:  # the copies would serve the damaged row: this checks the entry alone
            if "/longest/" in p:
                fs.rm(p)
        # A corrupt object on S3 is a miss too, and is replaced.
        fs.pipe_file(stored[0], fs.cat_file(stored[0])[:-5])
        code, second, m2 = _run(tiny_chat, tmp_path, "second", rows, cache)
        rc = m2["response_cache"]
        assert code == 0 and (rc["hits"], rc["misses"], rc["corrupt"], rc["writes"]) == (3, 1, 1, 1)
        assert _answers(second) == _answers(first)
    finally:
        s3fs.S3FileSystem.clear_instance_cache()


def two_pipeline_nights(tmp_path: Path, model: Path, decode_cluster=None) -> tuple[Any, int]:
    """One day of the default pipeline on ``model`` with ``kv_store.response_cache: default``, its
    shard's ``decode_results`` materialized twice (launched by ``decode_cluster``, in process by
    default): the first computes and writes every row, the second is served whole from the cache,
    its results equal, its rows marked ``cached``. The day's layout and its row count."""
    import pyarrow.parquet as pq

    from kvbatch.pipelines.layout import DayLayout
    from tests.pipeline_day import decode_metadata, prepared_day

    date = "2026-11-29"
    data = tmp_path / "requests.jsonl"
    data.write_text("".join(json.dumps({"custom_id": f"q{i}", "messages": [{"role": "user", "content": f"Say {i}."}],
                                        "max_tokens": 3, "temperature": 0}) + "\n" for i in range(4)))
    root = tmp_path / "data"
    prepared = prepared_day(root, model, data, date, response_cache="default", decode_cluster=decode_cluster)
    day = DayLayout(str(root / "kvbatch"), date)  # the kvbatch pipeline's tables
    rows = pq.read_table(day.shard("shards", "0000")).num_rows
    seen, marked = [], []
    for _ in range(2):
        meta = decode_metadata(prepared)
        seen.append((meta["response_cache_hits"], meta["response_cache_misses"], meta["response_cache_writes"]))
        results = pq.read_table(day.shard("results", "0000")).sort_by("custom_id")
        seen.append(results.select(["custom_id", "text", "output_token_ids", "finish_reason"]).to_pylist())
        marked.append(results.column("cached").to_pylist())
    assert seen[0] == (0, rows, rows) and seen[2] == (rows, 0, 0)
    assert seen[1] == seen[3]
    # The results table marks the rows the cache answered: none the first time, all the second.
    assert marked == [[False] * rows, [True] * rows]
    return day, rows


def test_the_pipeline_decode_reports_hits_misses_writes(tmp_path):
    """``kv_store.response_cache`` on the decode_results asset: a second materialization of the
    shard is served from the cache, its results equal, its metadata counting hits/misses/writes."""
    import pyarrow.parquet as pq

    day, rows = two_pipeline_nights(tmp_path, build_tiny_chat_model(tmp_path / "tiny", max_positions=96))
    # Its cost row: every row at zero compute, the cache's lookups priced from the decode's own stats.
    from kvbatch.io.shard_tables import read_json
    from kvbatch.ops.results.cost import Pricing, class_tokens, shard_metrics

    stats = read_json(day.shard("decode_stats", "0000", "stats.json"))
    assert stats["ttft_s_p95"] is None and stats["tpot_s_p95"] is None  # no row was timed: none computed
    m = shard_metrics(pq.read_table(day.shard("results", "0000")), {}, stats,
                      Pricing(usd_per_1k_requests={"GET": 0.4}))
    assert m["response_cache_hits"] == rows and m["prompt_tokens_decode_computed"] == 0
    assert class_tokens(m)["output"] == 0 and m["output_tokens_response_cache"] == m["output_tokens"] > 0
    assert m["response_cache_requests_get"] == rows  # this decode's lookups: one GET per row
    assert m["cost_response_cache_usd"] == pytest.approx(rows * 0.4 / 1000)
    assert list((tmp_path / "data" / "responses").rglob("*.json"))


def test_a_served_batch_takes_the_cache(tiny_chat, tmp_path):
    """``kvbatch serve``'s batch run (``run_batch_parts``) with a cache: a second batch of the
    same file is all hits, its lines the same, its summary (done.json) counting them."""
    from kvbatch.engine.spec import EngineSpec
    from kvbatch.ops.decode.response_cache import ResponseCache
    from kvbatch.ops.engine_build import build_llm
    from kvbatch.pipelines.batch_api import read_part_lines, run_batch_parts

    llm = build_llm(EngineSpec(model=str(tiny_chat), deterministic=True))
    src = _write(tmp_path / "in.jsonl", GREEDY[:3] + BAD)
    got = []
    for name in ("b1", "b2"):
        cache = ResponseCache.for_llm(str(tmp_path / "cache"), llm)
        summary = run_batch_parts(llm, str(src), str(tmp_path / name), model_name="tiny", response_cache=cache)
        cache.close()
        rc = summary.response_cache
        got.append(((rc["hits"], rc["misses"], rc["writes"]), summary.succeeded, summary.failed))
        done = json.loads((tmp_path / name / "done.json").read_text())
        assert done["response_cache"]["hits"] == rc["hits"]
    assert got == [((0, 3, 3), 3, 1), ((3, 0, 0), 3, 1)]
    first, second = _lines(tmp_path / "b1", read_part_lines), _lines(tmp_path / "b2", read_part_lines)
    for line in second:  # a served answer computed no prompt token: all of them are cached_tokens
        if line["error"] is None:
            usage = line["response"]["body"]["usage"]
            assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"]
    for line in first + second:
        if line["error"] is None:
            del line["response"]["body"]["usage"]["prompt_tokens_details"]
    assert _answers(first) == _answers(second)


def _lines(work: Path, read_part_lines) -> list[dict]:
    from kvbatch.pipelines.batch_api import list_parts

    return [json.loads(line) for p in list_parts(str(work), {}) for line in read_part_lines(str(work), p, {})]


def test_a_night_of_hits_never_builds_the_engine(tiny_chat, tmp_path, monkeypatch):
    """ops/decode/lazy_engine.py: the first run records the engine's identity; the next one keys the
    cache from the record and builds the engine only at its first miss, with the same answers and
    counters; a record that no longer matches the built engine fails loudly and is removed."""
    from kvbatch.engine.spec import EngineSpec
    from kvbatch.io.batch_requests import read_requests
    from kvbatch.ops.decode import lazy_engine
    from kvbatch.ops.decode.generate import run_jobs
    from kvbatch.ops.decode.response_cache import ResponseCache, engine_identity
    from kvbatch.ops.engine_build import build_llm
    from kvbatch.ops.jobs import tokenize_requests

    monkeypatch.setattr(lazy_engine, "identity_dir", lambda: tmp_path / "identities")
    spec = EngineSpec(model=str(tiny_chat), deterministic=True)
    builds: list[object] = []

    def build():
        builds.append(build_llm(spec))
        return builds[-1]

    def night(name: str, rows: list[dict]) -> tuple[lazy_engine.LazyEngine, dict, dict]:
        engine = lazy_engine.LazyEngine.open(spec, build)
        src = _write(tmp_path / f"{name}.in.jsonl", rows)
        out = tmp_path / f"{name}.out.jsonl"
        cache = ResponseCache(str(tmp_path / "cache"), engine.engine_id)
        report = run_jobs(engine, tokenize_requests(engine, read_requests(str(src))), str(out), response_cache=cache)
        cache.close()
        lines = [json.loads(x) for x in out.read_text().splitlines()]
        return engine, _answers(lines), report.to_json()

    rows = GREEDY + SEEDED
    first, answers1, m1 = night("first", rows)
    assert first.built and len(builds) == 1  # no record yet: built, and its identity recorded
    assert first.engine_id == engine_identity(builds[0])
    assert m1["response_cache"]["misses"] == len(rows)
    second, answers2, m2 = night("second", rows)
    assert not second.built and len(builds) == 1
    assert answers2 == answers1
    assert m2["response_cache"]["hits"] == len(rows) and m2["succeeded"] == m1["succeeded"]
    third, answers3, m3 = night("third", rows + [_row("new", "Something else", temperature=0)])
    assert third.built and len(builds) == 2  # the one miss built it
    assert m3["response_cache"]["misses"] == 1 and {k: answers3[k] for k in answers1} == answers1
    [record] = (tmp_path / "identities").glob("*.json")
    record.write_text(json.dumps({**json.loads(record.read_text()), "engine_id": "0" * 64}))
    with pytest.raises(lazy_engine.EngineIdentityChanged, match="record was removed"):
        night("fourth", rows + [_row("newer", "Yet another", temperature=0)])
    assert not record.exists()


def test_a_cli_night_of_hits_never_loads_the_weights(tiny_chat, tmp_path, monkeypatch, capsys):
    """``kvbatch generate --response-cache``: the second night of the same rows answers from the
    cache without loading the model (any load would fail here), byte for byte the first night's."""
    from kvbatch.cli import main as cli
    from kvbatch.ops.decode import lazy_engine

    monkeypatch.setattr(lazy_engine, "identity_dir", lambda: tmp_path / "identities")
    rows = GREEDY + SEEDED
    code1, first, m1 = _run(tiny_chat, tmp_path, "first", rows, str(tmp_path / "cache"))
    assert code1 == 0 and m1["response_cache"]["misses"] == len(rows)
    assert ") loaded; generating" in capsys.readouterr().err

    def no_load(args):
        raise AssertionError("the weights were loaded on a night of hits")

    monkeypatch.setattr(cli, "_load_or_fail", no_load)
    code2, second, m2 = _run(tiny_chat, tmp_path, "second", rows, str(tmp_path / "cache"))
    assert code2 == 0 and m2["response_cache"]["hits"] == len(rows) and m2["output_tokens"] == 0
    assert _answers(second) == _answers(first)
    assert "weights load at the first response-cache miss" in capsys.readouterr().err
    # A record the built engine disagrees with: one line, exit 2, the record gone, no output.
    monkeypatch.undo()
    monkeypatch.setattr(lazy_engine, "identity_dir", lambda: tmp_path / "identities")
    [record] = (tmp_path / "identities").glob("*.json")
    record.write_text(json.dumps({**json.loads(record.read_text()), "engine_id": "0" * 64}))
    code3, third, _ = _run(tiny_chat, tmp_path, "third", rows + [_row("new", "Something else", temperature=0)],
                           str(tmp_path / "cache"))
    err = capsys.readouterr().err
    assert code3 == 2 and third == [] and not record.exists()
    assert "record was removed: run again; nothing was written to" in err and "Traceback" not in err


def test_a_longer_answer_serves_a_shorter_max_tokens_bit_for_bit(tiny_chat, tmp_path):
    """``ResponseCache.for_llm`` on a batch-invariant engine without a drafter keeps each answer under
    its family key too (every field but ``max_tokens``): a row asking fewer tokens is served by
    cutting it (``response_cache.truncated``), a row asking more only where the answer ended by a
    stop. Each answer equals a fresh run's at the row's own ``max_tokens``, byte for byte."""
    from kvbatch.engine.spec import EngineSpec
    from kvbatch.io.batch_requests import read_requests
    from kvbatch.ops.decode.generate import run_jobs
    from kvbatch.ops.decode.response_cache import ResponseCache
    from kvbatch.ops.engine_build import build_llm
    from kvbatch.ops.jobs import tokenize_requests

    llm = build_llm(EngineSpec(model=str(tiny_chat), deterministic=True))
    url = str(tmp_path / "cache")

    def night(name: str, rows: list[dict], cached: bool = True) -> tuple[list[dict], dict]:
        src = _write(tmp_path / f"{name}.in.jsonl", rows)
        out = tmp_path / f"{name}.out.jsonl"
        cache = ResponseCache.for_llm(url, llm) if cached else None
        run_jobs(llm, tokenize_requests(llm, read_requests(str(src))), str(out), response_cache=cache)
        if cache is not None:
            cache.close()
        return [json.loads(x) for x in out.read_text().splitlines()], {} if cache is None else cache.to_json()

    def at(rows: list[dict], max_tokens: int) -> list[dict]:
        return [{**r, "body": {**r["body"], "max_tokens": max_tokens}} for r in rows]

    base = [_row("g0", "Hello number 0", temperature=0), _row("g1", "Hello number 1", temperature=0),
            _row("lp", "Tell me more", temperature=0, logprobs=True, top_logprobs=2),
            _row("s", "Pick a word", temperature=0.9, seed=7)]
    first, m1 = night("first", at(base, 8))
    assert m1["writes"] == m1["family_writes"] == 4
    assert m1["requests"] == {"GET": 8, "PUT": 8}  # a miss: one more GET (its family), one more PUT
    # Rows that stop early: at a token id and at a string, both taken from the seeded row's answer
    # (the tiny model's greedy answers repeat one token).
    ids = _output_ids(llm, base[3], 8)
    stop_id = next(t for j, t in enumerate(ids) if j >= 2 and t not in ids[:j])
    text = first[3]["response"]["body"]["choices"][0]["message"]["content"]
    seeded = base[3]["body"]
    stops = [_row("sid", "Pick a word", temperature=seeded["temperature"], seed=7, stop_token_ids=[stop_id]),
             _row("sstr", "Pick a word", temperature=seeded["temperature"], seed=7,
                  stop=[text[len(text) // 2:len(text) // 2 + 3]])]
    stopped, _ = night("stops", at(stops, 8))
    assert all(x["response"]["body"]["choices"][0]["finish_reason"] == "stop" for x in stopped)
    # Fewer tokens: every row served by cutting; more tokens: only the rows that ended by a stop.
    for name, rows, hits in (("fewer", at(base + stops, 3), 6), ("more", at(base + stops, 12), 2)):
        got, m = night(name, rows)
        assert (m["hits"], m["truncated"], m["misses"]) == (hits, hits, len(rows) - hits), (name, m)
        fresh, _ = night(f"{name}_fresh", rows, cached=False)
        assert _answers(got) == _answers(fresh), name
    # The cut answers were written under their own keys: the next night finds them in one GET each.
    _, m = night("fewer_again", at(base + stops, 3))
    assert (m["hits"], m["truncated"], m["requests"].get("GET")) == (6, 0, 6)


def _output_ids(llm, row: dict, max_tokens: int) -> list[int]:
    """The engine's output token ids for ``row`` (one request, no cache)."""
    import tempfile

    from kvbatch.engine.runtime.llm import GenerationRequest
    from kvbatch.io.batch_requests import read_requests
    from kvbatch.ops.jobs import tokenize_requests

    with tempfile.TemporaryDirectory() as d:
        src = _write(Path(d) / "one.jsonl", [{**row, "body": {**row["body"], "max_tokens": max_tokens}}])
        [job] = list(tokenize_requests(llm, read_requests(str(src))))
    [result] = list(llm.stream([GenerationRequest("0", job.sampling, prompt_token_ids=job.prompt_token_ids)]))
    return result.output_token_ids


def test_truncation_is_proven_or_refused():
    """``truncated``: the cases it serves and the ones it must not (a row cut by its own smaller
    limit, a drafter's counts); ``for_llm`` turns it on only for batch-invariant numerics without a drafter."""
    from types import SimpleNamespace

    from kvbatch.ops.decode import response_cache as rc

    class Tok:
        def decode(self, ids):
            return "".join(f"<{i}>" for i in ids)

    body = {"output_token_ids": [5, 6, 7, 8], "text": "<5><6><7><8>", "finish_reason": "length",
            "logprobs": [{"lp": -1.0 * i} for i in range(4)], "spec_draft_tokens": 0, "spec_accepted_tokens": 0,
            "spec_target_steps": 0}
    cut = rc.truncated(body, 4, 2, Tok())
    assert (cut["output_token_ids"], cut["text"], cut["finish_reason"], cut["logprobs"]) == (
        [5, 6], "<5><6>", "length", body["logprobs"][:2])
    assert rc.truncated(body, 4, 4, Tok()) == body  # the same limit
    assert rc.truncated(body, 4, 6, Tok()) is None  # cut by its own limit: what comes next is unknown
    assert rc.truncated(body, 9, 6, Tok()) == body  # cut by the context window below its limit: any k >= n
    assert rc.truncated({**body, "finish_reason": "stop"}, 4, 6, Tok())["finish_reason"] == "stop"
    assert rc.truncated(body, 4, 2, None) is None  # no tokenizer: no text to give
    assert rc.truncated({**body, "spec_draft_tokens": 3}, 4, 2, Tok()) is None
    llm = SimpleNamespace(engine_config=SimpleNamespace(batch_invariant=True), spec=None, tokenizer=Tok())
    original = rc.engine_identity
    rc.engine_identity = lambda llm: "engine"
    try:
        assert rc.ResponseCache.for_llm("memory://rc-t", llm).truncate
        drafting = SimpleNamespace(**{**vars(llm), "spec": SimpleNamespace(config={"method": "ngram"})})
        assert not rc.ResponseCache.for_llm("memory://rc-t", drafting).truncate
        other = SimpleNamespace(**{**vars(llm), "engine_config": SimpleNamespace(batch_invariant=False)})
        assert not rc.ResponseCache.for_llm("memory://rc-t", other).truncate
        # A LazyEngine's identity is taken as it is, never by building the engine.
        lazy = SimpleNamespace(**vars(llm), engine_id="lazy")
        assert rc.ResponseCache.for_llm("memory://rc-t", lazy).engine_id == "lazy"
    finally:
        rc.engine_identity = original
    # Its key: every field but max_tokens.
    p = SamplingParams(max_tokens=8, temperature=0.0)
    assert rc.family_key("e", [1], p) == rc.family_key("e", [1], dataclasses.replace(p, max_tokens=3))
    assert rc.family_key("e", [1], p) != rc.family_key("e", [1], dataclasses.replace(p, top_p=0.5))
    assert rc.family_key("e", [1], p) != rc.row_key("e", [1], p)


def test_greedy_rows_are_shared_by_nights_that_draft_differently(tiny_chat, tmp_path):
    """A greedy row's key leaves the drafting config out (drafting never changes a greedy answer),
    a seeded sampled row's keeps it: a plain night's greedy answers serve a night drafting by
    n-gram and a night drafting from the first night's answers, each recomputing every hit
    (``--response-cache-verify 1``) and finding it equal, logprobs included; the seeded row misses
    under each new drafting config."""
    cache = str(tmp_path / "cache")
    rows = GREEDY[:3] + LOGPROBS + SEEDED
    code, first, m1 = _run(tiny_chat, tmp_path, "plain", rows, cache)
    assert code == 0 and m1["response_cache"]["writes"] == 5
    answers = tmp_path / "plain.out.jsonl"
    for name, spec in (("ngram", "ngram"), ("suffix", f"suffix:{answers}")):
        code, lines, m = _run(tiny_chat, tmp_path, name, rows, cache, "--spec", spec, "--response-cache-verify", "1")
        rc = m["response_cache"]
        assert code == 0 and (rc["hits"], rc["verified"], rc["misses"], rc["writes"]) == (4, 4, 1, 1), (name, rc)
        texts = {x["custom_id"]: x["response"]["body"]["choices"][0] for x in lines}
        for x in first[:4]:
            c = x["response"]["body"]["choices"][0]
            assert (texts[x["custom_id"]]["message"], texts[x["custom_id"]]["logprobs"]) == (c["message"], c["logprobs"])
