"""prompt_shards' parallel tokenization: a pool of spawned workers must write exactly the files
the in-process path writes (token ids, block keys, shard of every row, rejects with their
reasons, row order), keep a bounded number of chunks in flight, and turn a dead worker into a
clear error that commits nothing."""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from kvbatch.engine.runtime.engine_config import EngineConfig
from kvbatch.engine.runtime.llm import LLM
from kvbatch.io.batch_requests import ChatRequest
from kvbatch.io.shard_tables import shard_url
from kvbatch.ops.shards import build as shards
from kvbatch.ops.ingest.prompts import ingest
from kvbatch.ops.shards.build import (
    RowTokenizer,
    Tokenized,
    TokenizerWorkerError,
    build_shards,
    shard_keys,
    shard_of,
    tokenized_in_pool,
    tokenized_in_process,
)
from tests.tiny_models import build_tiny_chat_model

NUM_SHARDS = 4
ROWS = 2500
REFUSE = "REFUSE-ME"  # the test template raises for a message that contains this


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """The tiny SmolLM2-tokenizer model, with a chat template that refuses some conversations."""
    folder = build_tiny_chat_model(tmp_path_factory.mktemp("tiny"), max_positions=160)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    guard = ("{% for message in messages %}{% if '" + REFUSE + "' in message['content'] %}"
             "{{ raise_exception('this conversation is refused') }}{% endif %}{% endfor %}")
    config["chat_template"] = guard + config["chat_template"]
    config_path.write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def llm(tiny: Path) -> LLM:
    return LLM(str(tiny), engine_config=EngineConfig(max_num_seqs=4, block_size=8))


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> str:
    """~2.5k valid rows: varied lengths and roles, some refused by the template, some too long."""
    rng = random.Random(7)
    words = "the a book tent boot order refund ship winter zipper camp trail ünïcödé 数据 <|im_start|>".split()
    rows = []
    for i in range(ROWS):
        kind = rng.random()
        user = " ".join(rng.choice(words) for _ in range(rng.randint(1, 40)))
        if kind < 0.05:
            user += " " + REFUSE
        elif kind < 0.10:
            user = "word " * rng.randint(160, 300)  # past the 160-token context window
        messages = [{"role": "user", "content": user}]
        if rng.random() < 0.5:
            messages.insert(0, {"role": "system", "content": "Be brief. " * rng.randint(1, 6)})
        rows.append({"custom_id": f"req-{i:05d}-{rng.randrange(10**6)}", "messages": messages,
                     "max_tokens": rng.randint(1, 9)})
    folder = tmp_path_factory.mktemp("data")
    (folder / "in.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = str(folder / "prompts.parquet")
    report = ingest(str(folder / "in.jsonl"), out, str(folder / "rejects.parquet"))
    assert report.valid == ROWS
    return out


def _shard_files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _build(llm: LLM, prompts: str, out: Path, **kw) -> shards.ShardReport:
    """The per-row path (the one with workers); the columnar default is held to it in
    tests/test_shard_columnar.py."""
    return build_shards(llm, prompts, str(out), NUM_SHARDS, rejects_url=str(out / "shard_rejects.parquet"),
                        batch_rows=700, path="rows", **kw)


@pytest.fixture(scope="module")
def sequential(llm: LLM, prompts: str, tmp_path_factory) -> tuple[Path, shards.ShardReport]:
    out = tmp_path_factory.mktemp("sequential")
    return out, _build(llm, prompts, out, tokenize_workers=1)


def test_sequential_path_tokenizes_like_the_engine(llm, sequential):
    out, report = sequential
    assert report.tokenize_workers == 1 and report.rows == ROWS
    rejects = pq.read_table(out / "shard_rejects.parquet").to_pylist()
    reasons = [r["reason"] for r in rejects]
    refused = [r for r in reasons if "this conversation is refused" in r]
    too_long = [r for r in reasons if "the context window is 160" in r]
    assert refused and too_long and len(refused) + len(too_long) == len(rejects) == report.rejected
    assert [r["row"] for r in rejects] == sorted(r["row"] for r in rejects)  # input order
    seen = 0
    for key in shard_keys(NUM_SHARDS):
        rows = pq.read_table(shard_url(str(out), "shards", key)).to_pylist()
        assert [r["row"] for r in rows] == sorted(r["row"] for r in rows)
        for r in rows:
            assert shard_of(r["custom_id"], NUM_SHARDS) == int(key)
            assert r["prompt_token_ids"] == llm.tokenizer.encode_chat(r["messages"])
            assert r["block_keys"] == llm.prompt_block_keys(r["prompt_token_ids"])
        seen += len(rows)
    assert seen == report.tokenized == ROWS - len(rejects)


@pytest.mark.parametrize(("workers", "chunk_rows"), [(2, 64), (3, 7)])
def test_pool_writes_the_same_files(llm, prompts, sequential, tmp_path, workers, chunk_rows):
    seq_out, seq_report = sequential
    report = _build(llm, prompts, tmp_path, tokenize_workers=workers, tokenize_chunk_rows=chunk_rows,
                    pool_min_rows=0)
    assert report.tokenize_workers == workers
    assert {**report.to_json(), "tokenize_workers": 1} == seq_report.to_json()
    seq_files, par_files = _shard_files(seq_out), _shard_files(tmp_path)
    assert sorted(par_files) == sorted(seq_files)
    for name, data in seq_files.items():  # byte for byte: ids, keys, shard, rejects, order
        assert par_files[name] == data, name


def test_pool_stream_equals_in_process_stream_and_stays_bounded(llm):
    requests = [ChatRequest(i, f"id-{i}", [{"role": "user", "content": f"hello {i} " * (i % 70)}],
                            _sampling(), None) for i in range(1, 301)]
    pulled = 0

    def batches():  # single-row batches: one chunk each, so pulls count chunks
        nonlocal pulled
        for req in requests:
            pulled += 1
            yield [req]

    workers, got = 2, []
    for req, outcome in tokenized_in_pool(RowTokenizer.of(llm), batches(), workers=workers, chunk_rows=5):
        got.append((req, outcome))
        assert pulled - len(got) <= 2 * workers  # chunks submitted but not yet consumed
    want = list(tokenized_in_process(llm, [requests]))
    assert got == want
    assert any(isinstance(o, Tokenized) for _, o in got) and any(not isinstance(o, Tokenized) for _, o in got)


def _sampling():
    from kvbatch.engine.runtime.sampling_params import SamplingParams

    return SamplingParams(max_tokens=4)


@dataclass(frozen=True)
class PoisonedTokenizer(RowTokenizer):
    """Dies (like a segfault or an OOM kill) or raises on the row whose custom_id is ``poison``."""

    poison: str = ""
    how: str = "exit"

    def tokenize(self, tokenizer, requests):
        if any(r.custom_id == self.poison for r in requests):
            if self.how == "exit":
                os._exit(139)
            raise KeyError(f"poisoned row {self.poison}")
        return super().tokenize(tokenizer, requests)


def _poison(monkeypatch, llm: LLM, custom_id: str, how: str) -> None:
    real = RowTokenizer.of(llm)
    poisoned = PoisonedTokenizer(real.source, real.max_model_len, real.kv_root_key, real.block_size,
                                 poison=custom_id, how=how)
    monkeypatch.setattr(shards.RowTokenizer, "of", classmethod(lambda cls, _llm: poisoned))


@pytest.mark.parametrize("how", ["exit", "raise"])
def test_a_dead_worker_commits_nothing(llm, prompts, sequential, tmp_path, monkeypatch, how):
    seq_out, _ = sequential
    last_good = _shard_files(seq_out)
    for name, data in last_good.items():  # a previous good commit of the same tables
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(data)
    ids = pq.read_table(prompts, columns=["custom_id"]).column("custom_id").to_pylist()
    _poison(monkeypatch, llm, ids[1900], how)  # late enough that shards have rows written
    expected = (TokenizerWorkerError, "worker process died .* input rows") if how == "exit" else \
        (KeyError, "poisoned row")
    with pytest.raises(expected[0], match=expected[1]):
        _build(llm, prompts, tmp_path, tokenize_workers=2, tokenize_chunk_rows=50, pool_min_rows=0)
    assert _shard_files(tmp_path) == last_good  # no partial shard, no temp files left


def test_a_dead_worker_on_a_fresh_root_leaves_no_files(llm, prompts, tmp_path, monkeypatch):
    ids = pq.read_table(prompts, columns=["custom_id"]).column("custom_id").to_pylist()
    _poison(monkeypatch, llm, ids[300], "exit")
    with pytest.raises(TokenizerWorkerError):
        _build(llm, prompts, tmp_path, tokenize_workers=2, tokenize_chunk_rows=50, pool_min_rows=0)
    assert _shard_files(tmp_path) == {}


def test_small_tables_and_one_worker_stay_in_process(llm, prompts, tmp_path, monkeypatch):
    def no_pool(*a, **kw):
        raise AssertionError("the pool must not start")

    monkeypatch.setattr(shards, "tokenized_in_pool", no_pool)
    assert _build(llm, prompts, tmp_path / "a", tokenize_workers=1, pool_min_rows=0).tokenize_workers == 1
    assert _build(llm, prompts, tmp_path / "b", tokenize_workers=4).tokenize_workers == 1  # < pool_min_rows


def test_the_columnar_default_writes_the_rows_of_the_per_row_path(llm, prompts, sequential, tmp_path):
    """With a template that refuses some conversations (so it reads content: nothing is
    spliced) and prompts past the context window, the default path writes the same rows."""
    seq_out, seq_report = sequential
    report = build_shards(llm, prompts, str(tmp_path), NUM_SHARDS, rejects_url=str(tmp_path / "shard_rejects.parquet"),
                          batch_rows=700)
    assert report.to_json() == seq_report.to_json()
    for name in _shard_files(seq_out):
        assert pq.read_table(tmp_path / name).equals(pq.read_table(seq_out / name)), name


def test_worker_count_is_validated(llm, prompts, tmp_path):
    with pytest.raises(ValueError, match="tokenize_workers must be >= 1, got 0"):
        _build(llm, prompts, tmp_path, tokenize_workers=0)
    with pytest.raises(ValueError, match="tokenize_chunk_rows must be >= 1"):
        _build(llm, prompts, tmp_path, tokenize_workers=2, tokenize_chunk_rows=0)
    assert not any(tmp_path.iterdir())


def test_asset_config_refuses_fewer_than_one_worker():
    from pydantic import ValidationError

    from kvbatch.pipelines.assets import ShardsConfig

    assert ShardsConfig().tokenize_workers is None and ShardsConfig(tokenize_workers=3).tokenize_workers == 3
    with pytest.raises(ValidationError, match="greater than or equal to 1"):
        ShardsConfig(tokenize_workers=0)
