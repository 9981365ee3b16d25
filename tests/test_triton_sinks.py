"""gpt-oss's attention sinks in the Triton paged attention kernels (``kernels/triton_attention.py``).

A sink is one learned logit per query head that joins the softmax's denominator and contributes no
value (``reference.attention_with_sinks``). The decode kernel (one partition and split, with its
merge) and the prefill kernel take them, with and without a sliding window; here they run in the
Triton interpreter against the PyTorch reference, with the tolerances of ``tests/test_kernels.py``
(fp32 1e-4, fp16 3e-3, bf16 3e-2), over GQA groups 1-8 (gpt-oss's is 8), block sizes 1-16, head
widths that pad, and contexts crossing the window. ``reference.paged_decode_attention`` takes no
window, so windowed decode rows are checked as prefill chunks of one token through the reference's
windowed plan (``reference.plan_prefill``), the reference's own route for them. Each sink set holds
a sink above every score (the running maximum must include it) and one of ``-inf`` (no sink).

The sm_90 compilation of the sink variants (Triton's bundled ptxas, no GPU) runs in a subprocess
without ``TRITON_INTERPRET``: ``test_the_sink_variants_compile_for_sm90_within_shared_memory``.
"""

from __future__ import annotations


import pytest
import torch

# First: it sets TRITON_INTERPRET before triton builds the kernels.
from tests.triton_interpreter import (ATTN_TOL, KERNELS, compiled_pairs,  # isort: skip
                                      assert_close, fresh_process_only, interpreter_only,
                                      rerun_in_fresh_interpreter, randn, use_triton)  # noqa: F401 (fixture)
from kvbatch.kernels import dispatch
from kvbatch.kernels import reference as R

needs_interpreter = interpreter_only("test_sinks_in_a_fresh_process")

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


def make_cache(gen, context_lens, block_size, Hkv, D, dtype):
    """K/V caches and block tables for ``context_lens``: blocks shuffled over the cache, the
    padding entries of each table pointing at random (valid) blocks."""
    need = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(need) + 2
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.randint(0, num_blocks, (len(context_lens), max(max(need), 1)), generator=gen)
    used = 0
    for b, n in enumerate(need):
        tables[b, :n] = perm[used:used + n]
        used += n
    return (randn(gen, num_blocks, block_size, Hkv, D, dtype=dtype), randn(gen, num_blocks, block_size, Hkv, D,
                                                                           dtype=dtype), tables.to(torch.int32))


def make_sinks(gen, Hq: int) -> torch.Tensor:
    """Sinks of the scale gpt-oss learns, one above every score (head 0) and one -inf (no sink)."""
    sinks = torch.randn(Hq, generator=gen) * 2
    sinks[0] = 40.0
    if Hq > 2:
        sinks[-1] = -float("inf")
    return sinks


def reference_decode(q, k_cache, v_cache, tables, lens, scale, window, sinks):
    """Decode rows as prefill chunks of one token through the reference (its windowed plan)."""
    cu = torch.arange(q.shape[0] + 1, dtype=torch.int32)
    plan = R.plan_prefill(tables, cu, lens, k_cache.shape[1], q.shape[1] // k_cache.shape[2], window)
    return R.prefill_attention(q, k_cache, v_cache, tables, cu, lens, scale, plan, sinks)


# (context lens, Hq, Hkv, D, block size, window, keys per decode partition, dtype)
DECODE_CASES = [
    ([1, 37, 80], 8, 1, 64, 16, 0, 16, F32),  # gpt-oss's GQA 8, split over 1..5 partitions
    ([1, 37, 80], 8, 1, 64, 16, 32, 16, F32),  # partitions wholly before the window: empty, sink in part 0
    ([1, 37, 80], 16, 2, 64, 16, 128, 512, BF16),  # a window wider than every context; one partition
    ([5, 19, 64], 6, 3, 16, 4, 8, 512, F16),  # group 2, the window crossing block boundaries
    ([33, 2, 50], 4, 4, 24, 5, 16, 32, BF16),  # no GQA, a head width that pads (24 -> 32), block 5
    ([130, 9], 16, 2, 32, 1, 7, 32, F32),  # block size 1, many partitions, a small window
    ([17, 16, 15], 12, 4, 16, 16, 16, 16, F16),  # group 3; contexts at, above, below window and block
]


@needs_interpreter
@pytest.mark.parametrize("lens, Hq, Hkv, D, block_size, window, partition_size, dtype", DECODE_CASES)
def test_paged_decode_with_sinks_matches_reference(monkeypatch, lens, Hq, Hkv, D, block_size, window,
                                                   partition_size, dtype):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    gen = torch.Generator().manual_seed(len(lens) * 1000 + Hq * 10 + window)
    k_cache, v_cache, tables = make_cache(gen, lens, block_size, Hkv, D, dtype)
    q = randn(gen, len(lens), Hq, D, dtype=dtype)
    cl = torch.tensor(lens, dtype=torch.int32)
    sinks = make_sinks(gen, Hq)
    want = reference_decode(q, k_cache, v_cache, tables, cl, D ** -0.5, window, sinks)
    got = KERNELS.paged_decode_attention(q, k_cache, v_cache, tables, cl, D ** -0.5, partition_size=partition_size,
                                         window=window, sinks=sinks)
    assert_close(got, want, ATTN_TOL[dtype])
    plain = KERNELS.paged_decode_attention(q, k_cache, v_cache, tables, cl, D ** -0.5,
                                           partition_size=partition_size, window=window)
    assert (plain.float() - want.float()).abs().max() > 0.1  # the sinks decided the result
    assert_close(got[:, -1], plain[:, -1], ATTN_TOL[dtype])  # a sink of -inf is no sink


# (context lens, new tokens per sequence, Hq, Hkv, D, block size, window, dtype, tiles)
PREFILL_CASES = [
    ([20], [20], 8, 1, 64, 16, 0, F32, {}),  # a whole prompt, the launcher's own tiles
    ([41, 3, 30], [9, 1, 17], 4, 2, 32, 4, 5, F32, {"block_m": 4, "block_n": 4}),  # chunks over a prefix
    ([60, 33], [60, 17], 8, 1, 64, 16, 16, BF16, {"block_m": 16, "block_n": 16}),  # window inside a tile
    ([37, 19, 9], [1, 19, 0], 6, 2, 16, 5, 8, F16, {"block_m": 8, "block_n": 16}),  # an idle sequence
    ([70], [45], 16, 2, 24, 1, 32, F32, {"block_m": 16, "block_n": 16}),  # block size 1, D pads, window 32
]


@needs_interpreter
@pytest.mark.parametrize("ctx_lens, new_lens, Hq, Hkv, D, block_size, window, dtype, tiles", PREFILL_CASES)
def test_prefill_with_sinks_matches_reference(monkeypatch, ctx_lens, new_lens, Hq, Hkv, D, block_size, window, dtype,
                                              tiles):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    gen = torch.Generator().manual_seed(sum(ctx_lens) + window)
    k_cache, v_cache, tables = make_cache(gen, ctx_lens, block_size, Hkv, D, dtype)
    cu = torch.tensor([0, *torch.tensor(new_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = randn(gen, int(cu[-1]), Hq, D, dtype=dtype)
    cl = torch.tensor(ctx_lens, dtype=torch.int32)
    sinks = make_sinks(gen, Hq)
    plan = R.plan_prefill(tables, cu, cl, block_size, Hq // Hkv, window)
    want = R.prefill_attention(q, k_cache, v_cache, tables, cu, cl, 0.3, plan, sinks)
    got = KERNELS.prefill_attention(q, k_cache, v_cache, tables, cu, cl, 0.3, window=window, sinks=sinks, **tiles)
    assert_close(got, want, ATTN_TOL[dtype])
    plain = KERNELS.prefill_attention(q, k_cache, v_cache, tables, cu, cl, 0.3, window=window, **tiles)
    assert (plain.float() - want.float()).abs().max() > 0.1
    assert_close(got[:, -1], plain[:, -1], ATTN_TOL[dtype])


@needs_interpreter
def test_dispatch_sends_sinks_to_the_triton_kernels(use_triton, monkeypatch):
    """Where Triton runs (CUDA; here the interpreter), calls with sinks take the Triton kernels, with
    their sinks, and equal the reference's padded decode and prefill with sinks."""
    calls = []
    for name in ("paged_decode_attention", "prefill_attention"):
        kernel = getattr(KERNELS, name)

        def spy(*args, kernel=kernel, name=name, **kwargs):
            calls.append((name, kwargs.get("sinks")))
            return kernel(*args, **kwargs)

        monkeypatch.setattr(KERNELS, name, spy)
    gen = torch.Generator().manual_seed(7)
    lens = [9, 30, 1]
    k_cache, v_cache, tables = make_cache(gen, lens, 4, 2, 16, F32)
    q, cl, sinks = randn(gen, 3, 8, 16), torch.tensor(lens, dtype=torch.int32), make_sinks(gen, 8)
    got = dispatch.paged_decode_attention(q, k_cache, v_cache, tables, cl, 0.25, sinks=sinks)
    assert_close(got, R.paged_decode_attention(q, k_cache, v_cache, tables, cl, 0.25, sinks=sinks), ATTN_TOL[F32])
    cu = torch.tensor([0, 4, 20, 21], dtype=torch.int32)
    qp = randn(gen, 21, 8, 16)
    got = dispatch.prefill_attention(qp, k_cache, v_cache, tables, cu, cl, 0.25, max_query_len=16, sinks=sinks)
    assert_close(got, R.prefill_attention(qp, k_cache, v_cache, tables, cu, cl, 0.25, sinks=sinks), ATTN_TOL[F32])
    assert [n for n, _ in calls] == ["paged_decode_attention", "prefill_attention"]
    assert all(s is sinks for _, s in calls)


@needs_interpreter
def test_sinks_on_empty_contexts_and_bad_shapes(monkeypatch):
    """A sequence with nothing cached gives zeros with sinks too (as the reference's row that sees no
    key); sinks of the wrong length are refused with their shape."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    gen = torch.Generator().manual_seed(3)
    k_cache, v_cache, tables = make_cache(gen, [5, 9], 4, 2, 16, F32)
    q, sinks = randn(gen, 2, 4, 16), make_sinks(gen, 4)
    lens = torch.tensor([0, 9], dtype=torch.int32)
    for partition_size in (None, 4):
        out = KERNELS.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.25, partition_size=partition_size,
                                             sinks=sinks)
        assert torch.all(out[0] == 0)
        assert_close(out[1:], reference_decode(q, k_cache, v_cache, tables, lens, 0.25, 0, sinks)[1:], ATTN_TOL[F32])
    with pytest.raises(ValueError, match=r"one logit per query head \[4\], got \(2,\)"):
        KERNELS.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.25, sinks=sinks[:2])
    with pytest.raises(ValueError, match=r"one logit per query head \[4\], got \(4, 1\)"):
        KERNELS.prefill_attention(q, k_cache, v_cache, tables, torch.tensor([0, 1, 2], dtype=torch.int32), lens,
                                  0.25, sinks=sinks[:, None])


@pytest.mark.slow
@needs_interpreter
def test_engine_on_the_triton_kernels_keeps_gpt_oss_logits(tmp_path, monkeypatch):
    """A tiny gpt-oss (sinks, sliding and full layers) on the CUDA code path in the interpreter: every
    layer's attention with sinks runs the Triton kernels, the sliding layers' with their window;
    tokens and logits as transformers'."""
    from tests.test_gpt_oss import _assert_parity, _engine_outputs, build_tiny_gpt_oss

    ref = build_tiny_gpt_oss(tmp_path)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("KVBATCH_KERNELS", "triton")
    monkeypatch.setenv("KVBATCH_LINEAR", "cublas")
    from kvbatch.kernels import triton_attention

    ran = []
    # The dispatcher's kernels (full layers) and the module's own (sliding layers call them directly).
    for owner in (KERNELS, triton_attention):
        for name in ("paged_decode_attention", "prefill_attention"):
            kernel = getattr(owner, name)

            def spy(*args, kernel=kernel, **kwargs):
                ran.append((kwargs.get("sinks") is not None, kwargs.get("window", 0)))
                return kernel(*args, **kwargs)

            monkeypatch.setattr(owner, name, spy)
    outputs, seen = _engine_outputs(str(tmp_path), 7)  # prompts prefilled in chunks of 7 tokens, then decode
    _assert_parity(ref, outputs, seen, "gpt_oss on triton")
    assert ran and all(sinks for sinks, _ in ran)
    assert {window > 0 for _, window in ran} == {True, False}  # sliding layers and the full one alike


# The sink variants the engine launches for gpt-oss-20b and -120b (D 64, GQA 8): decode unsplit, the
# merge of a split decode, prefill, in bf16 and fp32, each compiled for sm_90 with its sinks and
# without (the same configuration, HAS_SINKS off), in a subprocess.
COMPILE = r"""
import dataclasses, json, tempfile, gpu_compile as g
g._worker_init(tempfile.mkdtemp())
configs = g.configurations({k: v for k, v in g.MODELS.items() if k.startswith("gpt-oss")}, ("bf16", "fp32"))
picked = {}
for c in configs:
    if c.constexprs.get("HAS_SINKS") and c.constexprs.get("BLOCK_SIZE", 16) == 16:
        picked.setdefault((c.kernel, c.dtype), c)
assert len(picked) == 6, sorted(picked)
for c in picked.values():
    plain = dataclasses.replace(c, constexprs=dict(c.constexprs, HAS_SINKS=False))
    print(json.dumps([g.compile_config(c, 90), g.compile_config(plain, 90)]), flush=True)
"""


@pytest.mark.slow
def test_the_sink_variants_compile_for_sm90_within_shared_memory():
    """Each compiles within an SM's shared memory, and spills no register where the same kernel
    without sinks spills none (the sink is added after the key loop, or in the merge)."""
    pairs = compiled_pairs(COMPILE)
    assert len(pairs) == 6
    assert {r["kernel"] for r, _ in pairs} == {"_paged_decode_kernel", "_paged_decode_merge_kernel", "_prefill_kernel"}
    for sink, plain in pairs:
        assert "error" not in sink and "error" not in plain, (sink, plain)
        assert sink["config"]["HAS_SINKS"] is True and sink["config"]["HEAD_DIM"] == 64, sink
        assert sink["config"].get("GROUP", 8) == 8 and sink["config"].get("SPLIT") is not True, sink
        assert 0 < sink["shared_bytes"] <= 232448 and sink["registers"] > 0, sink
        assert plain["spills"] > 0 or sink["spills"] == 0, (sink, plain)


@fresh_process_only
def test_sinks_in_a_fresh_process():
    rerun_in_fresh_interpreter(__file__)
