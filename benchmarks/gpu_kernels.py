"""Check every Triton kernel against its PyTorch twin on a CUDA device, then time both.

    python benchmarks/gpu_kernels.py               # checks, then the table
    python benchmarks/gpu_kernels.py --check-only  # checks only (what tests/test_kernels.py runs on a GPU)
    python benchmarks/gpu_kernels.py --sweep       # also sweep decode / MoE / MLA tuning knobs

Table columns: kernel, shape, time (ms, median of CUDA-event timings, L2 flushed between
iterations), achieved GB/s (the fewest bytes the kernel must move: each input read once, each
output written once) or TFLOP/s, whichever is the larger fraction of its H200 limit (4.8 TB/s
HBM, 990 dense bf16 TFLOP/s), that fraction, the PyTorch reference's time and the speedup over
it. The headline is decode attention at long contexts: 32 sequences x 8k context, 32 q / 8 kv
heads, D=128, bf16 (goal: >= 70% of HBM bandwidth); the fused MoE's goal is >= 2x the PyTorch
reference (its bytes are the weights of the experts the batch touches, its FLOPs
``6 * pairs * I * H``). Kernels: paged decode and prefill attention, RMSNorm + residual,
rotary, silu_and_mul, store_kv, fused MoE, MLA decode and prefill attention, the speculative
accept/reject step.

Without a CUDA device it says so and exits 0. It runs from a plain checkout too (without
``pip install``): ``kernels/`` is then loaded as ``kvbatch.kernels``.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import statistics
import sys
import types
from pathlib import Path

import torch

H200_HBM_BYTES_PER_S = 4.8e12
H200_BF16_FLOP_PER_S = 990e12
HEADLINE_GOAL = 0.70
DEVICE = "cuda"  # a module global so the script's logic can be smoke-tested on a CPU

ATTN_TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (3e-3, 3e-3), torch.bfloat16: (3e-2, 3e-2)}
ELEM_TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (1e-3, 2e-3), torch.bfloat16: (1e-2, 1.6e-2)}
# Fused MoE: the reference rounds gate_up and the down output to the input dtype, the kernel
# only the activation between the GEMMs; fp32 sums over thousands of products in other orders.
MOE_TOL = {torch.float32: (1e-3, 1e-3), torch.float16: (2e-2, 2e-2), torch.bfloat16: (5e-2, 5e-2)}
MOE_SPEEDUP_GOAL = 2.0


def import_kernels():
    """(reference, dispatch, triton_attention, triton_rms_norm, triton_rotary, triton_store_kv,
    triton_moe, triton_mla, triton_verify, reference_mla, reference_verify, triton_activation)."""
    try:
        import kvbatch.kernels  # noqa: F401
    except ModuleNotFoundError:
        root = Path(__file__).resolve().parents[1]
        pkg = types.ModuleType("kvbatch")
        pkg.__path__ = []
        sys.modules["kvbatch"] = pkg
        spec = importlib.util.spec_from_file_location(
            "kvbatch.kernels", root / "kernels" / "__init__.py", submodule_search_locations=[str(root / "kernels")]
        )
        mod = importlib.util.module_from_spec(spec)
        sys.modules["kvbatch.kernels"] = mod
        spec.loader.exec_module(mod)
    from kvbatch.kernels import (
        dispatch,
        reference,
        reference_mla,
        reference_verify,
        triton_activation,
        triton_attention,
        triton_mla,
        triton_moe,
        triton_rms_norm,
        triton_rotary,
        triton_store_kv,
        triton_verify,
    )

    return (reference, dispatch, triton_attention, triton_rms_norm, triton_rotary, triton_store_kv,
            triton_moe, triton_mla, triton_verify, reference_mla, reference_verify, triton_activation)


# ---------------------------------------------------------------------------------------------
# inputs


def make_cache(context_lens: list[int], block_size: int, Hkv: int, D: int, dtype, device, gen):
    """Paged K/V caches holding ``context_lens`` tokens, blocks shuffled, table padding random."""
    need = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(need) + 4
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.randint(0, num_blocks, (len(context_lens), max(max(need, default=1), 1)), generator=gen)
    used = 0
    for b, n in enumerate(need):
        tables[b, :n] = perm[used : used + n]
        used += n
    k_cache = torch.randn(num_blocks, block_size, Hkv, D, device=device, dtype=dtype)
    v_cache = torch.randn(num_blocks, block_size, Hkv, D, device=device, dtype=dtype)
    return k_cache, v_cache, tables.to(device=device, dtype=torch.int32)


def poison_allocator(nbytes: int, device) -> None:
    """Leave NaNs in the caching allocator's free blocks so an output the kernel forgets to
    write shows up in the check."""
    torch.full((nbytes // 4 + 1,), float("nan"), device=device)


def max_error(actual: torch.Tensor, expected: torch.Tensor, tol: tuple[float, float]) -> tuple[bool, float]:
    a, e = actual.float(), expected.float()
    atol, rtol = tol
    ok = bool(torch.isfinite(a).all()) and bool(((a - e).abs() <= atol + rtol * e.abs()).all())
    err = float((a - e).abs().max()) if a.numel() else 0.0
    return ok and actual.dtype == expected.dtype and actual.shape == expected.shape, err


# ---------------------------------------------------------------------------------------------
# cases: each returns (run_triton, run_reference, check, bytes, flops)


def decode_case(K, B, ctx, Hq, Hkv, D, dtype, block_size=16, seed=0, lens=None, **kwargs):
    R, _, TA, *_ = K
    dev = DEVICE
    gen = torch.Generator().manual_seed(seed)
    lens = lens if lens is not None else [ctx] * B
    k_cache, v_cache, tables = make_cache(lens, block_size, Hkv, D, dtype, dev, gen)
    q = torch.randn(len(lens), Hq, D, device=dev, dtype=dtype)
    cl = torch.tensor(lens, device=dev, dtype=torch.int32)
    scale = D**-0.5
    max_len = max(lens, default=0)

    def run_triton():
        return TA.paged_decode_attention(q, k_cache, v_cache, tables, cl, scale, max_context_len=max_len, **kwargs)

    def run_reference():
        return R.paged_decode_attention(q, k_cache, v_cache, tables, cl, scale)

    def check():
        poison_allocator(q.numel() * 4 * 4, dev)
        expected = run_reference()
        # An empty context gives zeros (the twin's CPU result); SDPA on CUDA may give NaN there.
        expected = torch.where(cl[:, None, None] == 0, torch.zeros_like(expected), expected)
        return max_error(run_triton(), expected, ATTN_TOL[dtype])

    tokens = sum(lens)
    nbytes = 2 * tokens * Hkv * D * k_cache.element_size() + 2 * q.numel() * q.element_size()
    return run_triton, run_reference, check, nbytes, 4 * tokens * Hq * D


def prefill_case(K, ctx_lens, new_lens, Hq, Hkv, D, dtype, block_size=16, seed=0):
    R, _, TA, *_ = K
    dev = DEVICE
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache, tables = make_cache(ctx_lens, block_size, Hkv, D, dtype, dev, gen)
    cu = torch.tensor([0, *itertools_accumulate(new_lens)], device=dev, dtype=torch.int32)
    q = torch.randn(sum(new_lens), Hq, D, device=dev, dtype=dtype)
    cl = torch.tensor(ctx_lens, device=dev, dtype=torch.int32)
    scale = D**-0.5
    max_q = max(new_lens, default=0)

    def run_triton():
        return TA.prefill_attention(q, k_cache, v_cache, tables, cu, cl, scale, max_query_len=max_q)

    def run_reference():
        return R.prefill_attention(q, k_cache, v_cache, tables, cu, cl, scale)

    def check():
        poison_allocator(q.numel() * 4 * 4, dev)
        return max_error(run_triton(), run_reference(), ATTN_TOL[dtype])

    visible = sum(n * (c - n) + n * (n + 1) // 2 for c, n in zip(ctx_lens, new_lens))
    nbytes = 2 * sum(ctx_lens) * Hkv * D * k_cache.element_size() + 2 * q.numel() * q.element_size()
    return run_triton, run_reference, check, nbytes, 4 * visible * Hq * D


def itertools_accumulate(xs):
    total, out = 0, []
    for x in xs:
        total += x
        out.append(total)
    return out


def rms_norm_case(K, T, H, dtype, residual=True):
    R, _, _, TN, *_ = K
    x = torch.randn(T, H, device=DEVICE, dtype=dtype)
    res = torch.randn(T, H, device=DEVICE, dtype=dtype) if residual else None
    w = torch.randn(H, device=DEVICE, dtype=dtype)

    def check():
        poison_allocator(x.numel() * 4 * 2, DEVICE)
        a, e = TN.rms_norm(x, w, 1e-5, res), R.rms_norm(x, w, 1e-5, res)
        r0, r1 = max_error(a[0], e[0], ELEM_TOL[dtype]), max_error(a[1], e[1], ELEM_TOL[dtype])
        return r0[0] and r1[0], max(r0[1], r1[1])

    nbytes = x.numel() * x.element_size() * (4 if residual else 2) + w.numel() * w.element_size()
    return (lambda: TN.rms_norm(x, w, 1e-5, res)), (lambda: R.rms_norm(x, w, 1e-5, res)), check, nbytes, 0


def silu_and_mul_case(K, T, inter, dtype):
    """The gated MLP's activation on a gate/up projection output [T, 2 I] (Triton: one pass)."""
    R, TA = K[0], K[11]
    x = torch.randn(T, 2 * inter, device=DEVICE, dtype=dtype) * 3

    def check():
        poison_allocator(x.numel() * x.element_size(), DEVICE)
        return max_error(TA.silu_and_mul(x), R.silu_and_mul(x), ELEM_TOL[dtype])

    nbytes = x.numel() * x.element_size() * 3 // 2  # read gate and up, write the product
    return (lambda: TA.silu_and_mul(x)), (lambda: R.silu_and_mul(x)), check, nbytes, 0


def rotary_case(K, T, Hq, Hkv, D, dtype):
    R, _, _, _, TR, *_ = K
    qkv = torch.randn(T, (Hq + 2 * Hkv) * D, device=DEVICE, dtype=dtype)
    q = qkv[:, : Hq * D].view(T, Hq, D)
    k = qkv[:, Hq * D : (Hq + Hkv) * D].view(T, Hkv, D)
    pos = torch.randint(0, 8192, (T,), device=DEVICE)
    ang = torch.rand(8192, D // 2, device=DEVICE) * 6.3
    cos_sin = torch.cat([ang.cos(), ang.sin()], 1)

    def check():
        q0, k0 = q.clone(), k.clone()
        eq, ek = R.apply_rotary(q0, k0, pos, cos_sin)
        TR.apply_rotary(q0, k0, pos, cos_sin)
        a, b = max_error(q0, eq, ELEM_TOL[dtype]), max_error(k0, ek, ELEM_TOL[dtype])
        return a[0] and b[0], max(a[1], b[1])

    nbytes = 2 * T * (Hq + Hkv) * D * qkv.element_size() + T * (D * 4 + 8)
    return (lambda: TR.apply_rotary(q, k, pos, cos_sin)), (lambda: R.apply_rotary(q, k, pos, cos_sin)), check, nbytes, 0


def store_kv_case(K, T, Hkv, D, dtype, block_size=16, src_dtype=None):
    R, _, _, _, _, TS, *_ = K
    src_dtype = src_dtype or dtype
    num_blocks = -(-T // block_size) * 2
    k_cache = torch.randn(num_blocks, block_size, Hkv, D, device=DEVICE, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:T]
    kv = torch.randn(T, 2, Hkv, D, device=DEVICE, dtype=src_dtype)
    k, v = kv[:, 0], kv[:, 1]

    def check():
        ek, ev = k_cache.clone(), v_cache.clone()
        ak, av = k_cache.clone(), v_cache.clone()
        R.store_kv(k, v, ek, ev, slots)
        TS.store_kv(k, v, ak, av, slots)
        ok = torch.equal(ak, ek) and torch.equal(av, ev)
        return ok, float((ak.float() - ek.float()).abs().max())

    nbytes = 2 * T * Hkv * D * (kv.element_size() + k_cache.element_size()) + T * 8
    def run_triton():
        TS.store_kv(k, v, k_cache, v_cache, slots)

    def run_reference():
        R.store_kv(k, v, k_cache, v_cache, slots)

    return run_triton, run_reference, check, nbytes, 0


def moe_case(K, T, H, I, E, k, dtype, seed=0, out_of_range=0.0, **kwargs):
    """Routed experts for T tokens, k distinct experts each (a random router), weights
    summing to 1; ``out_of_range`` of the ids replaced by -1 (experts on another rank)."""
    R, *_ = K
    TM = K[6]
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=gen).to(device=DEVICE, dtype=dtype)
    w_gate_up = (torch.randn(E, 2 * I, H, device=DEVICE) * H**-0.5).to(dtype)
    w_down = (torch.randn(E, H, I, device=DEVICE) * I**-0.5).to(dtype)
    scores = torch.rand(T, E, generator=gen)
    weights, ids = torch.topk(scores.softmax(-1), k, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    if out_of_range:
        ids = torch.where(torch.rand(T, k, generator=gen) < out_of_range, -1, ids)
    ids, weights = ids.to(DEVICE), weights.to(DEVICE)

    def run_triton():
        return TM.fused_moe(x, w_gate_up, w_down, ids, weights, **kwargs)

    def run_reference():
        return R.fused_moe(x, w_gate_up, w_down, ids, weights)

    def check():
        poison_allocator(x.numel() * x.element_size() * 4 * max(k, 1), DEVICE)
        return max_error(run_triton(), run_reference(), MOE_TOL[dtype])

    valid = ids[(ids >= 0) & (ids < E)]
    experts_used = int(torch.unique(valid).numel()) if valid.numel() else 0
    pairs = int(valid.numel())
    nbytes = experts_used * 3 * I * H * w_gate_up.element_size() + 2 * x.numel() * x.element_size()
    return run_triton, run_reference, check, nbytes, 2 * pairs * 3 * I * H


def mla_case(K, lens, Hq, C, Rd, dtype, block_size=16, seed=0, **kwargs):
    """MLA decode over a paged latent cache of rows [c_kv ; k_pe] (width C + Rd)."""
    TL, RM = K[7], K[9]
    gen = torch.Generator().manual_seed(seed)
    cache, _, tables = make_cache(lens, block_size, 1, C + Rd, dtype, DEVICE, gen)
    q_latent = torch.randn(len(lens), Hq, C, device=DEVICE, dtype=dtype)
    q_pe = torch.randn(len(lens), Hq, Rd, device=DEVICE, dtype=dtype)
    cl = torch.tensor(lens, device=DEVICE, dtype=torch.int32)
    scale = (C + Rd) ** -0.5
    max_len = max(lens, default=0)

    def run_triton():
        return TL.mla_decode_attention(q_latent, q_pe, cache, tables, cl, scale, max_context_len=max_len, **kwargs)

    def run_reference():
        return RM.mla_decode_attention(q_latent, q_pe, cache, tables, cl, scale)

    def check():
        poison_allocator(q_latent.numel() * 4 * 4, DEVICE)
        expected = run_reference()
        expected = torch.where(cl[:, None, None] == 0, torch.zeros_like(expected), expected)
        return max_error(run_triton(), expected, ATTN_TOL[dtype])

    tokens = sum(lens)
    nbytes = tokens * (C + Rd) * cache.element_size() + 2 * q_latent.numel() * q_latent.element_size()
    return run_triton, run_reference, check, nbytes, 2 * tokens * Hq * (2 * C + Rd)


def mla_prefill_case(K, ctx_lens, new_lens, Hq, C, Rd, dtype, block_size=16, seed=0):
    """MLA prefill: chunks of ``new_lens`` tokens after ``ctx_lens - new_lens`` cached ones, over
    the latent cache (Triton: the paged prefill kernel as MQA over [c_kv ; k_pe], see dispatch)."""
    D, RM, TA = K[1], K[9], K[2]
    gen = torch.Generator().manual_seed(seed)
    cache, _, tables = make_cache(ctx_lens, block_size, 1, C + Rd, dtype, DEVICE, gen)
    T = sum(new_lens)
    q_latent = torch.randn(T, Hq, C, device=DEVICE, dtype=dtype)
    q_pe = torch.randn(T, Hq, Rd, device=DEVICE, dtype=dtype)
    cu = torch.tensor([0] + [sum(new_lens[:i + 1]) for i in range(len(new_lens))], device=DEVICE, dtype=torch.int32)
    cl = torch.tensor(ctx_lens, device=DEVICE, dtype=torch.int32)
    scale = (C + Rd) ** -0.5
    longest = max(new_lens, default=0)

    def run_triton():
        q = torch.cat([q_latent, q_pe], dim=-1)
        return TA.prefill_attention(q, cache, cache, tables, cu, cl, scale, max_query_len=longest)[..., :C]

    def run_reference():
        return RM.mla_prefill_attention(q_latent, q_pe, cache, tables, cu, cl, scale)

    def check():
        poison_allocator(q_latent.numel() * 4 * 4, DEVICE)
        return max_error(D.mla_prefill_attention(q_latent, q_pe, cache, tables, cu, cl, scale, longest),
                         run_reference(), ATTN_TOL[dtype])

    keys = sum(ctx_lens)
    nbytes = keys * (C + Rd) * cache.element_size() + 2 * q_latent.numel() * q_latent.element_size()
    flops = 2 * Hq * (2 * C + Rd) * sum(n * (c - n) + n * (n + 1) // 2 for c, n in zip(ctx_lens, new_lens))
    return run_triton, run_reference, check, nbytes, flops


def verify_case(K, N, k, V, seed=0, one_hot=False):
    """The speculative accept/reject step for N requests of k drafts over a V-token vocabulary:
    spec_accept, then spec_recover (the token after the kept drafts)."""
    TV, RV = K[8], K[10]
    gen = torch.Generator().manual_seed(seed)
    target = torch.softmax(torch.randn(N, k + 1, V, generator=gen) * 3, -1)
    draft = torch.softmax(torch.randn(N, k, V, generator=gen) * 3, -1)
    # Drafts from a mix of p and q, so some are kept and some rejected.
    source = torch.where(torch.rand(N, k, 1, generator=gen) < 0.5, target[:, :k], draft)
    tokens = (torch.multinomial(source.reshape(-1, V), 1, generator=gen).view(N, k) if k
              else torch.zeros(N, 0, dtype=torch.long))
    num_drafts = torch.randint(0, k + 1, (N,), generator=gen)
    uniforms = torch.rand(N, k, generator=gen)
    noise = torch.empty(N, V).exponential_(generator=gen)
    dev = DEVICE
    target, draft, tokens, num_drafts, uniforms, noise = (
        t.to(dev) for t in (target, draft, tokens, num_drafts, uniforms, noise))
    q_all = None if one_hot else draft
    p_tok = target[:, :k].gather(2, tokens[..., None])[..., 0]
    q_tok = torch.ones_like(p_tok) if one_hot else draft.gather(2, tokens[..., None])[..., 0]

    def run(impl):
        accepted = impl.spec_accept(p_tok, q_tok, uniforms, num_drafts)
        return accepted, impl.spec_recover(target, q_all, tokens, accepted, num_drafts, noise)

    def check():
        (a, t), (ea, et) = run(TV), run(RV)
        ok = torch.equal(a, ea) and torch.equal(t, et)
        return ok, float((a != ea).sum() + (t != et).sum())

    # One target row, one draft row and one noise row per request (fp32), plus the [N, k] inputs.
    nbytes = N * V * 4 * (2 if one_hot else 3) + 3 * N * k * 4
    return (lambda: run(TV)), (lambda: run(RV)), check, nbytes, 0


# ---------------------------------------------------------------------------------------------
# timing


class Timer:
    def __init__(self, flush_bytes: int = 512 << 20):
        self.flush = torch.empty(flush_bytes, dtype=torch.uint8, device=DEVICE)

    def median_ms(self, fn, warmup: int = 3, iters: int = 20) -> float:
        for _ in range(warmup):
            fn()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        for s, e in zip(starts, ends):
            self.flush.zero_()  # evict L2 so every iteration reads from HBM
            s.record()
            fn()
            e.record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def check_suite(K) -> list[tuple[str, bool, float]]:
    """Edge cases and mixed shapes on the GPU, every kernel, every KV dtype."""
    results = []

    def add(name, case):
        ok, err = case[2]()
        results.append((name, ok, err))

    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        dn = str(dtype).removeprefix("torch.")
        add(f"decode {dn} mixed lens, split",
            decode_case(K, 0, 0, 32, 8, 128, dtype, lens=[1, 17, 4096, 1000, 513, 16], seed=1))
        add(f"decode {dn} short, no split", decode_case(K, 0, 0, 12, 4, 64, dtype, lens=[1, 7, 300, 33], seed=2))
        add(f"decode {dn} D=80 group 5, block 32",
            decode_case(K, 0, 0, 10, 2, 80, dtype, block_size=32, lens=[77, 1025, 3], seed=3))
        add(f"decode {dn} empty context", decode_case(K, 0, 0, 8, 8, 128, dtype, lens=[0, 5, 0], seed=4))
        add(f"prefill {dn} chunked + full",
            prefill_case(K, [700, 1, 1500, 64], [300, 1, 1500, 0], 32, 8, 128, dtype, seed=5))
        add(f"prefill {dn} D=64 block 8", prefill_case(K, [129, 33], [65, 33], 9, 3, 64, dtype, block_size=8, seed=6))
        add(f"rms_norm {dn} residual", rms_norm_case(K, 333, 4096, dtype))
        add(f"rms_norm {dn} no residual H=576", rms_norm_case(K, 7, 576, dtype, residual=False))
        add(f"rotary {dn} 9/3 heads D=64", rotary_case(K, 100, 9, 3, 64, dtype))
        add(f"silu_and_mul {dn} I=1536 (SmolLM2)", silu_and_mul_case(K, 7, 1536, dtype))
        add(f"silu_and_mul {dn} I=14336, odd rows", silu_and_mul_case(K, 333, 14336, dtype))
        add(f"store_kv {dn}", store_kv_case(K, 1000, 8, 128, dtype))
    add("store_kv fp32 -> bf16 cache",
        store_kv_case(K, 257, 3, 64, torch.bfloat16, block_size=5, src_dtype=torch.float32))
    add("decode B=0", decode_case(K, 0, 0, 8, 2, 64, torch.bfloat16, lens=[]))
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        dn = str(dtype).removeprefix("torch.")
        add(f"fused_moe {dn} decode E64 k6", moe_case(K, 7, 1024, 352, 64, 6, dtype, seed=11))
        add(f"fused_moe {dn} prefill E8 k2, dropped ids",
            moe_case(K, 333, 512, 200, 8, 2, dtype, seed=12, out_of_range=0.3))
        add(f"mla decode {dn} mixed lens, split",
            mla_case(K, [1, 17, 4096, 1000, 513, 16], 16, 512, 64, dtype, seed=13))
        add(f"mla decode {dn} 128 heads, block 64", mla_case(K, [77, 1025, 3], 128, 512, 64, dtype, block_size=64,
                                                             seed=14))
    add("mla decode empty context", mla_case(K, [0, 5, 0], 16, 512, 64, torch.bfloat16, seed=15))
    for dtype in (torch.float32, torch.bfloat16):
        dn = str(dtype).removeprefix("torch.")
        add(f"mla prefill {dn} chunked + full, 16 heads C512 R64",
            mla_prefill_case(K, [700, 33, 1500], [300, 33, 1], 16, 512, 64, dtype, seed=19))
    add("fused_moe T=0", moe_case(K, 0, 256, 128, 4, 2, torch.bfloat16))
    add("spec verify, draft probs", verify_case(K, 100, 4, 32000, seed=16))
    add("spec verify, one-hot drafts", verify_case(K, 37, 3, 1000, seed=17, one_hot=True))
    add("spec verify, k=0", verify_case(K, 5, 0, 100, seed=18))
    return results


def bench_cases(K):
    bf16 = torch.bfloat16
    gen = torch.Generator().manual_seed(7)
    mixed = torch.randint(1, 4097, (256,), generator=gen).tolist()
    return [
        ("decode (headline)", "32 seq x 8k ctx, 32q/8kv, D128, bf16", decode_case(K, 32, 8192, 32, 8, 128, bf16)),
        ("decode", "32 seq x 32k ctx, 32q/8kv, D128, bf16", decode_case(K, 32, 32768, 32, 8, 128, bf16)),
        ("decode", "256 seq x 1..4k ctx, 32q/8kv, D128, bf16", decode_case(K, 0, 0, 32, 8, 128, bf16, lens=mixed)),
        ("decode", "32 seq x 8k ctx, 32q/8kv, D128, fp16", decode_case(K, 32, 8192, 32, 8, 128, torch.float16)),
        ("decode", "64 seq x 2k ctx, 9q/3kv, D64, bf16 (SmolLM2)", decode_case(K, 64, 2048, 9, 3, 64, bf16)),
        ("prefill", "4 x (2k cached + 2k new), 32q/8kv, D128, bf16",
         prefill_case(K, [4096] * 4, [2048] * 4, 32, 8, 128, bf16)),
        ("prefill", "8 x 1k new, 32q/8kv, D128, bf16", prefill_case(K, [1024] * 8, [1024] * 8, 32, 8, 128, bf16)),
        ("rms_norm + residual", "16k tok x 4096, bf16", rms_norm_case(K, 16384, 4096, bf16)),
        ("rotary (in place)", "16k tok, 32q/8kv, D128, bf16", rotary_case(K, 16384, 32, 8, 128, bf16)),
        ("silu_and_mul", "16k tok x I14336 (Llama-3.1-8B MLP), bf16", silu_and_mul_case(K, 16384, 14336, bf16)),
        ("silu_and_mul", "64 tok x I1536 (SmolLM2 decode), bf16", silu_and_mul_case(K, 64, 1536, bf16)),
        ("store_kv", "16k tok, 8kv, D128, bf16", store_kv_case(K, 16384, 8, 128, bf16)),
        ("fused MoE", "Mixtral decode: 32 tok, E8 k2, H4096 I14336, bf16",
         moe_case(K, 32, 4096, 14336, 8, 2, bf16)),
        ("fused MoE", "Qwen3-30B-A3B decode: 64 tok, E128 k8, H2048 I768",
         moe_case(K, 64, 2048, 768, 128, 8, bf16)),
        ("fused MoE", "Qwen3-30B-A3B prefill: 8k tok, E128 k8, bf16", moe_case(K, 8192, 2048, 768, 128, 8, bf16)),
        ("fused MoE", "Mixtral prefill: 4k tok, E8 k2, bf16", moe_case(K, 4096, 4096, 14336, 8, 2, bf16)),
        ("MLA decode", "32 seq x 8k ctx, 16 heads, C512 R64, bf16", mla_case(K, [8192] * 32, 16, 512, 64, bf16)),
        ("MLA decode", "32 seq x 8k ctx, 128 heads, C512 R64, bf16", mla_case(K, [8192] * 32, 128, 512, 64, bf16)),
        ("MLA decode", "128 seq x 1..4k ctx, 16 heads, C512 R64, bf16", mla_case(K, mixed[:128], 16, 512, 64, bf16)),
        ("MLA prefill", "4 x (2k cached + 2k new), 16 heads, C512 R64, bf16",
         mla_prefill_case(K, [4096] * 4, [2048] * 4, 16, 512, 64, bf16)),
        ("spec verify", "256 req x 4 drafts, V=152k, draft probs", verify_case(K, 256, 4, 152064)),
    ]


def sweep_decode(K, timer: Timer) -> None:
    print("\ndecode sweep, 32 seq x 8k ctx, 32q/8kv, D128, bf16:")
    print(f"{'block_n':>7} {'partition':>9} {'warps':>5} {'stages':>6} {'ms':>8} {'GB/s':>7} {'%HBM':>5}")
    for block_n in (32, 64, 128):
        for partition_size in (256, 512, 1024, 2048):
            for num_warps in (4, 8):
                for num_stages in (2, 3, 4):
                    run, _, check, nbytes, _ = decode_case(
                        K, 32, 8192, 32, 8, 128, torch.bfloat16, block_n=block_n,
                        partition_size=partition_size, num_warps=num_warps, num_stages=num_stages,
                    )
                    try:
                        ok, _ = check()
                        ms = timer.median_ms(run, iters=10)
                    except Exception as e:  # a config that does not compile (shared memory, say)
                        print(f"{block_n:>7} {partition_size:>9} {num_warps:>5} {num_stages:>6}  "
                              f"failed: {type(e).__name__}")
                        continue
                    gbs = nbytes / ms / 1e6
                    flag = "" if ok else "  WRONG"
                    print(f"{block_n:>7} {partition_size:>9} {num_warps:>5} {num_stages:>6} {ms:8.3f} {gbs:7.0f} "
                          f"{gbs * 1e9 / H200_HBM_BYTES_PER_S:5.0%}{flag}")
                    del run, check
                    torch.cuda.empty_cache()


def sweep_moe_mla(K, timer: Timer) -> None:
    """Tile configurations of the fused MoE (decode and prefill shapes) and of MLA decode."""
    bf16 = torch.bfloat16
    shapes = [("Qwen3-MoE decode 64 tok", (64, 2048, 768, 128, 8)),
              ("Qwen3-MoE prefill 8k tok", (8192, 2048, 768, 128, 8))]
    for label, (T, H, I, E, k) in shapes:
        print(f"\nfused MoE sweep, {label}:")
        print(f"{'bm':>4} {'bn':>4} {'bk':>4} {'warps':>5} {'stages':>6} {'ms':>8}")
        for bm in (16, 32, 64):
            for bn, bk in ((64, 64), (64, 128), (128, 64), (128, 128)):
                for num_warps, num_stages in ((4, 3), (4, 4), (8, 3)):
                    run, _, check, *_ = moe_case(K, T, H, I, E, k, bf16, block_m=bm, block_n=bn, block_k=bk,
                                                 num_warps=num_warps, num_stages=num_stages)
                    try:
                        ok, _ = check()
                        ms = timer.median_ms(run, iters=10)
                    except Exception as e:  # a config that does not compile (shared memory, say)
                        print(f"{bm:>4} {bn:>4} {bk:>4} {num_warps:>5} {num_stages:>6}  failed: {type(e).__name__}")
                        continue
                    print(f"{bm:>4} {bn:>4} {bk:>4} {num_warps:>5} {num_stages:>6} {ms:8.3f}{'' if ok else '  WRONG'}")
                    del run, check
                    torch.cuda.empty_cache()
    print("\nMLA decode sweep, 32 seq x 8k ctx, 16 heads, C512 R64, bf16:")
    print(f"{'block_n':>7} {'partition':>9} {'warps':>5} {'stages':>6} {'ms':>8} {'GB/s':>7} {'%HBM':>5}")
    for block_n in (16, 32, 64):
        for partition_size in (512, 1024, 2048):
            for num_warps, num_stages in ((4, 2), (4, 3), (8, 2)):
                run, _, check, nbytes, _ = mla_case(K, [8192] * 32, 16, 512, 64, bf16, block_n=block_n,
                                                    partition_size=partition_size, num_warps=num_warps,
                                                    num_stages=num_stages)
                try:
                    ok, _ = check()
                    ms = timer.median_ms(run, iters=10)
                except Exception as e:
                    print(f"{block_n:>7} {partition_size:>9} {num_warps:>5} {num_stages:>6}  "
                          f"failed: {type(e).__name__}")
                    continue
                gbs = nbytes / ms / 1e6
                print(f"{block_n:>7} {partition_size:>9} {num_warps:>5} {num_stages:>6} {ms:8.3f} {gbs:7.0f} "
                      f"{gbs * 1e9 / H200_HBM_BYTES_PER_S:5.0%}{'' if ok else '  WRONG'}")
                del run, check
                torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check-only", action="store_true", help="check the kernels against their twins; no timing")
    parser.add_argument("--sweep", action="store_true",
                        help="also sweep the tuning arguments of decode attention, fused MoE and MLA decode")
    parser.add_argument("--skip-reference", action="store_true", help="do not time the PyTorch reference")
    args = parser.parse_args(argv)

    if not torch.cuda.is_available():
        print("gpu_kernels: no CUDA device here; the GPU checks and figures need one (nothing to do).")
        return 0
    try:
        import triton  # noqa: F401
    except ImportError:
        print("gpu_kernels: triton is not importable; the Triton kernels need it.")
        return 1
    K = import_kernels()
    dispatch = K[1]
    assert dispatch.backend(torch.empty(1, device=DEVICE)) in ("triton", "reference")
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
          f"dispatch on CUDA -> {dispatch.backend(torch.empty(1, device=DEVICE))}")

    failed = 0
    print(f"\n{'check':<40} {'ok':>4} {'max |err|':>10}")
    for name, ok, err in check_suite(K):
        failed += not ok
        print(f"{name:<40} {'ok' if ok else 'FAIL':>4} {err:10.2e}")
    if args.check_only:
        print(f"\n{failed} check(s) failed" if failed else "\nall checks passed")
        return 1 if failed else 0

    timer = Timer()
    header = (f"{'kernel':<20} {'shape':<46} {'ms':>8} {'achieved':>13} {'of H200':>7} "
              f"{'ref ms':>8} {'speedup':>7} {'check':>5}")
    rows = [header, "-" * len(header)]
    headline = None
    moe_speedups = []
    for name, shape, (run, ref, check, nbytes, flops) in bench_cases(K):
        ok, _ = check()
        failed += not ok
        ms = timer.median_ms(run)
        ref_ms = math.nan if args.skip_reference else timer.median_ms(ref, warmup=1, iters=5)
        # Whichever roofline binds: the larger fraction of the H200's FLOP/s or bandwidth.
        flop_frac = flops / (ms * 1e-3) / H200_BF16_FLOP_PER_S
        byte_frac = nbytes / (ms * 1e-3) / H200_HBM_BYTES_PER_S
        if flop_frac > byte_frac:
            achieved, frac = f"{flops / ms / 1e9:8.1f} TF/s", flop_frac
        else:
            achieved, frac = f"{nbytes / ms / 1e6:8.0f} GB/s", byte_frac
        if name == "fused MoE":
            moe_speedups.append(ref_ms / ms)
        if headline is None and name.startswith("decode"):
            headline = frac
        rows.append(f"{name:<20} {shape:<46} {ms:8.3f} {achieved:>13} {frac:7.1%} {ref_ms:8.3f} "
                    f"{ref_ms / ms:6.1f}x {'ok' if ok else 'FAIL':>5}")
        del run, ref, check
        torch.cuda.empty_cache()
    if args.sweep:
        sweep_decode(K, timer)
        sweep_moe_mla(K, timer)
    print()
    print("\n".join(rows))
    print(f"\nheadline decode: {headline:.1%} of H200 HBM bandwidth (goal >= {HEADLINE_GOAL:.0%})"
          f"{'' if headline >= HEADLINE_GOAL else ' -- BELOW GOAL'}")
    if moe_speedups and not args.skip_reference:
        worst = min(moe_speedups)
        print(f"fused MoE: at least {worst:.1f}x the PyTorch reference (goal >= {MOE_SPEEDUP_GOAL:.0f}x)"
              f"{'' if worst >= MOE_SPEEDUP_GOAL else ' -- BELOW GOAL'}")
    print(f"{failed} check(s) failed" if failed else "all checks passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
