"""The native CPU kernels (kernels/cpu/native.c, issue 18) against the PyTorch reference they
replace on fp32 CPU tensors (and their bf16 twins on bf16 ones), the fused decode layers against
the per-op forward pass, the bounds the C code checks, and how dispatch chooses (and falls back)
between them.

The tolerances are fp32 summation-order bounds: the kernels compute the reference's formulas in
another order, so a result is asserted close, not equal; the engine-level tests assert the same
greedy tokens as well.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbatch.engine.models.rope import cos_sin_table
from kvbatch.engine.runtime.engine_config import EngineConfig
from kvbatch.engine.runtime.llm import LLM, GenerationRequest
from kvbatch.engine.runtime.sampling_params import SamplingParams
from kvbatch.kernels import dispatch
from kvbatch.kernels import reference as R
from kvbatch.kernels.cpu import mkl_packed
from kvbatch.kernels.cpu import native as N
from tests.logit_capture import full_head
from tests.test_small_ops import _tokens_and_logits  # greedy tokens and every step's logits
from tests.tiny_models import build_tiny, build_tiny_moe

pytestmark = pytest.mark.skipif(not N.available(), reason=f"no native CPU kernels here: {N.unavailable_reason()}")


def _close(a: torch.Tensor, b: torch.Tensor, rel: float = 2e-6) -> None:
    scale = max(float(b.abs().max()), 1.0) if b.numel() else 1.0
    assert a.shape == b.shape
    assert float((a - b).abs().max()) <= rel * scale if a.numel() else True


# ------------------------------------------------------------------------- the kernels


@pytest.mark.parametrize("rows,dim", [(0, 576), (1, 576), (3, 576), (64, 64), (5, 100), (1, 7)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm_matches_the_reference_and_hands_x_over(rows, dim, with_residual):
    gen = torch.Generator().manual_seed(rows * 7 + dim)
    x = torch.randn(rows, dim, generator=gen) * 3
    weight = torch.randn(dim, generator=gen)
    residual = torch.randn(rows, dim, generator=gen) if with_residual else None
    expected = R.rms_norm(x.clone(), weight, 1e-5, residual)
    normed, new_residual = N.add_rms_norm(x, weight, 1e-5, residual)
    _close(normed, expected[0])
    assert torch.equal(new_residual, expected[1])  # one fp32 add: the same bits
    assert new_residual is x  # the sum went into x's memory


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(0, 9), cols=st.integers(1, 300), seed=st.integers(0, 2**16), ties=st.booleans(),
       specials=st.lists(st.sampled_from([float("nan"), float("inf"), float("-inf")]), max_size=4),
       threads=st.sampled_from([1, 2]))
def test_argmax_rows_gives_torchs_indices(rows, cols, seed, ties, specials, threads):
    # ties (the first index wins), infinities and NaN (the first NaN wins, as torch answers), rows
    # of one value, and a strided view of wider rows
    gen = torch.Generator().manual_seed(seed)
    wide = torch.randn(rows, cols + 3, generator=gen)
    if ties:
        wide = wide.round()  # few distinct values: many tied maxima
    for k, v in enumerate(specials):
        if rows:
            wide[k % rows, (k * 37) % cols] = v
    x = wide[:, :cols]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = N.argmax_rows(x)
    finally:
        torch.set_num_threads(before)
    assert got.dtype == torch.int64
    assert torch.equal(got, torch.argmax(x, dim=-1))


def test_argmax_rows_over_a_vocabulary_splits_across_threads_and_refuses_bad_shapes():
    x = torch.randn(64, 49152, generator=torch.Generator().manual_seed(3))
    x[5, 49151] = 1e9  # the last column
    x[6] = float("-inf")  # every value -inf: index 0, as torch
    assert torch.equal(N.argmax_rows(x), torch.argmax(x, dim=-1))
    assert torch.equal(dispatch.argmax_rows(x), torch.argmax(x, dim=-1))
    with pytest.raises(ValueError, match="argmax_rows takes"):
        N.argmax_rows(torch.zeros(3, 0))
    with pytest.raises(ValueError, match="argmax_rows takes"):
        N.argmax_rows(torch.zeros(4, 3).t())
    with pytest.raises(ValueError, match="fp32 CPU tensors"):
        N.argmax_rows(torch.zeros(2, 3, dtype=torch.float64))
    # what the native call cannot take, dispatch leaves to torch
    for t in (torch.zeros(4, 3).t(), torch.zeros(2, 3, dtype=torch.bfloat16), torch.zeros(0, 5), torch.zeros(7)):
        assert torch.equal(dispatch.argmax_rows(t), torch.argmax(t, dim=-1))


def test_add_rms_norm_takes_a_strided_weight():
    x, weight = torch.randn(3, 64), torch.randn(128)[::2]  # every other value: not contiguous
    _close(N.add_rms_norm(x.clone(), weight, 1e-5)[0], R.rms_norm(x, weight, 1e-5)[0])


def test_silu_and_mul_matches_the_reference_over_the_whole_range():
    # every exp input from underflow to overflow, both signs, odd widths (the scalar tail)
    gate = torch.linspace(-100.0, 100.0, 4001)
    x = torch.cat([gate, torch.randn(4001)]).view(1, -1)
    _close(N.silu_and_mul(x), R.silu_and_mul(x), rel=4e-7)
    for width in (2, 30, 34, 3072):
        y = torch.randn(3, width) * 10
        _close(N.silu_and_mul(y), R.silu_and_mul(y), rel=1e-6)
    with pytest.raises(ValueError, match="odd width"):
        N.silu_and_mul(torch.zeros(2, 5))


@pytest.mark.parametrize("T", [1, 4, 9])
@pytest.mark.parametrize("Hq,Hkv,D", [(9, 3, 64), (4, 2, 16), (8, 1, 128)])
def test_rotate_and_store_is_rotate_qk_then_store_kv_layer(T, Hq, Hkv, D):
    gen = torch.Generator().manual_seed(T + Hq + D)
    cos_sin = cos_sin_table(D, 10000.0, None, 512).float()
    qkv = torch.randn(T, (Hq + 2 * Hkv) * D, generator=gen)
    positions = torch.randint(0, 512, (T,), generator=gen)
    slots = torch.randperm(64, generator=gen)[:T]
    expected_qkv, expected_cache = qkv.clone(), torch.zeros(2, 4, 16, Hkv, D)
    R.rotate_qk(expected_qkv[:, :(Hq + Hkv) * D].view(T, Hq + Hkv, D), R.rotary_table(positions, cos_sin))
    R.store_kv_layer(expected_qkv[:, Hq * D:].view(T, 2, Hkv, D), expected_cache, slots)
    cache = torch.zeros_like(expected_cache)
    N.rotate_and_store(qkv, Hq, Hkv, D, positions, cos_sin, cache, slots)
    _close(qkv, expected_qkv)
    _close(cache, expected_cache)


def _within_bf16_steps(a: torch.Tensor, b: torch.Tensor, steps: int = 2) -> bool:
    """Whether every value of bf16 ``a`` is within ``steps`` bf16 rounding steps of ``b``'s (one
    step is at most 2^-7 of the magnitude), values under 1e-30 counting as zero (where the exp of
    a large negative number leaves fp32's normal range, ATen's silu flushes to 0 and ours stays a
    tiny number). Two by default: an intermediate bf16 rounding (the normalized row, silu's
    output) may land one step away when its fp32 input differs in the last bits, and the product
    after it rounds again."""
    assert a.dtype == b.dtype == torch.bfloat16 and a.shape == b.shape
    a, b = a.float(), b.float()
    return bool(((a - b).abs() <= steps * 2 ** -7 * b.abs() + 1e-30).all())


@pytest.mark.parametrize("rows,dim", [(0, 576), (1, 576), (3, 576), (64, 576), (300, 576), (5, 100), (1, 7)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_bf16_add_rms_norm_rounds_where_the_reference_rounds(rows, dim, with_residual):
    # bf16 x + residual (one rounding: the same bits), the fp32 norm rounded to bf16, times the
    # bf16 weight rounded again; only the mean of squares is summed in another order (and in
    # another one again by an AVX2 or SSE build), so an output may sit two bf16 steps from the
    # reference's (the normalized value one step, the product's rounding another), no further
    gen = torch.Generator().manual_seed(rows * 5 + dim)
    x = (torch.randn(rows, dim, generator=gen) * 3).bfloat16()
    weight = (torch.rand(dim, generator=gen) + 0.5).bfloat16()
    residual = torch.randn(rows, dim, generator=gen).bfloat16() if with_residual else None
    expected, expected_residual = R.add_rms_norm(x.clone(), weight, 1e-5, residual)
    normed, new_residual = N.add_rms_norm(x, weight, 1e-5, residual)
    assert normed.dtype == torch.bfloat16 and new_residual is x
    assert torch.equal(new_residual, expected_residual)
    assert _within_bf16_steps(normed, expected)


def test_bf16_silu_and_mul_and_rotary_round_as_the_reference():
    gate = torch.linspace(-100.0, 100.0, 4001)
    x = torch.cat([gate, torch.randn(4001) * 4]).view(1, -1).bfloat16()
    assert _within_bf16_steps(N.silu_and_mul(x), R.silu_and_mul(x))  # exp: our polynomial against ATen's
    for width in (2, 34, 600, 3072):  # 600: a 256-value chunk and a tail
        y = (torch.randn(3, width) * 10).bfloat16()
        assert _within_bf16_steps(N.silu_and_mul(y), R.silu_and_mul(y))
    # rotary: the reference's fp32 products and sums, rounded once: the same bits
    T, Hq, Hkv, D = 5, 9, 3, 64
    gen = torch.Generator().manual_seed(3)
    cos_sin = cos_sin_table(D, 10000.0, None, 512).float()
    qkv = torch.randn(T, (Hq + 2 * Hkv) * D, generator=gen).bfloat16()
    positions, slots = torch.randint(0, 512, (T,), generator=gen), torch.randperm(64, generator=gen)[:T]
    expected_qkv, expected_cache = qkv.clone(), torch.zeros(2, 4, 16, Hkv, D, dtype=torch.bfloat16)
    R.rotate_qk(expected_qkv[:, :(Hq + Hkv) * D].view(T, Hq + Hkv, D), R.rotary_table(positions, cos_sin))
    R.store_kv_layer(expected_qkv[:, Hq * D:].view(T, 2, Hkv, D), expected_cache, slots)
    cache = torch.zeros_like(expected_cache)
    N.rotate_and_store(qkv, Hq, Hkv, D, positions, cos_sin, cache, slots)
    assert torch.equal(qkv, expected_qkv) and torch.equal(cache, expected_cache)
    with pytest.raises(ValueError, match="all-fp32 or all-bf16 CPU tensors, got torch.bfloat16 on cpu, "
                                         "torch.float32 on cpu"):  # a mix is refused
        N.rotate_and_store(qkv, Hq, Hkv, D, positions, cos_sin, cache.float(), slots)
    with pytest.raises(ValueError, match="all-fp32 or all-bf16"):
        N.add_rms_norm(x, torch.ones(x.shape[-1]), 1e-5)


def _paged(gen: torch.Generator, lens: list[int], Hkv: int, D: int, block_size: int = 16):
    num_blocks = sum(-(-n // block_size) for n in lens) + 3
    k = torch.randn(num_blocks, block_size, Hkv, D, generator=gen)
    v = torch.randn(num_blocks, block_size, Hkv, D, generator=gen)
    width = max(1, max(-(-n // block_size) for n in lens))
    order = torch.randperm(num_blocks, generator=gen).int()  # scattered blocks, as a real cache has
    tables = torch.zeros(len(lens), width, dtype=torch.int32)
    used = 0
    for i, n in enumerate(lens):
        need = -(-n // block_size)
        tables[i, :need] = order[used:used + need]
        used += need
    return k, v, tables, torch.tensor(lens, dtype=torch.int32)


@settings(max_examples=40, deadline=None)
@given(lens=st.lists(st.integers(1, 200), min_size=1, max_size=6),
       shape=st.sampled_from([(9, 3, 64), (4, 2, 16), (8, 1, 128), (6, 6, 8), (16, 2, 64)]),
       seed=st.integers(0, 2**16))
def test_decode_attention_matches_the_reference(lens, shape, seed):
    Hq, Hkv, D = shape
    gen = torch.Generator().manual_seed(seed)
    k, v, tables, ctx = _paged(gen, lens, Hkv, D)
    q = torch.randn(len(lens), Hq, D, generator=gen)
    scale = D ** -0.5
    _close(N.paged_decode_attention(q, k, v, tables, ctx, scale),
           R.paged_decode_attention(q, k, v, tables, ctx, scale), rel=2e-6)


# (9, 3, 64), (8, 2, 128) and (2, 1, 32): groups of up to 4 heads over a multiple of 32, the shapes
# whose query-key products are vdpbf16ps on a CPU with AVX512-BF16; the others widen K
@pytest.mark.parametrize("shape", [(9, 3, 64), (4, 2, 16), (8, 1, 128), (8, 2, 128), (2, 1, 32)])
def test_decode_attention_reads_a_bf16_cache(shape):
    # bf16 q, K and V; computed in fp32: as close to the fp32 attention of the same bf16 values
    # as the reference's bf16 path, and within one bf16 rounding of it (2^-8 of the output scale)
    Hq, Hkv, D = shape
    gen = torch.Generator().manual_seed(D)
    k, v, tables, ctx = _paged(gen, [1, 16, 17, 150], Hkv, D)
    k, v = k.bfloat16(), v.bfloat16()
    q = torch.randn(4, Hq, D, generator=gen).bfloat16()
    exact = R.paged_decode_attention(q.float(), k.float(), v.float(), tables, ctx, 0.1)
    native = N.paged_decode_attention(q, k, v, tables, ctx, 0.1)
    reference = R.paged_decode_attention(q, k, v, tables, ctx, 0.1)
    assert native.dtype == torch.bfloat16
    bound = 2 ** -8 * float(exact.abs().max())
    assert float((native.float() - exact).abs().max()) <= bound
    assert float((reference.float() - exact).abs().max()) <= bound
    assert dispatch.native(q, bf16=True) and not dispatch.native(q)  # bf16: the kernels with a bf16 twin only


@contextlib.contextmanager
def _threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def test_long_contexts_are_split_over_threads_only_when_tasks_are_few():
    lens = lambda *n: torch.tensor(n, dtype=torch.int32)  # noqa: E731
    # batch 1, 3 KV heads on 2 threads: 3 tasks, so the 751 positions go in parts (16 tasks wanted:
    # parts of ceil(751 * 3 / 16) = 141 -> 144 positions, 6 of them)
    assert N.attention_parts(lens(751), 3, 16, 2) == 6
    assert N.attention_parts(lens(751), 3, 16, 1) == 1  # one thread: nothing to balance
    assert N.attention_parts(lens(100), 3, 16, 2) == 1  # shorter than a part (128 positions)
    assert N.attention_parts(lens(*[400] * 64), 3, 16, 2) == 64  # 192 tasks already
    # mixed: parts of ceil(1617 * 3 / 16) = 304 positions; only the contexts longer than a part
    # split (1000: 4 parts, 600: 2); the empty one and the short one are one item each
    assert N.attention_parts(lens(1000, 0, 17, 600), 3, 16, 2) == 4 + 1 + 1 + 2


@settings(max_examples=25, deadline=None)
@given(lens=st.lists(st.one_of(st.integers(0, 40), st.integers(129, 1200)), min_size=1, max_size=4),
       shape=st.sampled_from([(9, 3, 64), (4, 2, 16), (8, 1, 128), (6, 6, 8)]), seed=st.integers(0, 2**16))
def test_split_contexts_give_the_reference_attention(lens, shape, seed):
    # long contexts on 2 threads: parts attended apart and combined by their softmax sums
    Hq, Hkv, D = shape
    gen = torch.Generator().manual_seed(seed)
    k, v, tables, ctx = _paged(gen, lens, Hkv, D)
    q = torch.randn(len(lens), Hq, D, generator=gen)
    with _threads(2):
        native = N.paged_decode_attention(q, k, v, tables, ctx, D ** -0.5)
    _close(native, R.paged_decode_attention(q, k, v, tables, ctx, D ** -0.5), rel=2e-6)
    assert all(not native[i].any() for i, n in enumerate(lens) if n == 0)


def test_decode_attention_takes_strided_queries_and_gives_an_empty_context_zeros():
    gen = torch.Generator().manual_seed(3)
    k, v, tables, ctx = _paged(gen, [37, 5], 3, 64)
    qkv = torch.randn(2, 15 * 64, generator=gen)
    q = qkv[:, :9 * 64].view(2, 9, 64)  # rows strided as the fused projection leaves them
    assert not q.is_contiguous()
    _close(N.paged_decode_attention(q, k, v, tables, ctx, 0.125),
           R.paged_decode_attention(q.contiguous(), k, v, tables, ctx, 0.125))
    empty = N.paged_decode_attention(q, k, v, tables, torch.tensor([0, 5], dtype=torch.int32), 0.125)
    assert torch.equal(empty[0], torch.zeros(9, 64))


def test_out_of_range_indices_raise_and_write_nothing():
    gen = torch.Generator().manual_seed(5)
    k, v, tables, ctx = _paged(gen, [20], 2, 16)
    q = torch.randn(1, 4, 16, generator=gen)
    with pytest.raises(IndexError, match="out of range"):
        N.paged_decode_attention(q, k, v, tables + k.shape[0], ctx, 0.25)  # a block id past the cache
    with pytest.raises(IndexError, match="out of range"):
        N.paged_decode_attention(q, k, v, tables, torch.tensor([10_000], dtype=torch.int32), 0.25)
    cos_sin = cos_sin_table(16, 10000.0, None, 64).float()
    cache = torch.zeros(2, 2, 4, 2, 16)
    qkv = torch.randn(1, 8 * 16, generator=gen)
    before = qkv.clone()
    for positions, slots in (([64], [0]), ([-1], [0]), ([3], [8]), ([3], [-1])):
        with pytest.raises(IndexError, match="out of range"):
            N.rotate_and_store(qkv, 4, 2, 16, torch.tensor(positions), cos_sin, cache, torch.tensor(slots))
        assert torch.equal(qkv, before) and not cache.any()  # checked before anything is written


# ------------------------------------------------------------------------- the engine


def _fused_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The row counts of every fused decode call made from now on (the calls still run)."""
    calls: list[int] = []
    real = N.decode_layers
    monkeypatch.setattr(dispatch, "decode_layers", lambda *a, **k: calls.append(a[2].shape[0]) or real(*a, **k))
    return calls


def _llm(folder: Path, monkeypatch: pytest.MonkeyPatch, kernels: str, fused: str = "1") -> LLM:
    monkeypatch.setenv("KVBATCH_KERNELS", kernels)
    monkeypatch.setenv("KVBATCH_FUSED_DECODE", fused)
    monkeypatch.setenv("KVBATCH_LINEAR", "blas")
    return LLM(str(folder), engine_config=EngineConfig(block_size=4, num_blocks=256))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: the qkv bias inside the fused layers
def test_native_and_fused_paths_match_the_torch_forward_pass(tmp_path, monkeypatch, arch):
    build_tiny(arch, tmp_path / arch)
    calls = _fused_calls(monkeypatch)
    for n in (1, 3, 9):  # batch 1; 3 rows; 9 rows: more than the fused path takes
        calls.clear()
        torch_tokens, torch_logits = _tokens_and_logits(_llm(tmp_path / arch, monkeypatch, "reference"), n)
        assert not calls
        native_tokens, native_logits = _tokens_and_logits(_llm(tmp_path / arch, monkeypatch, "native"), n)
        assert native_tokens == torch_tokens
        assert len(native_logits) == len(torch_logits) > 1
        for a, b in zip(native_logits, torch_logits):
            _close(a, b, rel=1e-5)
        # every decode step of up to 8 rows ran fused (9 requests finish together: 9 rows each step),
        # and so did a step of short prompt chunks within those rows (one 5-token prompt)
        assert (n in calls) == (n <= 8) and all(rows <= 8 for rows in calls)
        assert (5 in calls) == (n == 1)
        unfused = _tokens_and_logits(_llm(tmp_path / arch, monkeypatch, "native", fused="0"), n)
        assert unfused[0] == torch_tokens


def test_a_bf16_model_runs_the_native_small_ops_and_keeps_the_reference_tokens(tmp_path, monkeypatch):
    build_tiny("qwen2", tmp_path)
    ran = []
    for name in ("add_rms_norm", "silu_and_mul", "rotate_and_store"):
        real = getattr(N, name)
        monkeypatch.setattr(N, name, lambda *a, _real=real, _name=name, **k: ran.append(_name) or _real(*a, **k))

    def run(kernels: str) -> tuple[list[list[int]], list[torch.Tensor]]:
        monkeypatch.setenv("KVBATCH_KERNELS", kernels)
        monkeypatch.setenv("KVBATCH_LINEAR", "blas")
        return _tokens_and_logits(LLM(str(tmp_path), dtype="bf16",
                                      engine_config=EngineConfig(block_size=4, num_blocks=256)), 3)

    torch_tokens, torch_logits = run("reference")
    assert not ran
    native_tokens, native_logits = run("native")
    assert set(ran) == {"add_rms_norm", "silu_and_mul", "rotate_and_store"}
    assert native_tokens == torch_tokens
    for a, b in zip(native_logits, torch_logits):  # bf16 rounding steps apart at most, over the tiny model
        _close(a, b, rel=0.05)


def test_the_fused_path_splits_a_long_context_and_matches_the_torch_forward_pass(tmp_path, monkeypatch):
    # batch 1 on 2 threads, a 230-token prompt: 2 KV heads leave too few tasks, so each layer's
    # attention runs in parts of 128 positions and combines them inside the fused call
    build_tiny("llama", tmp_path / "dense")
    prompt = torch.randint(3, 97, (230,), generator=torch.Generator().manual_seed(7)).tolist()
    assert N.attention_parts(torch.tensor([231]), 2, 4, 2) == 2
    results = {}
    with _threads(2):
        for kernels in ("reference", "native"):
            llm = full_head(_llm(tmp_path / "dense", monkeypatch, kernels))
            seen, execute = [], llm.runner.execute
            llm.runner.execute = lambda step, execute=execute, seen=seen: seen.append(execute(step)) or seen[-1]
            req = GenerationRequest("r", SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
                                    prompt_token_ids=prompt)
            results[kernels] = (llm.generate([req])[0].output_token_ids, [s[0].clone() for s in seen])
    assert results["native"][0] == results["reference"][0]
    for a, b in zip(results["native"][1], results["reference"][1], strict=True):
        _close(a, b, rel=1e-5)


def test_the_fused_path_takes_only_what_it_can_run(tmp_path, monkeypatch):
    build_tiny("llama", tmp_path / "dense")
    llm = _llm(tmp_path / "dense", monkeypatch, "native")
    model, cache = llm.model, llm.runner.kv_cache
    assert model._fused_layers(cache, 1) is not None and model._fused_layers(cache, 8) is not None
    assert model._fused_layers(cache, 9) is None  # compute-bound: the GEMM kernels
    model.fused_decode = False
    assert model._fused_layers(cache, 1) is None
    monkeypatch.setenv("KVBATCH_LINEAR", "onednn")  # packed weights: no plain layout to multiply
    onednn = LLM(str(tmp_path / "dense"), engine_config=EngineConfig(block_size=4, num_blocks=64))
    if onednn.model.linear.kind == "onednn":
        assert onednn.model._fused_layers(onednn.runner.kv_cache, 1) is None
    build_tiny_moe("qwen3_moe", tmp_path / "moe")
    moe = _llm(tmp_path / "moe", monkeypatch, "native")
    assert moe.model._fused_layers(moe.runner.kv_cache, 1) is None  # MoE layers and q/k norms keep the loop


def test_fuse_layers_refuses_what_its_pointers_cannot_hold(tmp_path, monkeypatch):
    build_tiny("qwen2", tmp_path / "m")
    llm = _llm(tmp_path / "m", monkeypatch, "native")
    model, cache = llm.model, llm.runner.kv_cache
    lw = model.layers[0]
    plain = model.linear.fused_weight
    bias = torch.randn(2 * lw.qkv_bias.shape[0])[::2]  # strided: a copy would be freed under the struct
    layer = dispatch.DenseLayer(lw.input_norm, lw.post_norm, plain(lw.qkv), bias, plain(lw.o_proj),
                                plain(lw.gate_up), plain(lw.down), cache[0])
    with pytest.raises(ValueError, match="contiguous"):
        dispatch.fuse_layers([layer])
    with pytest.raises(ValueError, match="qkv is"):
        dispatch.fuse_layers([dispatch.DenseLayer(lw.input_norm, lw.post_norm, plain(lw.o_proj), None,
                                                  plain(lw.o_proj), plain(lw.gate_up), plain(lw.down), cache[0])])
    # one dtype per model: a bf16 cache under fp32 norms, bf16 layers over fp32 weights, and the reverse
    fp32 = dispatch.DenseLayer(lw.input_norm, lw.post_norm, plain(lw.qkv), lw.qkv_bias, plain(lw.o_proj),
                               plain(lw.gate_up), plain(lw.down), cache[0])
    with pytest.raises(ValueError, match="all-fp32 or all-bf16"):
        dispatch.fuse_layers([replace(fp32, kv_layer=cache[1].bfloat16())])
    half = replace(fp32, input_norm=lw.input_norm.bfloat16(), post_norm=lw.post_norm.bfloat16(),
                   qkv_bias=lw.qkv_bias.bfloat16(), kv_layer=cache[0].bfloat16())
    with pytest.raises(ValueError, match="share layer 0's dtype"):
        dispatch.fuse_layers([fp32, half])
    with pytest.raises(ValueError, match="take bf16 projections"):
        dispatch.fuse_layers([half])
    with pytest.raises(ValueError, match="not bf16"):
        dispatch.fuse_layers([replace(fp32, o=N.bf16_blocks(lw.o_proj.t().bfloat16()))])


def test_fused_layers_refuse_bad_indices_before_writing(tmp_path, monkeypatch):
    build_tiny("llama", tmp_path / "m")
    llm = _llm(tmp_path / "m", monkeypatch, "native")
    model, cache = llm.model, llm.runner.kv_cache
    fused = model._fused_layers(cache, 1)
    h = torch.randn(1, 64)
    before = cache.clone()
    tables = torch.zeros(1, 4, dtype=torch.int32)
    for slots, lens, table in (([cache[0, 0].numel() // 32], [1], tables), ([0], [17], tables),
                               ([0], [1], tables + cache.shape[2])):
        with pytest.raises(IndexError, match="out of range"):
            dispatch.decode_layers(fused, 2, h, None, torch.tensor([0]), torch.tensor(slots), model.cos_sin,
                                   table, torch.tensor(lens, dtype=torch.int32), 1e-5, 0.25)
    assert torch.equal(cache, before)


def test_dispatch_chooses_native_for_fp32_cpu_and_falls_back_without_a_compiler(tmp_path, monkeypatch):
    x = torch.zeros(2, 8)
    monkeypatch.delenv("KVBATCH_KERNELS", raising=False)
    assert dispatch.native(x) and not dispatch.native(x.bfloat16())
    monkeypatch.setenv("KVBATCH_KERNELS", "reference")
    assert not dispatch.native(x)
    monkeypatch.setenv("KVBATCH_KERNELS", "fast")
    with pytest.raises(ValueError, match="'native'"):
        dispatch.native(x)
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("KVBATCH_CACHE_DIR", str(tmp_path / "cache"))  # no library built earlier to find
    N._library.cache_clear()
    try:
        assert not N.available() and "no C compiler" in N.unavailable_reason()
        monkeypatch.setenv("KVBATCH_KERNELS", "auto")
        assert not dispatch.native(x)  # silently the reference
        normed, _ = dispatch.add_rms_norm(x.clone(), torch.ones(8), 1e-5)
        assert normed.shape == x.shape
        monkeypatch.setenv("KVBATCH_KERNELS", "native")
        with pytest.raises(RuntimeError, match="no C compiler"):
            dispatch.native(x)
    finally:
        N._library.cache_clear()


def test_the_c_sources_ship_in_the_package():
    import fnmatch
    import tomllib

    from kvbatch.kernels.cpu import native_build

    repo = Path(__file__).resolve().parents[1]
    config = tomllib.loads((repo / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["package-data"]["kvbatch.kernels.cpu"]
    parts = native_build.sources(N.SOURCE)  # native.c and every file it includes
    assert N.SOURCE.resolve() == (repo / "kernels" / "cpu" / "native.c").resolve()
    assert {p.name for p in parts} == {p.name for p in (repo / "kernels" / "cpu").glob("native*.[ch]")}
    for part in parts:
        assert part.parent == N.SOURCE.resolve().parent and any(fnmatch.fnmatch(part.name, pat) for pat in patterns), part


def test_a_change_to_any_part_of_the_source_rebuilds(tmp_path):
    """native.c compiles its parts (native_common.h, native_*.c) as one library: the build's key
    covers every one of them, so an edit to a part builds it anew."""
    from kvbatch.kernels.cpu import native_build

    cc = native_build.compiler()
    if cc is None:
        pytest.skip("no C compiler here")
    parts = native_build.sources(N.SOURCE)
    assert len(parts) >= 3 and parts[0] == N.SOURCE.resolve()
    for p in parts:
        (tmp_path / p.name).write_text(p.read_text())
    copy = tmp_path / N.SOURCE.name
    key = native_build.build_key(copy, cc)
    assert key == native_build.build_key(N.SOURCE, cc)  # the same text, the same key
    for p in parts:
        (tmp_path / p.name).write_text(p.read_text() + "\n/* changed */\n")
        assert native_build.build_key(copy, cc) != key, p.name
        (tmp_path / p.name).write_text(p.read_text())


# ------------------------------------------------------------------------- the native GEMV


@pytest.mark.parametrize("threads", [1, 2])  # 2: each thread a run of the inputs, the partial sums added
@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("shape", [(576, 960), (37, 1000), (1536, 576), (64, 5000)])
def test_gemv_matches_blas(rows, shape, threads):
    # in sizes not a multiple of 4 (nor of the thread count) and outputs wider than a column chunk
    # (2048, the one-thread path) included
    gen = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, shape[0], generator=gen), torch.randn(*shape, generator=gen)
    b = torch.randn(shape[1], generator=gen)
    with _threads(threads):
        _close(N.gemv(x, w), x @ w, rel=1e-5)
        _close(N.gemv(x, w, b), torch.addmm(b, x, w), rel=1e-5)
    with pytest.raises(ValueError, match="gemv"):
        N.gemv(x, w.t())  # a transposed view: not the [in, out] layout


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 40), in_f=st.integers(1, 70), out=st.integers(1, 100), bias=st.booleans(),
       threads=st.sampled_from([1, 2]), seed=st.integers(0, 2**16))
def test_the_int8_gemv_computes_the_dequantized_product(rows, in_f, out, bias, threads, seed):
    # any shape: outputs not a whole number of 16-column blocks, inputs not of 4-row passes, rows
    # past one pass of 8 (or 4, AVX2) with a partial last pass: the route runs it at any row count
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (out, in_f), dtype=torch.int8, generator=gen)
    scale = torch.rand(out, generator=gen) + 0.01
    x, b = torch.randn(rows, in_f, generator=gen), torch.randn(out, generator=gen) if bias else None
    blocks = N.int8_blocks(q, scale)
    assert blocks.q.shape == (-(-out // 16), in_f, 16) and blocks.out_features == out
    w = q.double() * scale.double()[:, None]
    exact = x.double() @ w.t() + (0 if b is None else b.double())
    # fp32 sums of up to 70 products in any order: within n u (70 x 6e-8, with a margin) of the
    # sum of the products' magnitudes, fp32 summation's worst-case bound (an output that cancels,
    # 571 in magnitudes summing to -0.85, is not held to its own size)
    magnitude = x.double().abs() @ w.abs().t() + (0 if b is None else b.double().abs())
    with _threads(threads):
        got = N.gemv(x, blocks, b)
    assert got.shape == exact.shape and bool(((got.double() - exact).abs() <= 8e-6 * magnitude + 1e-30).all())


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 8), in_f=st.integers(1, 70), out=st.integers(1, 100), bias=st.booleans(),
       threads=st.sampled_from([1, 2]), seed=st.integers(0, 2**16))
def test_the_bf16_gemv_sums_in_fp32_and_rounds_once(rows, in_f, out, bias, threads, seed):
    # the bf16 blocks, any shape: the exact products summed in fp32 (another order than torch's),
    # rounded once to bf16; and PyTorch over the same blocks (the path past 8 rows) likewise
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(out, in_f, generator=gen).bfloat16()
    x = torch.randn(rows, in_f, generator=gen).bfloat16()
    b = torch.randn(out, generator=gen).bfloat16() if bias else None
    blocks = N.bf16_blocks(w)
    assert blocks.q.shape == (-(-out // 16), in_f, 16) and blocks.q.dtype == torch.bfloat16
    exact = x.double() @ w.double().t() + (0 if b is None else b.double())
    with _threads(threads):
        y = N.gemv(x, blocks, b)
    assert y.dtype == torch.bfloat16
    # one rounding of a sum whose fp32 error is far below a bf16 step: at most one step away
    # (relative to the largest output, where cancellation leaves a small one)
    step = 2 ** -7 * float(exact.abs().max())
    assert float((y.double() - exact).abs().max()) <= step + 1e-6
    assert float((N.blocks_linear(x, blocks, b).double() - exact).abs().max()) <= step + 1e-6


def test_bf16_blocks_are_checked():
    w = torch.ones(20, 8, dtype=torch.bfloat16)
    blocks = N.bf16_blocks(w)
    assert blocks.out_features == 20 and not blocks.q[1, :, 4:].any()
    with pytest.raises(ValueError, match="bf16 \\[out, in\\]"):
        N.bf16_blocks(w.float())
    with pytest.raises(ValueError, match="take the weight's dtype"):
        N.gemv(torch.ones(1, 8), blocks)  # fp32 activations with bf16 weights: not a pairing the kernel has
    with pytest.raises(ValueError, match="bf16 blocks are a contiguous"):
        N.gemv(torch.ones(1, 8, dtype=torch.bfloat16), blocks._replace(q=blocks.q.float()))
    with pytest.raises(ValueError, match="fp32 CPU tensors"):
        N.gemv(torch.ones(1, 8, dtype=torch.bfloat16), w.t().contiguous())  # bf16 goes as blocks


def test_int8_blocks_are_checked():
    q, scale = torch.ones(20, 8, dtype=torch.int8), torch.ones(20)
    blocks = N.int8_blocks(q, scale)
    assert torch.equal(blocks.q[1, :, :4], torch.ones(8, 4, dtype=torch.int8)) and not blocks.q[1, :, 4:].any()
    assert blocks.scale.shape == (32,) and not blocks.scale[20:].any()
    with pytest.raises(ValueError, match="int8 \\[out, in\\]"):
        N.int8_blocks(q.float(), scale)
    with pytest.raises(ValueError, match="int8 blocks are a contiguous"):
        N.gemv(torch.ones(1, 8), blocks._replace(q=blocks.q.transpose(1, 2)))
    with pytest.raises(ValueError, match="gemv: x"):
        N.gemv(torch.ones(1, 9), blocks)


def test_the_native_format_runs_the_gemv_for_decode_rows_and_blas_otherwise(monkeypatch):
    from kvbatch.kernels.cpu.linear import NATIVE, LinearFormat

    fmt = LinearFormat(NATIVE, torch.float32)
    gen = torch.Generator().manual_seed(11)
    w = fmt.prepare(torch.randn(96, 64, generator=gen))  # [out, in] -> BLAS's [in, out]
    assert w.shape == (64, 96)
    x8, x9 = torch.randn(8, 64, generator=gen), torch.randn(9, 64, generator=gen)
    assert torch.equal(fmt(x8, w), N.gemv(x8, w)) and torch.equal(fmt(x9, w), x9 @ w)
    monkeypatch.setenv("KVBATCH_KERNELS", "reference")  # the PyTorch path everywhere: BLAS, bit for bit
    assert torch.equal(fmt(x8, w), x8 @ w)
    # bf16: blocks of its own; the GEMV for decode rows, PyTorch over the blocks past them
    monkeypatch.delenv("KVBATCH_KERNELS")
    bf16 = LinearFormat(NATIVE, torch.bfloat16)
    wb = bf16.prepare(torch.randn(96, 64, generator=gen).bfloat16())
    assert isinstance(wb, N.Bf16Blocks) and wb.out_features == 96
    x8, x9 = x8.bfloat16(), x9.bfloat16()
    assert torch.equal(bf16(x8, wb), N.gemv(x8, wb)) and torch.equal(bf16(x9, wb), N.blocks_linear(x9, wb))
    monkeypatch.setenv("KVBATCH_KERNELS", "reference")
    assert torch.equal(bf16(x8, wb), N.blocks_linear(x8, wb))
    with pytest.raises(ValueError, match="fp32 or bf16 on the CPU"):
        LinearFormat(NATIVE, torch.float16)


def test_the_native_gemv_is_a_kernel_choice_candidate_for_decode_rows(tmp_path):
    from kvbatch.kernels.cpu import kernel_choice as kc
    from kvbatch.kernels.cpu.linear import NATIVE
    from tests.test_kernel_choice import fake_timer

    calls = []
    timer = fake_timer({"onednn": [5.0, 5.0, 5.0, 9.0], "blas": [4.0, 6.0, 4.0, 10.0], NATIVE: [2.0, 3.0, 1.0, 1.0]},
                       calls)
    choice = kc.choose_kernels(torch.float32, [(96, 64), (64, 160)], cache_dir=tmp_path, timer=timer)
    if not kc.onednn_available():
        pytest.skip("needs the oneDNN candidate too")
    assert choice.fmt.bucket_kinds == (NATIVE, NATIVE, "blas", "onednn")
    assert {r for k, r in calls if k == NATIVE} == {1, 8}  # never timed for 64 or 128 rows
    assert NATIVE in kc.candidates_for(torch.bfloat16, "full")  # over its bf16 blocks
    assert choice.fmt.fused_rows(1) and choice.fmt.fused_rows(8) and choice.fmt.fused_rows(64)
    assert not choice.fmt.fused_rows(128)
    # a GEMV far ahead at 1-8 rows leaves the larger buckets to the others, each still measured
    # (it once made them all "hopeless": nothing left to time at 64 rows)
    far = fake_timer({"onednn": [5.0, 5.0, 5.0, 9.0], "blas": [4.0, 6.0, 4.0, 10.0], NATIVE: [1e-3, 1e-3, 1.0, 1.0]})
    assert kc.choose_kernels(torch.float32, [(96, 64)], cache_dir=tmp_path / "far",
                             timer=far).fmt.bucket_kinds == (NATIVE, NATIVE, "blas", "onednn")


def _native_gemv_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Models built from now on measure the native GEMV fastest at 1-8 rows (a fake timer) under
    ``KVBATCH_KERNELS=native``; returns the row counts of every fused decode call made after."""
    from kvbatch.engine.models import factory
    from kvbatch.kernels.cpu import kernel_choice as kc
    from kvbatch.kernels.cpu.linear import NATIVE

    monkeypatch.setenv("KVBATCH_KERNELS", "native")
    monkeypatch.delenv("KVBATCH_LINEAR", raising=False)

    def native_wins_small_batches(kind, rows, run):
        run()
        return 1e-6 if kind == NATIVE else 1e-3

    monkeypatch.setattr(factory, "choose_kernels", functools.partial(kc.choose_kernels, timer=native_wins_small_batches,
                                                                     cache_dir=tmp_path / "cache"))
    return _fused_calls(monkeypatch)


def _reference_run(folder: Path, monkeypatch: pytest.MonkeyPatch, dtype: str) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy tokens and logits of 3 requests on the PyTorch path (BLAS, the reference kernels)."""
    from kvbatch.engine.models import factory
    from kvbatch.kernels.cpu import kernel_choice as kc

    monkeypatch.setenv("KVBATCH_KERNELS", "reference")
    monkeypatch.setattr(factory, "choose_kernels", functools.partial(kc.choose_kernels, linear="blas"))
    return _tokens_and_logits(LLM(str(folder), dtype=dtype, engine_config=EngineConfig(block_size=4, num_blocks=256)), 3)


def test_a_bucket_the_native_gemv_won_takes_the_fused_path(tmp_path, monkeypatch):
    from kvbatch.kernels.cpu.linear import NATIVE

    build_tiny("llama", tmp_path / "dense")
    calls = _native_gemv_wins(tmp_path, monkeypatch)
    llm = LLM(str(tmp_path / "dense"), engine_config=EngineConfig(block_size=4, num_blocks=256))
    assert llm.model.linear.bucket_kinds[:2] == (NATIVE, NATIVE)
    tokens, logits = _tokens_and_logits(llm, 3)
    assert set(calls) == {3}  # every decode step of the 3 requests ran fused
    ref_tokens, ref_logits = _reference_run(tmp_path / "dense", monkeypatch, "fp32")
    assert tokens == ref_tokens
    for a, b in zip(logits, ref_logits, strict=True):
        _close(a, b, rel=1e-5)


@pytest.mark.skipif(not mkl_packed.available(), reason="this torch build has no MKL packed sgemm")
@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: the qkv bias inside the fused layers
def test_mkl_packed_projections_run_fused_with_the_per_op_paths_bits(tmp_path, monkeypatch, arch):
    # the batched schedule: MKL called from the C code between the small ops, at any row count (12:
    # past the native GEMV's 8 rows), the per-op path's bits in every step's logits; long prompts
    # on 2 threads split attention into parts as the per-op kernel splits it
    build_tiny(arch, tmp_path / arch)
    calls = _fused_calls(monkeypatch)

    def run(fused: str, n: int, long: bool) -> tuple[list[list[int]], list[torch.Tensor]]:
        monkeypatch.setenv("KVBATCH_KERNELS", "native")
        monkeypatch.setenv("KVBATCH_FUSED_DECODE", fused)
        monkeypatch.setenv("KVBATCH_LINEAR", "mkl")
        llm = LLM(str(tmp_path / arch), engine_config=EngineConfig(block_size=4, num_blocks=512))
        assert llm.model.linear.kind == "mkl" and llm.model.linear.fused_gemm(n)
        if not long:
            return _tokens_and_logits(llm, n)
        full_head(llm)
        seen, execute = [], llm.runner.execute
        llm.runner.execute = lambda step: seen.append(execute(step)) or seen[-1]
        prompts = [torch.randint(3, 97, (150 + i,), generator=torch.Generator().manual_seed(i)).tolist()
                   for i in range(n)]
        reqs = [GenerationRequest(f"r{i}", SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True),
                                  prompt_token_ids=p) for i, p in enumerate(prompts)]
        return [r.output_token_ids for r in llm.generate(reqs)], [s[0].clone() for s in seen]

    with _threads(2):
        for n, long in ((12, False), (3, False), (3, True)):
            calls.clear()
            tokens, logits = run("1", n, long)
            assert set(calls) == {n}  # every decode step ran fused
            calls.clear()
            per_op_tokens, per_op_logits = run("0", n, long)
            assert not calls and tokens == per_op_tokens
            for a, b in zip(logits, per_op_logits, strict=True):
                assert torch.equal(a, b)
    assert N.attention_parts(torch.tensor([155] * 3, dtype=torch.int32), 2, 4, 2) > 3  # the long case split


def test_fuse_layers_takes_mkl_packed_projections_whole(tmp_path, monkeypatch):
    if not mkl_packed.available():
        pytest.skip("this torch build has no MKL packed sgemm")
    build_tiny("llama", tmp_path / "m")
    llm = _llm(tmp_path / "m", monkeypatch, "native")
    cache, lw = llm.runner.kv_cache, llm.model.layers[0]
    packed = [mkl_packed.fused_weight(mkl_packed.pack(w.t())) for w in (lw.qkv, lw.o_proj, lw.gate_up, lw.down)]
    layer = dispatch.DenseLayer(lw.input_norm, lw.post_norm, *packed[:1], None, *packed[1:], cache[0])
    address = mkl_packed.sgemm_compute_address()
    assert dispatch.fuse_layers([layer], address).sgemm_compute == address
    with pytest.raises(ValueError, match="and no address"):
        dispatch.fuse_layers([layer])
    with pytest.raises(ValueError, match="got 3 of 4"):  # one plain [in, out] projection among them
        dispatch.fuse_layers([replace(layer, o=lw.o_proj)], address)
    with pytest.raises(ValueError, match="in some layers and not in others"):
        plain = dispatch.DenseLayer(lw.input_norm, lw.post_norm, lw.qkv, None, lw.o_proj, lw.gate_up, lw.down, cache[1])
        dispatch.fuse_layers([layer, plain], address)
    with pytest.raises(ValueError, match="multiplied inside the fused decode layers only"):
        N.gemv(torch.randn(2, packed[0].in_features), packed[0])


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: the qkv bias inside the fused layers
def test_a_bf16_model_whose_native_gemv_won_runs_fused_with_the_per_op_roundings(tmp_path, monkeypatch, arch):
    # bf16 weights in blocks, the bf16 cache, every value rounded where the per-op bf16 path rounds:
    # the fused step gives that path's logits (the same GEMV, small ops and attention in C, in one
    # call), and the reference's greedy tokens
    from kvbatch.kernels.cpu.linear import NATIVE

    build_tiny(arch, tmp_path / arch)
    calls = _native_gemv_wins(tmp_path, monkeypatch)

    def run(fused: str) -> tuple[list[list[int]], list[torch.Tensor]]:
        monkeypatch.setenv("KVBATCH_FUSED_DECODE", fused)
        llm = LLM(str(tmp_path / arch), dtype="bf16", engine_config=EngineConfig(block_size=4, num_blocks=256))
        assert llm.model.linear.bucket_kinds[:2] == (NATIVE, NATIVE)
        return _tokens_and_logits(llm, 3)

    tokens, logits = run("1")
    assert set(calls) == {3}  # every decode step of the 3 requests ran fused
    calls.clear()
    per_op_tokens, per_op_logits = run("0")
    assert not calls and tokens == per_op_tokens
    for a, b in zip(logits, per_op_logits, strict=True):
        _close(a, b, rel=1e-6)
    ref_tokens, ref_logits = _reference_run(tmp_path / arch, monkeypatch, "bf16")
    assert tokens == ref_tokens
    for a, b in zip(logits, ref_logits, strict=True):  # bf16 rounding steps apart at most, as the small ops
        _close(a, b, rel=0.05)
