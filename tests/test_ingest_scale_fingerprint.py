"""Tokenizer only where tokenizing: the model fingerprint is computed once and kept (verified by
file sizes, mtimes and header hashes), so ``prompt_shards`` and the orchestrating steps read no
weights, and their shard files are those of a loaded model's."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from kvbatch.engine.models import weights
from kvbatch.engine.runtime.engine_config import EngineConfig
from kvbatch.engine.runtime.llm import LLM
from kvbatch.io.shard_tables import shard_url
from kvbatch.engine.spec import EngineSpec
from kvbatch.ops import fingerprint
from kvbatch.ops.ingest.prompts import ingest
from kvbatch.ops.shards.build import RowTokenizer, build_shards, shard_keys
from kvbatch.resources import ModelResource
from tests.tiny_models import build_tiny_chat_model


@pytest.fixture(scope="module")
def tiny_source(tmp_path_factory) -> Path:
    return build_tiny_chat_model(tmp_path_factory.mktemp("tiny"), max_positions=96)


@pytest.fixture
def tiny(tiny_source, tmp_path, monkeypatch) -> Path:
    """A fresh copy of the tiny model and an empty fingerprint cache for each test."""
    monkeypatch.setenv(fingerprint.FINGERPRINT_CACHE_ENV, str(tmp_path / "cache"))
    return Path(shutil.copytree(tiny_source, tmp_path / "model"))


def _no_weights(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("weights were loaded")

    monkeypatch.setattr(weights, "load_checkpoint", refuse)


def test_the_fingerprint_is_computed_once_then_read_back(tiny, monkeypatch):
    want = weights.load_checkpoint(str(tiny))
    assert fingerprint.cached_identity(str(tiny)) is None
    first = fingerprint.model_identity(str(tiny))  # computes and keeps it
    assert first == fingerprint.ModelIdentity(want.fingerprint, 96)
    _no_weights(monkeypatch)
    assert fingerprint.model_identity(str(tiny)) == first


@pytest.mark.parametrize("change", ["config", "weights_header", "weights_mtime"])
def test_a_changed_model_file_is_fingerprinted_again(tiny, change):
    fingerprint.model_identity(str(tiny))
    assert fingerprint.cached_identity(str(tiny)) is not None
    weights_file = next(tiny.glob("*.safetensors"))
    if change == "config":
        config = json.loads((tiny / "config.json").read_text())
        config["rms_norm_eps"] = 1e-6
        (tiny / "config.json").write_text(json.dumps(config))
    elif change == "weights_header":
        from safetensors.torch import load_file, save_file

        tensors = load_file(weights_file)
        name = min(tensors)
        tensors[name] = tensors[name] * 2
        save_file(tensors, weights_file, metadata={"format": "pt", "note": "changed"})
    else:
        stat = weights_file.stat()
        os.utime(weights_file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert fingerprint.cached_identity(str(tiny)) is None  # the stamp no longer matches
    again = fingerprint.model_identity(str(tiny))
    assert again.fingerprint == weights.load_checkpoint(str(tiny)).fingerprint


def test_row_tokenizer_for_spec_is_the_loaded_models_and_reads_no_weights(tiny, tmp_path, monkeypatch):
    ec = EngineConfig(max_num_seqs=2, block_size=8)
    llm = LLM(str(tiny), engine_config=ec)
    data = tmp_path / "in.jsonl"
    rows = [{"custom_id": f"r{i}", "messages": [{"role": "system", "content": "Be brief."},
                                                 {"role": "user", "content": "word " * (i % 30)}]}
            for i in range(60)] + [{"custom_id": "long", "messages": [{"role": "user", "content": "w " * 200}]}]
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    prompts = str(tmp_path / "prompts.parquet")
    ingest(str(data), prompts, str(tmp_path / "rejects.parquet"))
    build_shards(llm, prompts, str(tmp_path / "a"), 3, rejects_url=str(tmp_path / "a.parquet"), tokenize_workers=1)

    fingerprint.model_identity(str(tiny))  # kept once (a real run: the first load of the weights)
    _no_weights(monkeypatch)
    row_tokenizer = RowTokenizer.for_spec(EngineSpec(model=str(tiny), dtype="fp32", max_batch=2, block_size=8))
    assert row_tokenizer == RowTokenizer.of(llm)
    report = build_shards(row_tokenizer, prompts, str(tmp_path / "b"), 3, rejects_url=str(tmp_path / "b.parquet"),
                          tokenize_workers=1)
    assert report.rejected == 1 and report.tokenized == 60
    for key in shard_keys(3):
        assert pq.read_table(shard_url(str(tmp_path / "b"), "shards", key)).equals(
            pq.read_table(shard_url(str(tmp_path / "a"), "shards", key)))
    assert pq.read_table(tmp_path / "b.parquet").equals(pq.read_table(tmp_path / "a.parquet"))


def test_model_resource_keeps_the_fingerprint_when_it_loads_and_reads_it_back(tiny, monkeypatch):
    resource = ModelResource(model=str(tiny))
    loaded = resource.load()  # the first load of the weights keeps the fingerprint
    expected = resource.kv_fingerprint()
    from kvbatch.ops import engine_build

    monkeypatch.setattr(engine_build, "_CHECKPOINTS", {})  # a fresh process: nothing loaded
    _no_weights(monkeypatch)
    assert resource.kv_fingerprint() == expected
    assert resource.row_tokenizer().kv_root_key == loaded.kv_root_key
