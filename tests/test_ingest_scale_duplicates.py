"""Ingest finds repeated custom_ids through hash-partitioned spill files (never a set of every
id in memory), with exactly the outputs of the one-pass reader that keeps such a set: the first
row of an id wins, a later one is rejected as ``duplicate of line N`` (``row N`` for Parquet),
a rejected row's id counts too, and both tables keep input order."""

from __future__ import annotations

import json
import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kvbatch.io.batch_requests import RejectedRow
from kvbatch.io.prompt_table import reject_record, request_record
from kvbatch.ops.ingest import prompts as ingest_module
from kvbatch.ops.ingest.prompts import ingest, read_dataset


def _rows(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    ids = [f"id-{rng.randrange(n // 3)}" for _ in range(n)]  # many repeats, some three or more times
    rows = []
    for i, cid in enumerate(ids):
        row = {"custom_id": cid, "messages": [{"role": "user", "content": f"hi {i}"}], "max_tokens": 4}
        if rng.random() < 0.1:
            row["temperature"] = "hot"  # a reject whose id still counts
        rows.append(row)
    return rows


def _expected(url: str, fmt: str) -> tuple[list[dict], list[dict]]:
    good, bad = [], []
    for item in read_dataset(url, fmt=fmt, check_duplicates=True):
        (bad.append(reject_record(item)) if isinstance(item, RejectedRow) else good.append(request_record(item)))
    return good, bad


@pytest.mark.parametrize(("fmt", "columnar"), [("jsonl", True), ("jsonl", False), ("parquet", True)])
def test_spilled_duplicate_search_equals_the_one_pass_reader(tmp_path, monkeypatch, fmt, columnar):
    rows = _rows(3000, seed=3 if fmt == "jsonl" else 4)
    if fmt == "jsonl":
        src = tmp_path / "in.jsonl"
        src.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")  # a blank line: a reject with no id
    else:
        src = tmp_path / "in.parquet"
        table = pa.table({"custom_id": [r["custom_id"] for r in rows],
                          "messages": [r["messages"] for r in rows],
                          "max_tokens": [r["max_tokens"] for r in rows],
                          "temperature": [2.5 if "temperature" in r else None for r in rows]})  # > 2: a reject
        pq.write_table(table, src)
    calls = []
    real = ingest_module.read_dataset
    monkeypatch.setattr(ingest_module, "read_dataset", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    report = ingest(str(src), str(tmp_path / "p.parquet"), str(tmp_path / "r.parquet"), batch_rows=500,
                    columnar=columnar)
    # The per-row reader keeps no id set; the columnar JSONL path does not use it (nor any set).
    assert [kw["check_duplicates"] for kw in calls] == ([] if fmt == "jsonl" and columnar else [False])

    good, bad = _expected(str(src), fmt)
    unit = "line" if fmt == "jsonl" else "row"
    assert sum(f"duplicate of {unit}" in r["reason"] for r in bad) > 500
    assert pq.read_table(tmp_path / "p.parquet").to_pylist() == good
    assert pq.read_table(tmp_path / "r.parquet").to_pylist() == bad
    assert (report.valid, report.rejected) == (len(good), len(bad))
    by_field: dict[str, int] = {}
    for r in bad:
        by_field[r["field"]] = by_field.get(r["field"], 0) + 1
    assert report.rejects_by_field == by_field


def test_every_id_of_a_repeat_lands_in_one_spill_file(tmp_path):
    spill = ingest_module.IdSpill(str(tmp_path), partitions=4, batch_rows=7)  # many small flushes
    for row in range(1, 200):
        spill.add(row, f"id-{row % 50}")
    rows, first = spill.duplicates()
    assert rows.tolist() == list(range(51, 200))
    assert first.tolist() == [r % 50 if r % 50 else 50 for r in range(51, 200)]
    assert len(list(tmp_path.glob("ids-*.parquet"))) == 4
