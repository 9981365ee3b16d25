"""The pipeline's plain-Python steps (no Dagster): ingest, shard, prefill/decode a shard, meter."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kvbatch.engine.runtime.engine_config import EngineConfig
from kvbatch.engine.runtime.llm import LLM
from kvbatch.engine.spec import EngineSpec
from kvbatch.io.kvstore.store import KVStore, KVStoreConfig
from kvbatch.io.shard_tables import read_shards, shard_url, write_table
from kvbatch.ops.decode.shard import decode_shard
from kvbatch.ops.ingest.prompts import ingest
from kvbatch.ops.prefill.prefill import prefill_shard
from kvbatch.ops.results.cost import Pricing, shard_metrics
from kvbatch.ops.shards.build import build_shards
from kvbatch.ops.shards.routing import shard_of
from tests.tiny_models import build_tiny_chat_model

SYSTEM = "You are a librarian. Recommend one book, give its author, and keep it to one sentence. " * 2


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return build_tiny_chat_model(tmp_path_factory.mktemp("tiny"), max_positions=128)


def _llm(tiny: Path, store=None) -> LLM:
    return LLM(str(tiny), engine_config=EngineConfig(batch_invariant=True, max_num_seqs=4), kv_store=store)


def _write_jsonl(path: Path, rows: list) -> str:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return str(path)


def test_ingest_keeps_every_row(tmp_path):
    src = _write_jsonl(tmp_path / "in.jsonl", [
        {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stop": "x"}},
        {"custom_id": "b", "messages": [{"role": "developer", "content": "be short"},
                                        {"role": "user", "content": [{"type": "text", "text": "yo"}]}]},
        "[1, 2]",
        {"custom_id": "c", "messages": [{"role": "user", "content": "hi"}], "top_p": 0},
        {"custom_id": "a", "messages": [{"role": "user", "content": "again"}]},
    ])
    rep = ingest(src, str(tmp_path / "p.parquet"), str(tmp_path / "r.parquet"), default_max_tokens=7)
    assert (rep.rows, rep.valid, rep.rejected) == (5, 2, 3)
    good = pq.read_table(tmp_path / "p.parquet").to_pylist()
    assert [(g["custom_id"], g["max_tokens"], g["stop"]) for g in good] == [("a", 5, ["x"]), ("b", 7, [])]
    assert good[1]["messages"][0] == {"role": "system", "content": "be short", "tool_calls": None, "tool_call_id": None}
    bad = pq.read_table(tmp_path / "r.parquet").to_pylist()
    assert [(b["row"], b["custom_id"], b["field"]) for b in bad] == [(3, None, "$"), (4, "c", "top_p"),
                                                                      (5, "a", "custom_id")]
    assert "duplicate of line 1" in bad[2]["reason"]


def test_ingest_parquet_with_column_mapping(tmp_path):
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": ["x1", "x2", None, "x1"], "question": ["hello", "bye", "q", "again"],
                             "limit": [3, None, 2, 1], "temp": [0.0, 5.0, 0.0, 0.0]}), src)
    rep = ingest(str(src), str(tmp_path / "p.parquet"), str(tmp_path / "r.parquet"),
                 columns={"custom_id": "id", "prompt": "question", "max_tokens": "limit", "temperature": "temp"})
    assert (rep.valid, rep.rejected) == (1, 3)
    good = pq.read_table(tmp_path / "p.parquet").to_pylist()
    assert good[0]["messages"] == [{"role": "user", "content": "hello", "tool_calls": None, "tool_call_id": None}] and good[0]["max_tokens"] == 3
    fields = [(b["row"], b["field"]) for b in pq.read_table(tmp_path / "r.parquet").to_pylist()]
    assert fields == [(2, "temperature"), (3, "custom_id"), (4, "custom_id")]
    with pytest.raises(ValueError, match="not in the file"):
        ingest(str(src), str(tmp_path / "p2.parquet"), str(tmp_path / "r2.parquet"), columns={"custom_id": "nope"})


def test_shard_hash_is_stable():
    assert [shard_of(f"id-{i}", 8) for i in range(6)] == [shard_of(f"id-{i}", 8) for i in range(6)]
    assert shard_of("request-1", 8) == int.from_bytes(
        __import__("hashlib").sha256(b"request-1").digest()[:8], "big") % 8


def _dataset(tmp_path: Path, n: int = 10) -> tuple[str, str]:
    rows = [{"custom_id": f"id-{i}", "messages": [{"role": "system", "content": SYSTEM},
                                                  {"role": "user", "content": f"Something about {i}"}],
             "max_tokens": 3, "temperature": 0} for i in range(n)]
    rows.append({"custom_id": "too-long", "messages": [{"role": "user", "content": "word " * 200}]})
    src = _write_jsonl(tmp_path / "in.jsonl", rows)
    prompts = str(tmp_path / "prompts.parquet")
    ingest(src, prompts, str(tmp_path / "rejects.parquet"))
    return src, prompts


def test_shards_match_sequential_tokenization(tiny, tmp_path):
    _, prompts = _dataset(tmp_path)
    llm = _llm(tiny)
    root = str(tmp_path / "out")
    rep = build_shards(llm, prompts, root, 4, rejects_url=str(tmp_path / "shard_rejects.parquet"))
    assert rep.tokenized == 10 and rep.rejected == 1 and sum(rep.rows_by_shard.values()) == 10
    rej = pq.read_table(tmp_path / "shard_rejects.parquet").to_pylist()
    assert rej[0]["custom_id"] == "too-long" and "context window" in rej[0]["reason"]
    table = read_shards(root, "shards")
    assert sorted(set(table.column("shard").to_pylist())) <= ["0000", "0001", "0002", "0003"]
    for r in table.to_pylist():
        assert r["shard"] == f"{shard_of(r['custom_id'], 4):04d}"
        assert r["prompt_token_ids"] == llm.tokenizer.encode_chat(r["messages"])
        assert r["block_keys"] == llm.prompt_block_keys(r["prompt_token_ids"])
    for key in ("0000", "0001", "0002", "0003"):  # empty shards are committed too
        assert Path(shard_url(root, "shards", key)).exists()


def test_crashed_decode_leaves_the_last_good_commit(tiny, tmp_path, monkeypatch):
    _, prompts = _dataset(tmp_path, n=6)
    root = str(tmp_path / "out")
    build_shards(_llm(tiny), prompts, root, 1, rejects_url=str(tmp_path / "sr.parquet"))
    fp = EngineSpec(dtype="fp32", block_size=16).kv_fingerprint(_llm(tiny).checkpoint.fingerprint)
    store = KVStore.from_config(KVStoreConfig(url=str(tmp_path / "kv"), memory_bytes=0), fp)
    manifests = shard_url(root, "manifests", "0000", "manifests.jsonl")
    pre = prefill_shard(_llm(tiny, store), shard_url(root, "shards", "0000"), manifests)
    assert pre["requests"] == 6 and pre["connector"]["blocks_written"] > 0
    results = shard_url(root, "results", "0000")
    good = decode_shard(_llm(tiny, store), manifests, results)
    assert good["succeeded"] == 6 and good["loaded_prompt_tokens"] > 0
    committed = Path(results).read_bytes()

    llm = _llm(tiny, store)
    real_stream = llm.stream

    def dying_stream(reqs):
        for i, r in enumerate(real_stream(reqs)):
            if i == 3:
                raise RuntimeError("worker killed")
            yield r

    monkeypatch.setattr(llm, "stream", dying_stream)
    with pytest.raises(RuntimeError, match="worker killed"):
        decode_shard(llm, manifests, results)
    assert Path(results).read_bytes() == committed
    assert [p.name for p in Path(results).parent.iterdir()] == ["part.parquet"]


def test_prefill_refuses_shards_of_another_model(tiny, tmp_path):
    _, prompts = _dataset(tmp_path, n=2)
    root = str(tmp_path / "out")
    build_shards(_llm(tiny), prompts, root, 1, rejects_url=str(tmp_path / "sr.parquet"))
    other = build_tiny_chat_model(tmp_path / "other", seed=1, max_positions=128)
    llm = _llm(other)
    store = KVStore.from_config(KVStoreConfig(url=str(tmp_path / "kv"), memory_bytes=0),
                                EngineSpec(dtype="fp32", block_size=16).kv_fingerprint(llm.checkpoint.fingerprint))
    with pytest.raises(ValueError, match="another model"):
        prefill_shard(_llm(other, store), shard_url(root, "shards", "0000"), str(tmp_path / "m.jsonl"))
    assert not (tmp_path / "m.jsonl").exists()


def test_cost_metrics_arithmetic(tmp_path):
    results = pa.table({"prompt_tokens": [40, 60], "loaded_prompt_tokens": [32, 48], "cached_prompt_tokens": [0, 0],
                        "completion_tokens": [5, 7], "ttft_s": [0.1, 0.3], "tpot_s": [0.01, None]})
    prefill = {"wall_s": 1800.0, "prompt_tokens_computed": 80,
               "connector": {"kv_bytes_written": 2_000_000_000, "blocks_written": 5}}
    decode = {"wall_s": 1800.0, "results_bytes": 0,
              "connector": {"prompt_tokens_served_by_tier": {"object": 80}, "kv_bytes_read_by_tier": {"object": 10**9}}}
    # Prefill on 1 device at $2/h, decode on 2 at $2/h; 2 GB kept 30 days at $0.5/GB-month; 1 GB of
    # object-tier reads leaving the region at $0.1/GB.
    pricing = Pricing(usd_per_device_hour={"cpu-host": 2.0}, prefill_devices=1, decode_devices=2,
                      usd_per_gb_month_by_tier={"object": 0.5}, retention_days_by_tier={"object": 30},
                      usd_per_gb_egress=0.1, kv_object_reads_leave_region=True)
    m = shard_metrics(results, prefill, decode, pricing)
    assert (m["device_s_prefill"], m["device_s_decode"], m["device_s"]) == (1800, 3600, 5400)
    assert m["cost_compute_usd"] == 3.0
    assert m["cost_storage_usd"] == 1.0 and m["cost_transfer_usd"] == 0.1 and m["cost_usd"] == 4.1
    assert m["prompt_tokens_decode_computed"] == 20 and m["kv_tokens_hit_object"] == 80 and m["kv_tokens_hit_disk"] == 0
    assert m["ttft_s_p50"] == 0.2 and m["tpot_s_p95"] == 0.01
    write_table(pa.Table.from_pylist([m]), str(tmp_path / "m.parquet"))


def _one_shot_ingest(src: str, **kw) -> tuple[pa.Table, pa.Table]:
    """The non-streaming reference: every row in memory, one table each."""
    from kvbatch.io.batch_requests import RejectedRow
    from kvbatch.io.prompt_table import (
        PROMPTS_SCHEMA,
        REJECTS_SCHEMA,
        reject_record,
        request_record,
    )
    from kvbatch.ops.ingest.prompts import read_dataset

    items = list(read_dataset(src, **kw))
    good = [request_record(i) for i in items if not isinstance(i, RejectedRow)]
    bad = [reject_record(i) for i in items if isinstance(i, RejectedRow)]
    return pa.Table.from_pylist(good, PROMPTS_SCHEMA), pa.Table.from_pylist(bad, REJECTS_SCHEMA)


def test_streaming_ingest_equals_one_shot(tmp_path):
    rows: list = []
    for i in range(3000):
        if i % 97 == 5:
            rows.append("{not json")
        elif i % 89 == 7:
            rows.append({"custom_id": f"id-{i}", "messages": [{"role": "user", "content": "x"}], "temperature": -1})
        else:
            rows.append({"custom_id": f"id-{i % 2990}", "messages": [{"role": "system", "content": SYSTEM},
                                                                     {"role": "user", "content": f"q {i}"}],
                         "max_tokens": 1 + i % 9, "stop": ["\n"] if i % 3 else []})
    src = _write_jsonl(tmp_path / "in.jsonl", rows)
    rep = ingest(src, str(tmp_path / "p.parquet"), str(tmp_path / "r.parquet"), batch_rows=256)
    good, bad = _one_shot_ingest(src)
    assert rep.valid == good.num_rows and rep.rejected == bad.num_rows > 40 and rep.rows == 3000
    assert pq.read_table(tmp_path / "p.parquet").equals(good)
    assert pq.read_table(tmp_path / "r.parquet").equals(bad)
    assert pq.ParquetFile(tmp_path / "p.parquet").num_row_groups == -(-good.num_rows // 256)  # written in batches

    # Parquet input streams the same way.
    pq.write_table(pq.read_table(tmp_path / "p.parquet").select(["custom_id", "messages", "max_tokens"]),
                   tmp_path / "in.parquet", row_group_size=300)
    rep = ingest(str(tmp_path / "in.parquet"), str(tmp_path / "p2.parquet"), str(tmp_path / "r2.parquet"),
                 batch_rows=100)
    good2, bad2 = _one_shot_ingest(str(tmp_path / "in.parquet"))
    assert pq.read_table(tmp_path / "p2.parquet").equals(good2) and rep.valid == good.num_rows


def test_failed_ingest_keeps_the_previous_commit(tmp_path, monkeypatch):
    import kvbatch.ops.ingest.prompts as ingest_mod

    src = _write_jsonl(tmp_path / "in.jsonl", [{"custom_id": f"r{i}", "messages": [{"role": "user", "content": "x"}]}
                                               for i in range(50)])
    ingest(src, str(tmp_path / "p.parquet"), str(tmp_path / "r.parquet"))
    before = (tmp_path / "p.parquet").read_bytes()
    real = ingest_mod.read_dataset

    def dying(*a, **kw):
        for n, item in enumerate(real(*a, **kw)):
            if n == 20:
                raise OSError("connection reset")
            yield item

    real_blocks = ingest_mod.read_line_blocks

    def dying_blocks(*a, **kw):  # the columnar JSONL path reads blocks of lines instead
        for n, block in enumerate(real_blocks(*a, **{**kw, "block_lines": 8})):
            if n == 2:
                raise OSError("connection reset")
            yield block

    monkeypatch.setattr(ingest_mod, "read_dataset", dying)
    monkeypatch.setattr(ingest_mod, "read_line_blocks", dying_blocks)
    with pytest.raises(OSError):
        ingest(src, str(tmp_path / "p.parquet"), str(tmp_path / "r.parquet"), batch_rows=8)
    assert (tmp_path / "p.parquet").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "p.parquet", "r.parquet"]


MEMORY_SCRIPT = r"""
import json, os, resource, sys
from kvbatch.ops.ingest.prompts import ingest
src, small, out = sys.argv[1], sys.argv[2], sys.argv[3]
ingest(small, out + "/warm_p.parquet", out + "/warm_r.parquet")  # allocator pools, lazy imports, codecs
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
rep = ingest(src, out + "/p.parquet", out + "/r.parquet")
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"growth": peak - base, "rows": rep.rows, "valid": rep.valid, "rejected": rep.rejected}))
"""


def test_ingest_of_200k_rows_keeps_memory_bounded(tmp_path):
    """A file of 200k chat rows (~140 MB) is ingested with peak memory growing by a small fraction
    of its size (holding every row, as a one-shot ingest does, costs ~5x the file)."""
    import subprocess
    import sys

    n = 200_000
    src, small = tmp_path / "big.jsonl", tmp_path / "small.jsonl"
    system = "You are a careful assistant for a bakery. " * 12
    with src.open("w") as f, small.open("w") as g:
        for i in range(n):
            line = json.dumps({"custom_id": f"req-{i:07d}", "max_tokens": 16 + i % 7, "temperature": 0,
                               "messages": [{"role": "system", "content": system},
                                            {"role": "user", "content": f"Question {i}: how long do they keep?"}]})
            f.write(("{bad json" if i % 10_000 == 3 else line) + "\n")
            if i < 20_000:
                g.write(line + "\n")
    size = src.stat().st_size
    out = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT, str(src), str(small), str(tmp_path)],
                         capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert (got["rows"], got["rejected"]) == (n, 20)
    assert got["growth"] < 0.25 * size, (got["growth"], size)
    pf = pq.ParquetFile(tmp_path / "p.parquet")
    assert pf.metadata.num_rows == n - 20 and pf.num_row_groups > 1
    first = next(pf.iter_batches(batch_size=4)).to_pylist()
    assert [r["custom_id"] for r in first] == ["req-0000000", "req-0000001", "req-0000002", "req-0000004"]
    assert [r["row"] for r in pq.read_table(tmp_path / "r.parquet").to_pylist()][:2] == [4, 10_004]


def test_cost_metrics_speculative_and_expert_columns():
    base = {"prompt_tokens": [10, 10], "loaded_prompt_tokens": [0, 0], "cached_prompt_tokens": [0, 0],
            "completion_tokens": [8, 4], "ttft_s": [0.1, 0.1], "tpot_s": [0.01, 0.01]}
    plain = shard_metrics(pa.table(base), {}, {}, Pricing())
    assert plain["spec_draft_tokens"] == 0 and plain["spec_acceptance_rate"] is None
    assert plain["expert_load_balancedness"] is None
    spec = pa.table({**base, "spec_draft_tokens": [8, None], "spec_accepted_tokens": [6, None],
                     "spec_target_steps": [3, None]})
    m = shard_metrics(spec, {}, {"expert_load_balancedness": 0.8}, Pricing())
    assert (m["spec_draft_tokens"], m["spec_accepted_tokens"], m["spec_target_steps"]) == (8, 6, 3)
    assert m["spec_acceptance_rate"] == 0.75 and m["spec_tokens_per_target_step"] == round(8 / 3, 6)
    assert m["expert_load_balancedness"] == 0.8
    from kvbatch.ops.results.cost import metrics_table

    assert metrics_table(m).column("spec_acceptance_rate").to_pylist() == [0.75]
    assert metrics_table(plain).column("spec_acceptance_rate").to_pylist() == [None]


def test_group_stats_merge_and_balancedness():
    from kvbatch.ops.decode.group_outputs import balancedness, merge_stats

    per_rank = [{"requests": 3, "succeeded": 3, "output_tokens": 9, "wall_s": 2.0, "expert_rows_computed": {"1": 30},
                 "connector": {"kv_bytes_read_by_tier": {"object": 100}}},
                {"requests": 2, "succeeded": 2, "output_tokens": 4, "wall_s": 3.0, "expert_rows_computed": {"1": 10},
                 "connector": {"kv_bytes_read_by_tier": {"object": 50}}}]
    rows = [{"ttft_s": 0.1 * i, "tpot_s": None} for i in range(1, 6)]
    m = merge_stats(per_rank, rows)
    assert (m["requests"], m["output_tokens"], m["wall_s"]) == (5, 13, 3.0)
    assert m["connector"]["kv_bytes_read_by_tier"]["object"] == 150
    assert m["expert_load_balancedness"] == round(20 / 30, 6) == balancedness([{"1": 30}, {"1": 10}])
    assert m["ttft_s_p50"] == pytest.approx(0.3) and len(m["by_rank"]) == 2
