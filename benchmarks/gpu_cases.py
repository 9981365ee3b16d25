"""The GPU check's kernel cases (``benchmarks/gpu_kernels.py``): each builds its inputs on
``DEVICE`` and returns the Triton kernel's call, the PyTorch twin's, a check against the twin
(max error within the dtype's tolerance) and the bytes and FLOPs the kernel must move, for
``gpu_kernels`` to check, time and sweep. ``DEVICE`` is a module global so the cases can be
built on a CPU (the Triton interpreter) in the tests and in ``gpu_check --smoke``.
"""

from __future__ import annotations

import itertools
import math

import torch

DEVICE = "cuda"  # a module global so the script's logic can be smoke-tested on a CPU

ATTN_TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (3e-3, 3e-3), torch.bfloat16: (3e-2, 3e-2)}
ELEM_TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (1e-3, 2e-3), torch.bfloat16: (1e-2, 1.6e-2)}
# Fused MoE: the reference rounds gate_up and the down output to the input dtype, the kernel
# only the activation between the GEMMs; fp32 sums over thousands of products in other orders.
MOE_TOL = {torch.float32: (1e-3, 1e-3), torch.float16: (2e-2, 2e-2), torch.bfloat16: (5e-2, 5e-2)}


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
    cu = torch.tensor([0, *itertools.accumulate(new_lens)], device=dev, dtype=torch.int32)
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


def _sinks(Hq, dev, gen):
    """gpt-oss-like sink logits: one above every score (head 0: the maximum must take it), one -inf (no sink)."""
    sinks = torch.randn(Hq, generator=gen) * 2
    sinks[0] = 40.0
    sinks[-1] = -float("inf")
    return sinks.to(dev)


def sinks_decode_case(K, lens, Hq, Hkv, D, dtype, window=0, block_size=16, seed=0, **kwargs):
    """Paged decode with gpt-oss's attention sinks and a sliding ``window`` (0: a full layer). The
    twin: the decode rows as prefill chunks of one token through the reference's windowed plan
    (its padded decode takes no window)."""
    R, _, TA, *_ = K
    dev = DEVICE
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache, tables = make_cache(lens, block_size, Hkv, D, dtype, dev, gen)
    q = torch.randn(len(lens), Hq, D, device=dev, dtype=dtype)
    cl = torch.tensor(lens, device=dev, dtype=torch.int32)
    cu = torch.arange(len(lens) + 1, device=dev, dtype=torch.int32)
    sinks, scale = _sinks(Hq, dev, gen), D**-0.5

    def run_triton():
        return TA.paged_decode_attention(q, k_cache, v_cache, tables, cl, scale, max_context_len=max(lens),
                                         window=window, sinks=sinks, **kwargs)

    def run_reference():
        plan = R.plan_prefill(tables, cu, cl, block_size, Hq // Hkv, window)
        return R.prefill_attention(q, k_cache, v_cache, tables, cu, cl, scale, plan, sinks)

    def check():
        poison_allocator(q.numel() * 4 * 4, dev)
        return max_error(run_triton(), run_reference(), ATTN_TOL[dtype])

    tokens = sum(min(n, window) if window else n for n in lens)
    nbytes = 2 * tokens * Hkv * D * k_cache.element_size() + 2 * q.numel() * q.element_size()
    return run_triton, run_reference, check, nbytes, 4 * tokens * Hq * D


def sinks_prefill_case(K, ctx_lens, new_lens, Hq, Hkv, D, dtype, window=0, block_size=16, seed=0):
    """Prefill chunks with gpt-oss's attention sinks and a sliding ``window`` (0: a full layer),
    against the reference's windowed plan with the same sinks."""
    R, _, TA, *_ = K
    dev = DEVICE
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache, tables = make_cache(ctx_lens, block_size, Hkv, D, dtype, dev, gen)
    cu = torch.tensor([0, *itertools.accumulate(new_lens)], device=dev, dtype=torch.int32)
    q = torch.randn(sum(new_lens), Hq, D, device=dev, dtype=dtype)
    cl = torch.tensor(ctx_lens, device=dev, dtype=torch.int32)
    sinks, scale = _sinks(Hq, dev, gen), D**-0.5

    def run_triton():
        return TA.prefill_attention(q, k_cache, v_cache, tables, cu, cl, scale, max_query_len=max(new_lens),
                                    window=window, sinks=sinks)

    def run_reference():
        plan = R.plan_prefill(tables, cu, cl, block_size, Hq // Hkv, window)
        return R.prefill_attention(q, k_cache, v_cache, tables, cu, cl, scale, plan, sinks)

    def check():
        poison_allocator(q.numel() * 4 * 4, dev)
        return max_error(run_triton(), run_reference(), ATTN_TOL[dtype])

    seen = [sum(min(c - n + i + 1, window or c) for i in range(n)) for c, n in zip(ctx_lens, new_lens)]
    nbytes = 2 * sum(ctx_lens) * Hkv * D * k_cache.element_size() + 2 * q.numel() * q.element_size()
    return run_triton, run_reference, check, nbytes, 4 * sum(seen) * Hq * D


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


def _fp8_experts(E, N, Kd, block, gen):
    """FP8 expert weights [E, N, Kd] over the e4m3 range and block scales making rows ~N(0, 1/Kd)."""
    w = (torch.randn(E, N, Kd, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn).to(DEVICE)
    s = ((torch.rand(E, -(-N // block[0]), -(-Kd // block[1]), generator=gen) + 0.5) / 100 * Kd**-0.5).to(DEVICE)
    return w, s


def _mxfp4_experts(E, N, Kd, gen):
    """MXFP4 expert blocks [E, N, Kd / 32, 16] (random codes) and E8M0 scales making rows ~N(0, 1/Kd)
    (an FP4 code's mean square is ~8.4: 2 ** -4 per group times Kd ** -0.5, jittered by one)."""
    blocks = torch.randint(0, 256, (E, N, Kd // 32, 16), generator=gen, dtype=torch.uint8).to(DEVICE)
    centre = 127 - 2 - round(math.log2(Kd) / 2)
    scales = torch.randint(centre - 1, centre + 2, (E, N, Kd // 32), generator=gen, dtype=torch.uint8).to(DEVICE)
    return blocks, scales


def moe_case(K, T, H, I, E, k, dtype, seed=0, out_of_range=0.0, gpt_oss=False, fp8=False, block=(128, 128),
             mxfp4=False, **kwargs):
    """Routed experts for T tokens, k distinct experts each (a random router), weights
    summing to 1; ``out_of_range`` of the ids replaced by -1 (experts on another rank);
    ``gpt_oss``: with expert biases and the clamped SwiGLU (alpha 1.702, limit 7), the biases
    large enough that the clamp bites; ``fp8``: the experts float8_e4m3fn with a scale per
    ``block`` (an FP8 checkpoint's, kept FP8), checked against their dequantized twin and timed
    against the reference on the weights dequantized once (what runs when they are not kept);
    ``mxfp4``: the experts MXFP4 blocks with E8M0 scales per 32 along K (gpt-oss's, kept MXFP4),
    checked and timed the same way against their dequantization (``mxfp4.dequantize_mxfp4``)."""
    R, D = K[0], K[1]
    TM = K[6]
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=gen).to(device=DEVICE, dtype=dtype)
    if fp8:
        (w_gate_up, s_gu), (w_down, s_dn) = _fp8_experts(E, 2 * I, H, block, gen), _fp8_experts(E, H, I, block, gen)
        kwargs = dict(kwargs, fp8_scales=(s_gu, s_dn), fp8_block=block)
        deq = [D.dequantize_fp8_experts(w, s, block).to(dtype) for w, s in ((w_gate_up, s_gu), (w_down, s_dn))]
    elif mxfp4:
        from kvbatch.engine.models.mxfp4 import dequantize_mxfp4

        (w_gate_up, s_gu), (w_down, s_dn) = _mxfp4_experts(E, 2 * I, H, gen), _mxfp4_experts(E, H, I, gen)
        kwargs = dict(kwargs, mxfp4_scales=(s_gu, s_dn))
        deq = [dequantize_mxfp4(w, s).to(dtype) for w, s in ((w_gate_up, s_gu), (w_down, s_dn))]
    else:
        w_gate_up = (torch.randn(E, 2 * I, H, device=DEVICE) * H**-0.5).to(dtype)
        w_down = (torch.randn(E, H, I, device=DEVICE) * I**-0.5).to(dtype)
        deq = [w_gate_up, w_down]
    scores = torch.rand(T, E, generator=gen)
    weights, ids = torch.topk(scores.softmax(-1), k, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    if out_of_range:
        ids = torch.where(torch.rand(T, k, generator=gen) < out_of_range, -1, ids)
    ids, weights = ids.to(DEVICE), weights.to(DEVICE)
    extra = {}
    if gpt_oss:
        extra = {"gate_up_bias": (torch.randn(E, 2 * I, generator=gen) * 4).to(device=DEVICE, dtype=dtype),
                 "down_bias": torch.randn(E, H, generator=gen).to(device=DEVICE, dtype=dtype), "swiglu": (1.702, 7.0)}

    def run_triton():
        return TM.fused_moe(x, w_gate_up, w_down, ids, weights, **extra, **kwargs)

    def run_reference():
        return R.fused_moe(x, *deq, ids, weights, **extra)

    def check():
        poison_allocator(x.numel() * x.element_size() * 4 * max(k, 1), DEVICE)
        return max_error(run_triton(), run_reference(), MOE_TOL[dtype])

    valid = ids[(ids >= 0) & (ids < E)]
    experts_used = int(torch.unique(valid).numel()) if valid.numel() else 0
    pairs = int(valid.numel())
    weight_bytes = 0.5 + 1 / 32 if mxfp4 else w_gate_up.element_size()  # MXFP4: a nibble and a scale per 32
    nbytes = int(experts_used * 3 * I * H * weight_bytes) + 2 * x.numel() * x.element_size()
    return run_triton, run_reference, check, nbytes, 2 * pairs * 3 * I * H


# FP8 GEMM: the twin rounds the same dequantized weight to the activation dtype and multiplies it
# with cuBLAS, the kernel with tl.dot: sums over thousands of products in other orders.
FP8_TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (3e-3, 3e-3), torch.bfloat16: (2e-2, 2e-2)}


def fp8_gemm_case(K, M, N, Kd, dtype, block=(128, 128), seed=0, bias=False, **kwargs):
    """``x [M, Kd] @ dequant(W)^T`` for a float8_e4m3fn ``W [N, Kd]`` with a scale per ``block``,
    scaled so outputs are O(1). The timed twin is cuBLAS over the weight dequantized once (what the
    engine runs when it does not keep FP8): the check compares the kernel with it."""
    D, TF = K[1], K[12]
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(N, Kd, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn).to(DEVICE)
    scales = (torch.rand(-(-N // block[0]), -(-Kd // block[1]), generator=gen) * 2 / 448 * Kd**-0.5).to(DEVICE)
    x = torch.randn(M, Kd, generator=gen).to(device=DEVICE, dtype=dtype)
    b = torch.randn(N, generator=gen).to(device=DEVICE, dtype=dtype) if bias else None
    w_deq = D.dequantize_fp8_block(w, scales, block).to(dtype)

    def run_triton():
        return TF.fp8_block_linear(x, w, scales, block, b, **kwargs)

    def run_reference():
        return torch.nn.functional.linear(x, w_deq, b)

    def check():
        poison_allocator(M * N * 4, DEVICE)
        return max_error(run_triton(), D.fp8_block_linear_reference(x, w, scales, block, b), FP8_TOL[dtype])

    nbytes = N * Kd + scales.numel() * 4 + (M * Kd + M * N) * x.element_size()
    return run_triton, run_reference, check, nbytes, 2 * M * N * Kd


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
