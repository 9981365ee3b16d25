"""Decode writes as it goes: part files every N results, a re-run after a crash or SIGKILL resumes
from them, and the committed results hold every request exactly once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from kvbatch.engine.runtime.engine_config import EngineConfig
from kvbatch.engine.runtime.llm import LLM
from kvbatch.engine.runtime.sampling_params import SamplingParams
from kvbatch.io.batch_output import JsonlWriter
from kvbatch.ops.decode.checkpoint import INDEX_COLUMN, PartWriter, done_indexes, prepare_parts
from kvbatch.ops.jobs import Job
from kvbatch.ops.prefill.manifests import manifest_line
from kvbatch.ops.decode.shard import RESULTS_SCHEMA, decode_shard
from tests.tiny_models import build_tiny_chat_model

ENGINE = {"batch_invariant": True, "max_num_seqs": 4}


def _engine_spec(tiny: Path) -> dict:
    """ENGINE as a worker spec's ``engine_spec``."""
    from kvbatch.engine.spec import EngineSpec

    return EngineSpec(model=str(tiny), dtype="fp32", deterministic=True, max_batch=4).to_json()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return build_tiny_chat_model(tmp_path_factory.mktemp("tiny"), max_positions=128)


def _llm(tiny: Path) -> LLM:
    return LLM(str(tiny), engine_config=EngineConfig(**ENGINE))


def _manifests(llm: LLM, path: Path, n: int, max_tokens: int = 3) -> str:
    """A shard's manifests of ``n`` greedy requests (no KV store: decode computes the prompts)."""
    with JsonlWriter(str(path)) as out:
        for i in range(n):
            ids = llm.tokenizer.encode_chat([{"role": "user", "content": f"Tell me about {i}"}])
            job = Job(i, f"id-{i}", i + 1, ids, SamplingParams(max_tokens=max_tokens, temperature=0.0))
            out.write(manifest_line(llm, job, "kvbatch"))
    return str(path)


def _ids(results: Path) -> list[str]:
    return pq.read_table(results).column("custom_id").to_pylist()


def _rows_in_parts(parts: Path) -> int:
    return sum(pq.read_table(p, columns=[INDEX_COLUMN]).num_rows for p in parts.glob("part-*.parquet"))


def test_a_crash_loses_at_most_one_interval_and_the_rerun_commits_each_request_once(tiny, tmp_path, monkeypatch):
    llm = _llm(tiny)
    manifests = _manifests(llm, tmp_path / "m.jsonl", 11)
    clean = decode_shard(llm, manifests, str(tmp_path / "clean" / "part.parquet"))
    assert clean["succeeded"] == 11 and clean["resumed_rows"] == 0

    results, parts = tmp_path / "res" / "part.parquet", tmp_path / "parts"
    dying = _llm(tiny)
    real_stream = dying.stream

    def stream_that_dies(reqs):
        for i, r in enumerate(real_stream(reqs)):
            if i == 7:  # 7 results finished: parts of 3 committed twice, 1 result not yet
                raise RuntimeError("worker killed")
            yield r

    monkeypatch.setattr(dying, "stream", stream_that_dies)
    with pytest.raises(RuntimeError, match="worker killed"):
        decode_shard(dying, manifests, str(results), parts_url=str(parts), checkpoint_rows=3)
    assert not results.exists()
    committed = _rows_in_parts(parts)
    assert committed == 6 and 7 - committed < 3  # lost work: under one interval

    again = decode_shard(_llm(tiny), manifests, str(results), parts_url=str(parts), checkpoint_rows=3,
                         stats_url=str(tmp_path / "stats.json"))
    assert again["resumed_rows"] == 6 and again["runs"] == 2
    assert again["succeeded"] == again["requests"] == 11  # the dead run's committed work is counted once
    assert sorted(_ids(results)) == sorted(f"id-{i}" for i in range(11))
    assert not parts.exists()  # staging gone once the results are committed
    by_id = {r["custom_id"]: r["output_token_ids"] for r in pq.read_table(results).to_pylist()}
    want = {r["custom_id"]: r["output_token_ids"]
            for r in pq.read_table(tmp_path / "clean" / "part.parquet").to_pylist()}
    assert by_id == want  # resuming changes no request's tokens (greedy)
    assert json.loads((tmp_path / "stats.json").read_text())["resumed_rows"] == 6


def test_a_rerun_after_success_decodes_the_shard_again(tiny, tmp_path):
    llm = _llm(tiny)
    manifests = _manifests(llm, tmp_path / "m.jsonl", 4)
    results = tmp_path / "res" / "part.parquet"
    first = decode_shard(llm, manifests, str(results), checkpoint_rows=2)
    second = decode_shard(llm, manifests, str(results), checkpoint_rows=2)
    assert first["succeeded"] == second["succeeded"] == 4 and second["resumed_rows"] == 0
    assert sorted(_ids(results)) == [f"id-{i}" for i in range(4)]
    assert [p.name for p in results.parent.iterdir()] == ["part.parquet"]  # default staging removed too


def test_parts_of_other_manifests_are_dropped(tmp_path):
    parts = tmp_path / "parts"
    w = PartWriter(str(parts), RESULTS_SCHEMA, 0, key="old-manifests", checkpoint_rows=1)
    row = {"row": 1, "custom_id": "a", "text": "x", "output_token_ids": [1], "finish_reason": "stop",
           "prompt_tokens": 1, "completion_tokens": 1, "cached_prompt_tokens": 0, "loaded_prompt_tokens": 0,
           "max_tokens": 1, "ttft_s": 0.1, "tpot_s": None}
    w.add(0, row, dict)
    assert done_indexes(str(parts), None) == {0}
    assert prepare_parts(str(parts), "old-manifests", None) is True  # same manifests: resume
    assert done_indexes(str(parts), None) == {0}
    assert prepare_parts(str(parts), "new-manifests", None) is False  # prefill re-ran: start over
    assert done_indexes(str(parts), None) == set() and not parts.exists()
    with pytest.raises(ValueError, match="checkpoint_rows must be at least 1"):
        PartWriter(str(parts), RESULTS_SCHEMA, 0, key="k", checkpoint_rows=0)


def test_sigkill_mid_shard_then_rerun_commits_each_request_once(tiny, tmp_path):
    """A real decode worker process, killed with SIGKILL once it has committed parts, then run again."""
    llm = _llm(tiny)
    n = 40
    manifests = _manifests(llm, tmp_path / "m.jsonl", n, max_tokens=8)
    parts, results = tmp_path / "parts", tmp_path / "res" / "part.parquet"
    spec = {"command": "shard", "engine_spec": _engine_spec(tiny), "manifests_url": manifests,
            "results_url": str(results), "parts_url": str(parts), "stats_url": str(tmp_path / "stats.json"),
            "checkpoint_rows": 4, "rows": n}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    cmd = [sys.executable, "-m", "kvbatch.ops.decode.worker", "--spec", str(tmp_path / "spec.json")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        for _ in range(1200):  # at most ~120 s: until two parts are committed, or the worker ends
            if len(list(parts.glob("part-*.parquet"))) >= 2 or proc.poll() is not None:
                break
            time.sleep(0.1)
        assert proc.poll() is None, f"the worker ended before it could be killed: {proc.stderr.read().decode()}"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL and not results.exists()
    committed = _rows_in_parts(parts)
    assert 8 <= committed < n and committed % 4 == 0

    done = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    stats = json.loads(done.stdout.strip().splitlines()[-1])
    assert stats["resumed_rows"] == committed and stats["succeeded"] == n
    ids = _ids(results)
    assert len(ids) == len(set(ids)) == n and set(ids) == {f"id-{i}" for i in range(n)}
    assert not parts.exists()


def test_compaction_merges_every_rank_part_in_manifest_order(tmp_path, monkeypatch):
    """Parts of two ranks, each in finishing order, merged into one table in manifest order, across
    several merge windows."""
    import kvbatch.ops.decode.checkpoint as ckpt
    from kvbatch.ops.decode.shard import commit_parts

    monkeypatch.setattr(ckpt, "MERGE_WINDOW", 3)
    parts = tmp_path / "parts"

    def row(i: int) -> dict:
        return {"row": i + 1, "custom_id": f"id-{i}", "text": "x", "output_token_ids": [1], "finish_reason": "stop",
                "prompt_tokens": 2, "completion_tokens": 1, "cached_prompt_tokens": 0, "loaded_prompt_tokens": 0,
                "max_tokens": 1, "ttft_s": 0.01 * i, "tpot_s": None}

    final = []
    for rank, order in ((0, [4, 0, 8, 2, 6]), (1, [3, 9, 1, 7, 5])):  # finishing order, not index order
        w = PartWriter(str(parts), RESULTS_SCHEMA, rank, key="k", checkpoint_rows=2, attempt="run1")
        for i in order:
            w.add(i, row(i), lambda: {"attempt": "run1"})
        stats = {"attempt": "run1", "rank": rank, "succeeded": 5, "requests": 5, "wall_s": 1.0 + rank}
        w.flush(stats)
        final.append(stats)
    results = tmp_path / "part.parquet"
    merged = commit_parts(final, str(parts), str(results))
    table = pq.read_table(results)
    assert table.column("row").to_pylist() == list(range(1, 11))
    assert table.schema.names == RESULTS_SCHEMA.names  # the staging column is not published
    assert merged["requests"] == 10 and merged["wall_s"] == 2.0 and merged["ttft_s_p50"] is not None
    assert not parts.exists()
