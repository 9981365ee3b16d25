"""The Triton kernels pinned to their PyTorch reference twins.

The kernels run on the CPU in the Triton interpreter (``TRITON_INTERPRET=1``), through the
dispatch point (``KVBATCH_KERNELS=triton``), and are compared with ``kvbatch.kernels.reference``
on small random shapes (hypothesis, few examples, derandomized so CI is reproducible) and on
the edge cases: empty batches, one token, context lengths that are not a multiple of the block
size, the longest context the block tables allow, strided views. One test runs a tiny Llama
through the engine on the Triton kernels and compares its logits with the reference run.
Hypothesis does not shrink failures (minutes in the interpreter): the first failing example is
reported as drawn.

``triton.jit`` decides at decoration time whether a kernel is interpreted, so the variable is
set before this module imports the kernels. If something in the same pytest process imported
them earlier (compiled for a GPU), the in-process tests skip and one test reruns this file in a
fresh Python process with the variable set.

Tolerances (max |triton - reference| <= atol + rtol * |reference|):
- attention: fp32 1e-4 / 1e-4; fp16 3e-3 / 3e-3; bf16 3e-2 / 3e-2. Both sides compute in
  fp32 and round the output once to the 16-bit dtype, but the reference's SDPA rounds its
  internals to the input dtype, so outputs can differ by 1-2 units in the last place.
- RMSNorm / rotary: fp32 1e-5 / 1e-5; fp16 1e-3 / 2e-3; bf16 1e-2 / 1.6e-2 (2 units in the last
  place). Under the interpreter a cast to bf16 truncates instead of rounding to nearest (a
  Triton interpreter bug), so bf16 results can sit 1 unit lower; on a GPU they match exactly.
- store_kv: bit-exact, except a cast to bf16 (1 unit, same interpreter bug).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

# First: it sets TRITON_INTERPRET before triton builds the kernels.
from tests.triton_interpreter import (ATTN_TOL, DTYPES, INTERPRETED, KERNELS, REPO,  # isort: skip
                                      assert_close, fresh_process_only, interpreter_only, interpreter_settings,
                                      rerun_in_fresh_interpreter, randn, use_triton)  # noqa: F401 (fixture)
from kvbatch.kernels import dispatch
from kvbatch.kernels import reference as R
from tests.logit_capture import full_head

needs_interpreter = interpreter_only("test_kernels_in_a_fresh_process")

SETTINGS = interpreter_settings(12)

ELEM_TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (1e-3, 2e-3), torch.bfloat16: (1e-2, 1.6e-2)}


# ---------------------------------------------------------------------------------------------
# paged KV caches


def make_cache(gen, context_lens, block_size, Hkv, D, dtype, spare_blocks=2, extra_width=0):
    """K/V caches and block tables for ``context_lens``: blocks shuffled over the cache, the
    padding entries of each table pointing at random (valid) blocks."""
    need = [-(-n // block_size) for n in context_lens]
    width = max(need, default=0) + extra_width
    num_blocks = sum(need) + spare_blocks
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.randint(0, num_blocks, (len(context_lens), max(width, 1)), generator=gen)
    used = 0
    for b, n in enumerate(need):
        tables[b, :n] = perm[used : used + n]
        used += n
    k_cache = randn(gen, num_blocks, block_size, Hkv, D, dtype=dtype)
    v_cache = randn(gen, num_blocks, block_size, Hkv, D, dtype=dtype)
    return k_cache, v_cache, tables.to(torch.int32)


def check_decode(context_lens, Hq, Hkv, D, block_size, dtype, seed=0, q_dtype=None, **kwargs):
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache, tables = make_cache(gen, context_lens, block_size, Hkv, D, dtype)
    q = randn(gen, len(context_lens), Hq, D, dtype=q_dtype or dtype)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    scale = D**-0.5
    expected = R.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale)
    if kwargs:
        actual = KERNELS.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, **kwargs)
    else:
        actual = dispatch.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale)
    assert_close(actual, expected, ATTN_TOL[dtype])


ATTENTION_SETTINGS = settings(SETTINGS, max_examples=30)


@needs_interpreter
@ATTENTION_SETTINGS
@given(
    data=st.data(),
    batch=st.integers(1, 3),
    Hkv=st.integers(1, 2),
    group=st.sampled_from([1, 2, 3, 4]),
    D=st.sampled_from([16, 24, 64]),
    block_size=st.sampled_from([1, 4, 5, 16]),
    dtype=st.sampled_from(DTYPES),
    partition_size=st.sampled_from([16, 32, 512]),
)
def test_paged_decode_matches_reference(data, batch, Hkv, group, D, block_size, dtype, partition_size):
    lens = data.draw(st.lists(st.integers(1, 80), min_size=batch, max_size=batch), label="context_lens")
    seed = data.draw(st.integers(0, 2**16), label="seed")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        check_decode(lens, group * Hkv, Hkv, D, block_size, dtype, seed, partition_size=partition_size)


@needs_interpreter
@pytest.mark.parametrize(
    "context_lens, block_size, extra",
    [
        ([1], 16, {}),  # one token
        ([17, 3, 16], 16, {}),  # not a multiple of the block size, and exactly one block
        ([48, 1, 33], 16, {"partition_size": 16}),  # split: the longest context fills its table
        ([40, 7], 8, {"max_context_len": 40, "partition_size": 16}),  # grid from the longest context
    ],
)
def test_paged_decode_edges(use_triton, context_lens, block_size, extra):
    check_decode(context_lens, 4, 2, 32, block_size, torch.float32, **extra)


@needs_interpreter
def test_paged_decode_through_dispatch_and_mixed_dtypes(use_triton):
    check_decode([9, 30], 6, 2, 16, 4, torch.bfloat16)
    check_decode([9, 30], 6, 3, 16, 4, torch.float16, q_dtype=torch.float32)


@needs_interpreter
def test_paged_decode_empty_batch_and_empty_context(use_triton):
    gen = torch.Generator().manual_seed(1)
    k_cache, v_cache, tables = make_cache(gen, [5, 9], 4, 2, 16, torch.float32)
    q = randn(gen, 2, 4, 16)
    out = dispatch.paged_decode_attention(q[:0], k_cache, v_cache, tables[:0], torch.zeros(0, dtype=torch.int32), 0.25)
    assert out.shape == (0, 4, 16)
    lens = torch.tensor([0, 9], dtype=torch.int32)  # a sequence with nothing cached yet: zeros, like the twin
    for kwargs in ({}, {"partition_size": 16}):
        out = KERNELS.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.25, **kwargs)
        assert_close(out, R.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.25), ATTN_TOL[torch.float32])
        assert torch.all(out[0] == 0)


@needs_interpreter
def test_paged_decode_strided_q_and_slots(use_triton):
    """q as a slice of a fused qkv projection; ``slots`` (as the engine passes it) sizes the grid."""
    gen = torch.Generator().manual_seed(2)
    lens = torch.tensor([21, 5, 12], dtype=torch.int64)
    k_cache, v_cache, tables = make_cache(gen, lens.tolist(), 4, 2, 16, torch.float32, extra_width=3)
    qkv = randn(gen, 3, 8 * 16)
    q = qkv[:, : 4 * 16].view(3, 4, 16)
    slots = R.gather_slots(tables, 21, 4)
    expected = R.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.3, slots)
    actual = dispatch.paged_decode_attention(q, k_cache, v_cache, tables.long(), lens, 0.3, slots)
    assert_close(actual, expected, ATTN_TOL[torch.float32])


# ---------------------------------------------------------------------------------------------
# prefill attention


def check_prefill(context_lens, new_lens, Hq, Hkv, D, block_size, dtype, seed=0, **kwargs):
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache, tables = make_cache(gen, context_lens, block_size, Hkv, D, dtype)
    cu = torch.tensor([0, *torch.tensor(new_lens, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32)
    q = randn(gen, int(cu[-1]), Hq, D, dtype=dtype)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    scale = D**-0.5
    expected = R.prefill_attention(q, k_cache, v_cache, tables, cu, lens, scale)
    if kwargs:
        actual = KERNELS.prefill_attention(q, k_cache, v_cache, tables, cu, lens, scale, **kwargs)
    else:
        actual = dispatch.prefill_attention(q, k_cache, v_cache, tables, cu, lens, scale)
    assert_close(actual, expected, ATTN_TOL[dtype])


@st.composite
def prefill_chunks(draw):
    """(context_lens, new_lens): each sequence's new tokens are the last ``new`` of its context."""
    n = draw(st.integers(1, 3))
    ctx = draw(st.lists(st.integers(1, 60), min_size=n, max_size=n))
    new = [draw(st.integers(0 if len(ctx) > 1 else 1, c)) for c in ctx]
    return ctx, new


@needs_interpreter
@ATTENTION_SETTINGS
@given(
    chunks=prefill_chunks(),
    Hkv=st.integers(1, 2),
    group=st.sampled_from([1, 2, 3]),
    D=st.sampled_from([16, 24, 64]),
    block_size=st.sampled_from([1, 5, 8]),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_prefill_matches_reference(chunks, Hkv, group, D, block_size, dtype, seed):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        check_prefill(*chunks, group * Hkv, Hkv, D, block_size, dtype, seed, block_m=16, block_n=16)


@needs_interpreter
@pytest.mark.parametrize(
    "context_lens, new_lens",
    [
        ([1], [1]),  # one token, no prefix
        ([20], [20]),  # whole prompt: plain causal attention
        ([37, 19], [1, 19]),  # decode-like chunk beside a full prompt
        ([33, 9, 40], [17, 0, 40]),  # chunked prefill, an idle sequence, the longest context
    ],
)
def test_prefill_edges(use_triton, context_lens, new_lens):
    check_prefill(context_lens, new_lens, 4, 2, 16, 8, torch.float32)


@needs_interpreter
def test_prefill_empty(use_triton):
    gen = torch.Generator().manual_seed(3)
    k_cache, v_cache, tables = make_cache(gen, [4], 4, 1, 16, torch.float32)
    q = randn(gen, 0, 2, 16)
    cu = torch.zeros(2, dtype=torch.int32)
    out = dispatch.prefill_attention(q, k_cache, v_cache, tables, cu, torch.tensor([4]), 0.25)
    assert out.shape == (0, 2, 16)


def naive_prefill(q, k_cache, v_cache, tables, cu, lens, scale):
    """Token by token, head by head: the definition the reference's batching must agree with."""
    Hq, D = q.shape[1:]
    Hkv, bs = k_cache.shape[2], k_cache.shape[1]
    out = torch.zeros_like(q)
    for s in range(len(lens)):
        n_new, n_ctx = int(cu[s + 1] - cu[s]), int(lens[s])
        slots = [int(tables[s, p // bs]) * bs + p % bs for p in range(n_ctx)]
        k = k_cache.view(-1, Hkv, D)[slots]
        v = v_cache.view(-1, Hkv, D)[slots]
        for i in range(n_new):
            pos = n_ctx - n_new + i
            for h in range(Hq):
                kv = h // (Hq // Hkv)
                w = torch.softmax((k[:pos + 1, kv] @ q[int(cu[s]) + i, h]) * scale, 0)
                out[int(cu[s]) + i, h] = w @ v[:pos + 1, kv]
    return out


def test_prefill_plan_is_built_once_and_serves_every_layer():
    """The engine builds one plan per forward pass and every layer reuses it: short chunks
    (verification rows, batched) and a long one (a prompt chunk) beside them, two layers with
    different caches and queries, each equal to the token-by-token definition."""
    gen = torch.Generator().manual_seed(7)
    context_lens, new_lens = [23, 9, 40, 17], [3, 1, 30, 5]
    cu = torch.tensor([0, *torch.tensor(new_lens).cumsum(0).tolist()], dtype=torch.int32)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    layers = [make_cache(gen, context_lens, 4, 2, 16, torch.float32) for _ in range(2)]
    tables = layers[0][2]
    plan = R.plan_prefill(tables, cu, lens, 4, 3)
    assert [len(g.rows) for g in plan.short] == [9] and [c.end - c.start for c in plan.long] == [30]
    for k_cache, v_cache, _ in layers:
        q = randn(gen, int(cu[-1]), 6, 16)
        got = R.prefill_attention(q, k_cache, v_cache, tables, cu, lens, 0.25, plan)
        assert_close(got, naive_prefill(q, k_cache, v_cache, tables, cu, lens, 0.25), ATTN_TOL[torch.float32])
        assert torch.equal(got, R.prefill_attention(q, k_cache, v_cache, tables, cu, lens, 0.25))


@st.composite
def long_chunks(draw):
    """(context_lens, new_lens) with chunks longer than SHORT_CHUNK: whole prompts (no cached
    prefix) and chunks over a cached prefix, beside an occasional short or idle sequence."""
    n = draw(st.integers(1, 3))
    ctx = draw(st.lists(st.integers(R.SHORT_CHUNK + 1, 70), min_size=n, max_size=n))
    new = [draw(st.sampled_from([c, draw(st.integers(R.SHORT_CHUNK + 1, c)), draw(st.integers(0, 3))])) for c in ctx]
    if not any(new):
        new[0] = ctx[0]
    return ctx, new


@ATTENTION_SETTINGS
@given(chunks=long_chunks(), Hkv=st.integers(1, 2), group=st.sampled_from([1, 2, 3]),
       block_size=st.sampled_from([1, 4, 16]), dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16))
def test_reference_prefill_long_chunks_match_the_definition(chunks, Hkv, group, block_size, dtype, seed):
    """The long chunks' path (query heads as heads, each reading its KV head through
    ``enable_gqa``; whole prompts under ``is_causal``, the rest under the plan's lower-right masks)
    against the token-by-token definition: whole prompts, chunks over a cached prefix, one to three
    query heads per KV head, fp32 and 16-bit caches."""
    gen = torch.Generator().manual_seed(seed)
    context_lens, new_lens = chunks
    D = 16
    k_cache, v_cache, tables = make_cache(gen, context_lens, block_size, Hkv, D, dtype)
    cu = torch.tensor([0, *torch.tensor(new_lens).cumsum(0).tolist()], dtype=torch.int32)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    q = randn(gen, int(cu[-1]), group * Hkv, D, dtype=dtype)
    got = R.prefill_attention(q, k_cache, v_cache, tables, cu, lens, 0.3)
    want = naive_prefill(q.float(), k_cache.float(), v_cache.float(), tables, cu, lens, 0.3)
    assert got.dtype == dtype
    assert_close(got.float(), want, ATTN_TOL[dtype])


def test_the_reference_kernels_load_neither_torchs_compiler_nor_triton():
    """torch's ``causal_lower_right`` bias would have served the prefill's lower-right masks, but
    importing it loads torch's compiler stack with Triton, before the Triton interpreter tests of
    the same process set TRITON_INTERPRET (42 of them failed so): the reference builds its masks."""
    code = ("import sys, kvbatch.kernels.reference, kvbatch.kernels.reference_mla; "
            "print(sorted(m for m in ('triton', 'torch._dynamo') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_prefill_attention_benchmark_measures_like_against_like(capsys):
    """benchmarks/bench_prefill_attention.py: its baseline (the masked path as it was) and the
    reference give the same attention on the recorded workload's chunks, the recorded chunks are
    the 275 (22,769 new tokens, 255 longer than SHORT_CHUNK) its docstring says, and its quick
    run prints each case with a ratio."""
    from benchmarks import bench_prefill_attention as B

    assert (len(B.EOT_CHUNKS), sum(n for n, _ in B.EOT_CHUNKS)) == (275, 22769)
    assert sum(n > R.SHORT_CHUNK for n, _ in B.EOT_CHUNKS) == 255
    assert all(0 < n <= ctx for n, ctx in B.EOT_CHUNKS)
    case = B.Case([c for c in B.EOT_CHUNKS if c[0] <= R.SHORT_CHUNK][:4] + list(B.EOT_CHUNKS[:30]))
    assert case.plan.short and case.plan.long
    assert_close(case.by_head(), case.masked(), ATTN_TOL[torch.float32])
    assert B.main(["--quick", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    for name in ("whole prompt, 300 tokens", "whole prompt, 1,000 tokens", "89 new tokens over 341 positions"):
        assert re.search(re.escape(name) + r" .* \d+\.\d\dx ", out), out


@pytest.mark.parametrize("context_lens", [[13] * 3, [(7 * i) % 40 + 1 for i in range(20)]],
                         ids=["one length: no mask", "20 mixed: two padded groups"])
def test_decode_plan_is_built_once_and_serves_every_layer(context_lens):
    gen = torch.Generator().manual_seed(8)
    B = len(context_lens)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    layers = [make_cache(gen, context_lens, 4, 2, 16, torch.float32) for _ in range(2)]
    tables = layers[0][2]
    plan = R.plan_decode(tables, lens, 4)
    assert len(plan.groups) == -(-B // R.DECODE_GROUP)
    assert (plan.groups[0].mask is None) == (len(set(context_lens)) == 1)
    ones = torch.arange(B + 1, dtype=torch.int32)  # one new token per sequence: its last position
    for k_cache, v_cache, _ in layers:
        q = randn(gen, B, 6, 16)
        got = R.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.25, None, None, plan)
        assert_close(got, naive_prefill(q, k_cache, v_cache, tables, ones, lens, 0.25), ATTN_TOL[torch.float32])
        assert torch.equal(got, R.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.25))


# ---------------------------------------------------------------------------------------------
# RMSNorm, rotary, store_kv


@needs_interpreter
@SETTINGS
@given(
    rows=st.integers(0, 5),
    hidden=st.sampled_from([1, 7, 64, 100]),
    dtype=st.sampled_from(DTYPES),
    weight_dtype=st.sampled_from([None, torch.float32]),
    with_residual=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_rms_norm_matches_reference(rows, hidden, dtype, weight_dtype, with_residual, seed):
    gen = torch.Generator().manual_seed(seed)
    x = randn(gen, rows, hidden, dtype=dtype) * 3
    weight = randn(gen, hidden, dtype=weight_dtype or dtype)
    residual = randn(gen, rows, hidden, dtype=dtype) if with_residual else None
    expected = R.rms_norm(x, weight, 1e-5, residual)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        mp.setenv("KVBATCH_KERNELS", "triton")
        actual = dispatch.rms_norm(x, weight, 1e-5, residual)
    assert_close(actual[0], expected[0], ELEM_TOL[dtype])
    assert_close(actual[1], expected[1], ELEM_TOL[dtype])
    if residual is None:
        assert actual[1] is x


@needs_interpreter
def test_rms_norm_3d_and_strided(use_triton):
    gen = torch.Generator().manual_seed(4)
    x = randn(gen, 2, 3, 40)
    residual = randn(gen, 3, 2, 40).transpose(0, 1)  # not contiguous
    weight = randn(gen, 40)
    expected = R.rms_norm(x, weight, 1e-6, residual)
    actual = dispatch.rms_norm(x, weight, 1e-6, residual)
    for a, e in zip(actual, expected):
        assert_close(a, e, ELEM_TOL[torch.float32])


@needs_interpreter
@SETTINGS
@given(
    T=st.integers(0, 5),
    Hkv=st.integers(1, 3),
    group=st.sampled_from([1, 2, 3]),
    D=st.sampled_from([2, 8, 24, 32]),
    dtype=st.sampled_from(DTYPES),
    fused=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_rotary_matches_reference_in_place(T, Hkv, group, D, dtype, fused, seed):
    gen = torch.Generator().manual_seed(seed)
    Hq = group * Hkv
    if fused:  # q and k as views into one qkv projection, as the engine has them
        qkv = randn(gen, T, (Hq + 2 * Hkv) * D, dtype=dtype)
        q = qkv[:, : Hq * D].view(T, Hq, D)
        k = qkv[:, Hq * D : (Hq + Hkv) * D].view(T, Hkv, D)
    else:
        q, k = randn(gen, T, Hq, D, dtype=dtype), randn(gen, T, Hkv, D, dtype=dtype)
    positions = torch.randint(0, 50, (T,), generator=gen)
    angles = torch.rand(50, D // 2, generator=gen) * 6.3
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=1)
    expected_q, expected_k = R.apply_rotary(q, k, positions, cos_sin)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        mp.setenv("KVBATCH_KERNELS", "triton")
        actual_q, actual_k = dispatch.apply_rotary(q, k, positions, cos_sin)
    assert actual_q is q and actual_k is k  # in place
    assert_close(q, expected_q, ELEM_TOL[dtype])
    assert_close(k, expected_k, ELEM_TOL[dtype])


@needs_interpreter
@SETTINGS
@given(
    T=st.integers(0, 6),
    Hkv=st.integers(1, 3),
    D=st.sampled_from([8, 24]),
    block_size=st.sampled_from([1, 4, 5]),
    dtypes=st.sampled_from(
        [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
         (torch.float32, torch.float16), (torch.float32, torch.bfloat16)]
    ),
    seed=st.integers(0, 2**16),
)
def test_store_kv_matches_reference(T, Hkv, D, block_size, dtypes, seed):
    src_dtype, cache_dtype = dtypes
    gen = torch.Generator().manual_seed(seed)
    num_blocks = 3
    k_cache = randn(gen, num_blocks, block_size, Hkv, D, dtype=cache_dtype)
    v_cache = randn(gen, num_blocks, block_size, Hkv, D, dtype=cache_dtype)
    T = min(T, num_blocks * block_size)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:T]
    kv = randn(gen, T, 2, Hkv, D, dtype=src_dtype)
    k, v = kv[:, 0], kv[:, 1]  # strided views
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    R.store_kv(k, v, expected_k, expected_v, slots)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        mp.setenv("KVBATCH_KERNELS", "triton")
        dispatch.store_kv(k, v, k_cache, v_cache, slots)
    exact = cache_dtype != torch.bfloat16 or src_dtype == torch.bfloat16
    tol = (0.0, 0.0) if exact else (1e-6, 2**-7)
    assert_close(k_cache, expected_k, tol)
    assert_close(v_cache, expected_v, tol)


@needs_interpreter
def test_store_kv_skips_negative_slots(use_triton):
    gen = torch.Generator().manual_seed(5)
    k_cache = torch.zeros(2, 4, 1, 8)
    v_cache = torch.zeros(2, 4, 1, 8)
    k, v = randn(gen, 3, 1, 8), randn(gen, 3, 1, 8)
    dispatch.store_kv(k, v, k_cache, v_cache, torch.tensor([5, -1, 0]))
    flat = k_cache.view(-1, 1, 8)
    assert torch.equal(flat[5], k[0]) and torch.equal(flat[0], k[2])
    assert int((flat.abs().sum((1, 2)) != 0).sum()) == 2
    assert torch.equal(v_cache.view(-1, 1, 8)[0], v[2])


# ---------------------------------------------------------------------------------------------
# the engine on the Triton kernels


@needs_interpreter
def test_engine_logits_same_on_triton_kernels(tmp_path, monkeypatch):
    """A tiny Llama through the real engine (mixed decode + chunked prefill steps, strided
    q/k views, the engine's index dtypes): the interpreted Triton kernels give the reference's
    logits at every step."""
    from kvbatch.engine.runtime.engine_config import EngineConfig
    from kvbatch.engine.runtime.llm import LLM, GenerationRequest
    from kvbatch.engine.runtime.sampling_params import SamplingParams
    from tests.tiny_models import VOCAB, build_tiny

    build_tiny("llama", tmp_path)
    g = torch.Generator().manual_seed(1)
    prompts = {f"r{i}": torch.randint(3, VOCAB, (n,), generator=g).tolist() for i, n in enumerate([5, 17, 9])}

    def logits_with(kernels: str) -> dict[str, list[torch.Tensor]]:
        monkeypatch.setenv("KVBATCH_KERNELS", kernels)
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        llm = full_head(LLM(str(tmp_path), engine_config=EngineConfig(block_size=4, num_blocks=64,
                                                                      max_num_batched_tokens=7)))
        seen: dict[str, list[torch.Tensor]] = {rid: [] for rid in prompts}
        execute = llm.runner.execute

        def spy(step):
            logits, sampled = execute(step)
            for row, s in enumerate(sampled):
                seen[s.seq.request_id].append(logits[row].clone())
            return logits, sampled

        llm.runner.execute = spy
        params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        llm.generate([GenerationRequest(rid, params, prompt_token_ids=p) for rid, p in prompts.items()])
        return seen

    want, got = logits_with("reference"), logits_with("triton")
    for rid in prompts:
        assert len(got[rid]) == len(want[rid]) == 4
        for step, (a, b) in enumerate(zip(got[rid], want[rid])):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4, msg=f"{rid} step {step}")


# ---------------------------------------------------------------------------------------------
# the dispatch point


def test_dispatch_chooses_by_device_and_env(monkeypatch):
    x = torch.zeros(2, 4)
    monkeypatch.delenv("KVBATCH_KERNELS", raising=False)
    assert dispatch.backend(x) == "reference"  # CPU tensors: the reference, even with triton around
    monkeypatch.setenv("KVBATCH_KERNELS", "reference")
    assert dispatch.backend(x) == "reference"
    monkeypatch.setenv("KVBATCH_KERNELS", "fast")
    with pytest.raises(ValueError, match="KVBATCH_KERNELS"):
        dispatch.backend(x)
    monkeypatch.setenv("KVBATCH_KERNELS", "triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        dispatch.backend(x)
    if INTERPRETED:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        assert dispatch.backend(x) == "triton"


def test_dispatch_imports_and_runs_without_triton():
    """With triton unimportable, the module imports, CPU calls run the reference, and forcing
    Triton fails with a clear error."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import os, torch\n"
        "from kvbatch.kernels import dispatch\n"
        "x = torch.randn(3, 8); w = torch.ones(8)\n"
        "out, res = dispatch.rms_norm(x, w, 1e-5, x)\n"
        "assert torch.allclose(res, 2 * x)\n"
        "os.environ['KVBATCH_KERNELS'] = 'triton'; os.environ['TRITON_INTERPRET'] = '1'\n"
        "try:\n"
        "    dispatch.rms_norm(x, w, 1e-5)\n"
        "except RuntimeError as e:\n"
        "    assert 'cannot be imported' in str(e), e\n"
        "else:\n"
        "    raise AssertionError('forcing triton without triton should fail')\n"
        "print('ok')\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("KVBATCH_KERNELS", "TRITON_INTERPRET")}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


@fresh_process_only
def test_kernels_in_a_fresh_process():
    rerun_in_fresh_interpreter(__file__)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_kernels_on_cuda_match_reference():
    """On a GPU: the compiled kernels against their twins (the check half of the benchmark)."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "KVBATCH_KERNELS")}
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "gpu_kernels.py"), "--check-only"],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
