"""Shards sized by the data: a date with N rows gets ceil(N / max_rows_per_shard) shards, every
one of them holding rows (``ops/shard_routing.py``, ``ops/shards.py``)."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from kvbatch.ops.ingest import ingest
from kvbatch.ops.shard_routing import shards_for_rows
from kvbatch.ops.shards import RowTokenizer, build_shards, sized_shard_count


@pytest.mark.parametrize(("rows", "per_shard", "expected"),
                         [(0, 10, 1), (1, 10, 1), (10, 10, 1), (11, 10, 2), (95, 10, 10), (10_000_000, 10_000, 1000)])
def test_a_date_gets_ceil_rows_over_rows_per_shard_shards(rows, per_shard, expected):
    assert shards_for_rows(rows, per_shard) == expected


def test_more_shards_than_the_range_has_is_an_error_naming_both():
    with pytest.raises(ValueError, match="need 1001 shards, more than the 1000"):
        shards_for_rows(10_000_001, 10_000, max_shards=1000)
    with pytest.raises(ValueError, match="max_rows_per_shard must be >= 1"):
        shards_for_rows(5, 0)


def test_build_shards_writes_that_many_shards_all_with_rows(tmp_path):
    from kvbatch.engine.models.weights import load_tokenizer_source
    from kvbatch.engine.text.tokenizer import ChatTokenizer
    from kvbatch.ops.tokenizer_source_cache import kept_tokenizer_source

    tok = ChatTokenizer.from_source(kept_tokenizer_source("smollm2-135m"))
    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "tokenizer.json").write_text(tok._tok.to_str())
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": tok.chat_template,
                                                              "bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}))
    rows = [{"custom_id": f"night-{i:04d}", "messages": [{"role": "user", "content": f"question {i}"}]}
            for i in range(95)]
    (tmp_path / "in.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    prompts = str(tmp_path / "prompts.parquet")
    ingest(str(tmp_path / "in.jsonl"), prompts, str(tmp_path / "rejects.parquet"))
    count = sized_shard_count(prompts, max_rows_per_shard=10)
    assert count == 10
    report = build_shards(RowTokenizer(load_tokenizer_source(str(folder)), 512, "cd" * 32, 16), prompts,
                          str(tmp_path / "out"), count, rejects_url=str(tmp_path / "out" / "rejects.parquet"))
    assert sorted(report.rows_by_shard) == [f"{i:04d}" for i in range(10)]
    files = sorted((tmp_path / "out" / "shards").glob("shard=*/part.parquet"))
    assert len(files) == 10
    assert all(pq.read_metadata(f).num_rows > 0 for f in files)
    assert sum(pq.read_metadata(f).num_rows for f in files) == 95
