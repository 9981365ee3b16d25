"""Ingesting the same file again is idempotent: the same prompts and rejects tables, the same
report, one committed file per table (nothing a reader of the day's folder counts twice), and the
shards built again from them with the same shard count hold each row once. Locally and with the
tables on S3 (moto on loopback), for JSONL and Parquet input."""

from __future__ import annotations

import json
from pathlib import Path

import fsspec
import pyarrow.parquet as pq
import pytest

from kvbatch.engine.runtime.llm import LLM
from kvbatch.io.shard_tables import read_shards
from kvbatch.ops.ingest.prompts import ingest
from kvbatch.ops.ingest.sample_dataset import sample_rows
from kvbatch.ops.shards.build import build_shards
from tests.tiny_models import build_tiny_chat_model

N = 40  # sample rows, then one repeated id and one unreadable line: 42 input rows


def _dataset(folder: Path, fmt: str) -> str:
    rows = list(sample_rows(N, seed=3, max_tokens=4))
    rows.append(dict(rows[0]))  # a repeated custom_id: a reject
    if fmt == "jsonl":
        path = folder / "in.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "[1, 2]\n")
        return str(path)
    import pyarrow as pa

    path = folder / "in.parquet"
    pq.write_table(pa.table({"custom_id": [r["custom_id"] for r in rows],
                             "prompt": [r["body"]["messages"][-1]["content"] for r in rows],
                             "max_tokens": [4] * len(rows)}), path)
    return str(path)


def _read_folder(url: str, opts: dict) -> int:
    """The rows a reader of the whole folder sees (every file in it)."""
    fs, path = fsspec.core.url_to_fs(url, **opts)
    fs.invalidate_cache()
    return sum(pq.ParquetFile(fs.open(f, "rb")).metadata.num_rows for f in fs.find(path))


@pytest.mark.parametrize("where", ["local", "s3"])
@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_the_same_file_ingested_twice_gives_the_same_tables_and_counts(tmp_path, request, where, fmt):
    src = _dataset(tmp_path, fmt)
    if where == "s3":
        root, opts, _ = request.getfixturevalue("s3")
    else:
        root, opts = str(tmp_path / "out"), {}
    prompts, rejects = f"{root}/prompts/date=2026-11-28/part.parquet", f"{root}/rejects/date=2026-11-28/part.parquet"
    reports, tables = [], []
    for _ in range(2):
        rep = ingest(src, prompts, rejects, output_storage_options=opts)
        reports.append(rep.to_json())
        with fsspec.open(prompts, "rb", **opts) as p, fsspec.open(rejects, "rb", **opts) as r:
            tables.append((pq.read_table(p), pq.read_table(r)))
    assert reports[0] == reports[1]
    assert (reports[1]["rows"], reports[1]["valid"]) == (N + 1 + (fmt == "jsonl"), N)
    assert tables[0][0].equals(tables[1][0]) and tables[0][1].equals(tables[1][1])
    assert _read_folder(f"{root}/prompts", opts) == N
    assert _read_folder(f"{root}/rejects", opts) == 1 + (fmt == "jsonl")


def test_shards_rebuilt_with_the_same_count_hold_each_row_once(tmp_path):
    tiny = build_tiny_chat_model(tmp_path / "tiny", max_positions=512)
    llm = LLM(str(tiny))
    src = _dataset(tmp_path, "jsonl")
    prompts, out = str(tmp_path / "prompts.parquet"), str(tmp_path / "out")
    for _ in range(2):
        ingest(src, prompts, str(tmp_path / "rejects.parquet"))
        report = build_shards(llm, prompts, out, 3, rejects_url=str(tmp_path / "shard_rejects.parquet"))
        assert report.tokenized + report.rejected == N
    ids = read_shards(out, "shards", columns=["custom_id"]).column("custom_id").to_pylist()
    assert len(ids) == len(set(ids)) == report.tokenized
