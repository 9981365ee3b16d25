"""The response cache in worker groups (docs/response-cache.md, "Worker groups"): ``kvbatch
generate --workers W --response-cache`` answers and counts as one process does, and an
expert-parallel group steps in lockstep while one rank serves hits and another computes."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.test_expert_parallel import build_moe_chat_model
from tests.test_response_cache import (
    BAD,
    GREEDY,
    LOGPROBS,
    SEEDED,
    UNSEEDED,
    _answers,
    _entries,
    _row,
    _run,
    two_pipeline_nights,
)
from tests.tiny_models import build_tiny_chat_model

ROWS = GREEDY + LOGPROBS + SEEDED + UNSEEDED + BAD
# What a group's metrics must share with one process's (the time and the unseeded row's draws aside).
SAME = ("requests", "succeeded", "rejected", "rejects_by_field", "response_cache_rows",
        "response_cache_prompt_tokens", "response_cache_output_tokens")


@pytest.fixture(scope="module")
def tiny_chat(tmp_path_factory) -> Path:
    return build_tiny_chat_model(tmp_path_factory.mktemp("tiny_chat"), max_positions=96)


def _counts(metrics: dict) -> dict:
    rc = metrics["response_cache"]
    return {k: metrics[k] for k in SAME} | {k: rc[k] for k in ("hits", "misses", "writes", "not_reusable")}


def _reusable(lines: list[dict]) -> dict[str, str]:
    return {k: v for k, v in _answers(lines).items() if k != "u"}  # the unseeded row draws in arrival order


def test_two_workers_answer_and_count_as_one_process(tiny_chat, tmp_path):
    """Two nights of the same file, in one process and in a group of two: the same answers and
    the same cache counts; the group's second night is all hits (its engine computing nothing but
    the one row that is never reused), and its metrics count the served rows apart."""
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    _, s1, m_s1 = _run(tiny_chat, tmp_path, "s1", ROWS, one)
    _, s2, m_s2 = _run(tiny_chat, tmp_path, "s2", ROWS, one)
    code, g1, m_g1 = _run(tiny_chat, tmp_path, "g1", ROWS, two, "--workers", "2")
    assert code == 1  # the BAD row
    code, g2, m_g2 = _run(tiny_chat, tmp_path, "g2", ROWS, two, "--workers", "2")
    assert code == 1
    assert _reusable(g1) == _reusable(s1) and _reusable(g2) == _reusable(s2) == _reusable(s1)
    assert _counts(m_g1) == _counts(m_s1) and _counts(m_g2) == _counts(m_s2)
    reusable = len(GREEDY) + len(LOGPROBS) + len(SEEDED)
    assert (m_g2["response_cache"]["hits"], m_g2["response_cache"]["misses"]) == (reusable, 0)
    assert m_g2["response_cache_rows"] == reusable and m_g2["workers"] == 2
    # The engine's own counts: only the unseeded row's, computed both nights.
    [u] = [x["response"]["body"]["usage"] for x in g2 if x["custom_id"] == "u"]
    assert (m_g2["prompt_tokens"], m_g2["output_tokens"]) == (u["prompt_tokens"], u["completion_tokens"])
    assert len(_entries(Path(two))) == reusable  # the ranks wrote each entry once between them


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory) -> Path:
    return build_moe_chat_model("mixtral", tmp_path_factory.mktemp("moe") / "mixtral")


def _texts(lines: list[dict]) -> dict[str, tuple]:
    return {x["custom_id"]: (x["response"]["body"]["choices"][0]["message"]["content"],
                             x["response"]["body"]["choices"][0]["finish_reason"]) for x in lines}


@pytest.mark.slow
def test_an_expert_parallel_group_steps_while_one_rank_serves_hits(mixtral, tmp_path):
    """Night 1 answers rows a0..a3 in one process. Night 2, in an expert-parallel group of two,
    reads a0, b1, a2, b3: rank 0's rows (0 and 2) are all hits, rank 1's all misses, so rank 0
    reads its hits, finishes its input and joins every group step idle, its experts serving
    rank 1's tokens. Night 3 is the same file again: every row a hit on both ranks, no step."""
    cache = str(tmp_path / "cache")
    a = [_row(f"a{i}", f"Tell me about item {i}", temperature=0, max_tokens=8) for i in range(4)]
    b = [_row(f"b{i}", f"Tell me about thing {i} and more", temperature=0, max_tokens=8) for i in range(4)]
    night2 = [a[0], b[1], a[2], b[3]]
    _, first, _ = _run(mixtral, tmp_path, "n1", a, cache, deterministic=False)
    _, fresh, _ = _run(mixtral, tmp_path, "fresh", night2, None, deterministic=False)
    code, second, m2 = _run(mixtral, tmp_path, "n2", night2, cache, "--workers", "2", deterministic=False)
    assert code == 0, m2
    assert (m2["response_cache"]["hits"], m2["response_cache"]["misses"]) == (2, 2)
    assert m2["response_cache_rows"] == 2 and m2["expert_parallel"]["steps"] > 0
    texts = _texts(second)
    assert {k: texts[k] for k in ("a0", "a2")} == {k: v for k, v in _texts(first).items() if k in ("a0", "a2")}
    assert {k: texts[k] for k in ("b1", "b3")} == {k: v for k, v in _texts(fresh).items() if k in ("b1", "b3")}
    code, third, m3 = _run(mixtral, tmp_path, "n3", night2, cache, "--workers", "2", deterministic=False)
    assert code == 0 and (m3["response_cache"]["hits"], m3["response_cache"]["misses"]) == (4, 0)
    assert m3["expert_parallel"]["steps"] == 0 and m3["output_tokens"] == 0
    assert _texts(third) == texts
    assert m3["response_cache_output_tokens"] == m2["response_cache_output_tokens"] + m2["output_tokens"]


@pytest.mark.slow
def test_the_pipeline_decode_under_torchrun_takes_the_cache(tiny_chat, tmp_path):
    """``kv_store.response_cache`` with a two-rank decode group (launcher local: torchrun, Pipes):
    the second materialization of the shard is served from the cache by both ranks, its results
    equal and marked ``cached``, its metadata counting the hits."""
    from kvbatch.resources import DecodeClusterResource

    two_pipeline_nights(tmp_path, tiny_chat, DecodeClusterResource(launcher="local", world_size=2, backend="gloo"))
