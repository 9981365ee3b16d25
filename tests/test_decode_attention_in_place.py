"""CPU fp32 decode attention over the paged cache in place (kernels/reference_sparse_decode.py),
pinned to the per-sequence definition and to the padded gather path it replaces from
``SPARSE_DECODE_MIN_ROWS`` rows on.

- hypothesis over context lengths (empty ones included), block sizes, head layouts and block
  tables (blocks scattered over the cache, prefix blocks shared between sequences, padding
  entries pointing anywhere): equal to plain per-sequence softmax attention and to the padded
  path within the fp32 attention tolerance of tests/test_kernels.py (1e-4 / 1e-4);
- nothing is gathered: the workspace the padded path writes is left as it was;
- the plan made once serves every layer (the pattern is built once per head layout), and the
  engine takes this path for a batch of decodes, with the greedy tokens of the padded path, also
  when preemption frees blocks and hands them to other sequences;
- 16-bit caches and small batches keep the padded path, bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbatch.kernels import dispatch
from kvbatch.kernels import reference as R
from kvbatch.kernels import reference_sparse_decode as S
from tests.tiny_models import VOCAB, build_tiny

ATOL = RTOL = 1e-4  # fp32 attention, as tests/test_kernels.py's ATTN_TOL


def make_step(gen: torch.Generator, lens: list[int], block_size: int, Hq: int, Hkv: int, D: int,
              shared: int = 0, dtype: torch.dtype = torch.float32):
    """Caches, block tables and queries for one decode step: each sequence's blocks scattered over
    the cache, the first ``shared`` blocks of every sequence long enough to hold them the same
    physical blocks (a shared prefix), table padding pointing at random valid blocks."""
    need = [-(-n // block_size) for n in lens]
    shares = [n > shared for n in need] if shared else [False] * len(lens)
    num_blocks = shared + sum(n - shared if s else n for n, s in zip(need, shares)) + 3
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.randint(0, num_blocks, (len(lens), max(need, default=0) + 2), generator=gen)
    used = shared
    for b, (n, s) in enumerate(zip(need, shares)):
        start = shared if s else 0
        tables[b, :start] = perm[:start]
        tables[b, start:n] = perm[used:used + n - start]
        used += n - start
    k = torch.randn(num_blocks, block_size, Hkv, D, generator=gen).to(dtype)
    v = torch.randn(num_blocks, block_size, Hkv, D, generator=gen).to(dtype)
    q = torch.randn(len(lens), Hq, D, generator=gen).to(dtype)
    return q, k, v, tables.to(torch.int32), torch.tensor(lens, dtype=torch.int32)


def naive(q, k_cache, v_cache, tables, lens, scale):
    """Sequence by sequence, head by head, in float64: the definition."""
    B, Hq, D = q.shape
    Hkv, bs = k_cache.shape[2], k_cache.shape[1]
    out = torch.zeros(B, Hq, D, dtype=torch.float64)
    for b in range(B):
        n = int(lens[b])
        if n == 0:
            continue
        slots = [int(tables[b, p // bs]) * bs + p % bs for p in range(n)]
        k = k_cache.reshape(-1, Hkv, D)[slots].double()
        v = v_cache.reshape(-1, Hkv, D)[slots].double()
        for h in range(Hq):
            kv = h // (Hq // Hkv)
            w = torch.softmax((k[:, kv] @ q[b, h].double()) * scale, 0)
            out[b, h] = w @ v[:, kv]
    return out.to(q.dtype)


def padded(q, k, v, tables, lens, scale, workspace=None):
    return R.paged_decode_attention(q, k, v, tables, lens, scale, None, workspace,
                                    R.plan_decode(tables, lens, k.shape[1], sparse=False))


@pytest.fixture
def in_place_calls(monkeypatch):
    """How many times the in-place path ran."""
    calls = []
    original = S.attention

    def spy(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(S, "attention", spy)
    return calls


@settings(max_examples=25, deadline=None, derandomize=True)
@given(
    data=st.data(),
    batch=st.integers(R.SPARSE_DECODE_MIN_ROWS, 24),
    Hkv=st.integers(1, 3),
    group=st.sampled_from([1, 2, 3]),
    D=st.sampled_from([8, 16, 64]),
    block_size=st.sampled_from([1, 4, 5, 16]),
    shared=st.integers(0, 3),
)
def test_in_place_matches_the_definition_and_the_padded_path(data, batch, Hkv, group, D, block_size, shared):
    lens = data.draw(st.lists(st.integers(0, 90), min_size=batch, max_size=batch), label="context_lens")
    seed = data.draw(st.integers(0, 2**16), label="seed")
    gen = torch.Generator().manual_seed(seed)
    q, k, v, tables, lens_t = make_step(gen, lens, block_size, group * Hkv, Hkv, D, shared)
    scale = D ** -0.5
    plan = R.plan_decode(tables, lens_t, block_size)
    assert plan.slots is not None  # the in-place path's plan
    got = R.paged_decode_attention(q, k, v, tables, lens_t, scale, None, None, plan)
    torch.testing.assert_close(got, naive(q, k, v, tables, lens_t, scale), atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(got, padded(q, k, v, tables, lens_t, scale), atol=ATOL, rtol=RTOL)
    assert torch.all(got[lens_t == 0] == 0)  # nothing cached yet: zeros, like the kernels


def test_nothing_is_gathered_into_the_workspace(in_place_calls):
    """The padded path writes every sequence's K/V into the workspace; the in-place path reads
    the cache where it lies and leaves the workspace as it found it."""
    gen = torch.Generator().manual_seed(3)
    lens = [37, 5, 64, 18, 50, 1]
    q, k, v, tables, lens_t = make_step(gen, lens, 16, 9, 3, 64, shared=1)
    ws = tuple(torch.full((tables.numel(), 16, 3, 64), float("nan")) for _ in range(2))
    got = R.paged_decode_attention(q, k, v, tables, lens_t, 0.125, None, ws)
    assert in_place_calls and torch.isnan(ws[0]).all() and torch.isnan(ws[1]).all()
    torch.testing.assert_close(got, naive(q, k, v, tables, lens_t, 0.125), atol=ATOL, rtol=RTOL)
    padded(q, k, v, tables, lens_t, 0.125, ws)
    assert not torch.isnan(ws[0]).all()  # the baseline does gather there: the check can fail


def test_large_scores_stay_finite():
    """The softmax subtracts each row's max: scores far past exp's fp32 range (~88) still give
    the definition's weights."""
    gen = torch.Generator().manual_seed(5)
    q, k, v, tables, lens_t = make_step(gen, [40, 7, 23, 64], 4, 4, 2, 16)
    got = R.paged_decode_attention(q * 60, k, v, tables, lens_t, 1.0)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, naive(q * 60, k, v, tables, lens_t, 1.0), atol=ATOL, rtol=RTOL)


def test_one_plan_serves_every_layer(monkeypatch):
    """The engine builds one plan per forward pass: its pattern is made on the first layer and
    reused by the others (each with its own cache and queries), and made again for another head
    layout, which the same block tables also serve."""
    built = []
    original = S.plan
    monkeypatch.setattr(S, "plan", lambda *a, **kw: built.append(a[2:4]) or original(*a, **kw))
    gen = torch.Generator().manual_seed(9)
    lens = [(11 * i) % 70 + 1 for i in range(20)]
    layers = [make_step(gen, lens, 4, 6, 2, 16, shared=2) for _ in range(3)]
    tables, lens_t = layers[0][3], layers[0][4]
    plan = R.plan_decode(tables, lens_t, 4)
    for q, k, v, _, _ in layers:
        got = R.paged_decode_attention(q, k, v, tables, lens_t, 0.25, None, None, plan)
        torch.testing.assert_close(got, naive(q, k, v, tables, lens_t, 0.25), atol=ATOL, rtol=RTOL)
    assert built == [(6, 2)]
    q, k, v = layers[0][0][:, :4], layers[0][1], layers[0][2]  # 4 query heads over the same 2 KV heads
    got = R.paged_decode_attention(q, k, v, tables, lens_t, 0.25, None, None, plan)
    torch.testing.assert_close(got, naive(q, k, v, tables, lens_t, 0.25), atol=ATOL, rtol=RTOL)
    assert built == [(6, 2), (4, 2)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_caches_keep_the_padded_path(in_place_calls, dtype, monkeypatch):
    monkeypatch.setenv("KVBATCH_KERNELS", "reference")  # the reference's own choice (bf16 natively: test_cpu_native)
    gen = torch.Generator().manual_seed(2)
    q, k, v, tables, lens_t = make_step(gen, [9, 30, 17, 4, 22], 4, 6, 2, 16, dtype=dtype)
    got = dispatch.paged_decode_attention(q, k, v, tables, lens_t, 0.25)
    assert not in_place_calls
    assert torch.equal(got, padded(q, k, v, tables, lens_t, 0.25))


def test_small_batches_keep_the_padded_path(in_place_calls):
    gen = torch.Generator().manual_seed(4)
    q, k, v, tables, lens_t = make_step(gen, [13, 40, 7][:R.SPARSE_DECODE_MIN_ROWS - 1], 4, 6, 2, 16)
    plan = R.plan_decode(tables, lens_t, 4)
    assert plan.slots is None and plan.groups
    assert torch.equal(R.paged_decode_attention(q, k, v, tables, lens_t, 0.25, None, None, plan),
                       padded(q, k, v, tables, lens_t, 0.25))
    assert not in_place_calls


def test_sorted_slots_are_each_sequences_slots_ascending():
    tables = torch.tensor([[5, 2, 9], [0, 7, 7]], dtype=torch.int32)  # the second row's last entry: padding
    slots = S.sorted_slots(tables, torch.tensor([9, 6], dtype=torch.int32), 4)
    assert slots.tolist() == [8, 9, 10, 11, 20, 21, 22, 23, 36, 0, 1, 2, 3, 28, 29]
    assert S.sorted_slots(tables, torch.tensor([0, 0], dtype=torch.int32), 4).numel() == 0


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("in_place_decode")
    build_tiny("llama", folder, seed=0)
    return folder


def test_engine_decodes_in_place_with_the_padded_paths_tokens(tiny, in_place_calls, monkeypatch):
    """Six greedy requests through the engine (4 query heads over 2 KV heads) in a cache so small
    that the scheduler preempts and recomputes, so freed blocks are handed to other sequences
    mid-run: the in-place path runs and gives the tokens of the padded path."""
    from kvbatch.engine.runtime.engine_config import EngineConfig
    from kvbatch.engine.runtime.llm import LLM, GenerationRequest
    from kvbatch.engine.runtime.sampling_params import SamplingParams

    monkeypatch.setenv("KVBATCH_KERNELS", "reference")
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(3, VOCAB, (int(n),), generator=g).tolist()
               for n in torch.randint(5, 30, (6,), generator=g)]

    def run() -> tuple[list[list[int]], int]:
        llm = LLM(str(tiny), engine_config=EngineConfig(block_size=4, num_blocks=40, max_num_seqs=6))
        reqs = [GenerationRequest(f"r{i}", SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True),
                                  prompt_token_ids=p) for i, p in enumerate(prompts)]
        results = llm.generate(reqs)
        return [r.output_token_ids for r in results], sum(r.num_preemptions for r in results)

    in_place, preempted = run()
    assert in_place_calls, "the engine's decode steps took the in-place path"
    with monkeypatch.context() as mp:
        mp.setattr(R, "SPARSE_DECODE_MIN_ROWS", 10**9)
        calls = len(in_place_calls)
        baseline, _ = run()
        assert len(in_place_calls) == calls
    assert in_place == baseline
    assert preempted > 0
