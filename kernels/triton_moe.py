"""Triton twin of :func:`reference.fused_moe`: routed experts as two grouped GEMMs.

Three steps, no host synchronisation (the grid is sized from an upper bound):

1. :func:`moe_align` (torch ops): the (token, choice) pairs ``p = t * k + j`` are sorted by
   expert and each expert's run is padded to a multiple of ``block_m``, so every block of
   ``block_m`` sorted rows belongs to one expert (``block_expert``; -1 past the end). Pairs
   whose id is outside ``0..E-1`` are dropped; experts without pairs get no block.
2. ``_moe_gate_up_kernel``: program ``(row block, column block of I)`` gathers its rows of
   ``x`` and multiplies them by that expert's gate and up rows at once (two accumulators over
   one pass of ``x``), applying ``silu(gate) * up`` in the epilogue; the result goes to
   ``inter[p]``, in ``x.dtype``. gpt-oss (``HAS_BIAS``, ``SWIGLU``, both constexpr so the plain
   launch compiles as before): ``gate_up_bias[e]`` is added to both accumulators and the
   epilogue is the clamped SwiGLU ``(up.clamp(-limit, limit) + 1) * g * sigmoid(alpha * g)``,
   ``g = gate.clamp(max=limit)`` (``alpha``, ``limit`` runtime fp32 scalars).
3. ``_moe_down_kernel``: ``inter`` rows times the expert's ``w_down`` (plus ``down_bias[e]``
   with ``HAS_BIAS``), scaled by the pair's
   routing weight in fp32, written to ``y[p]`` (fp32); ``_moe_sum_kernel`` adds each token's
   ``k`` rows (skipping dropped pairs) and rounds once to ``x.dtype``.

FP8 experts (``FP8_W``, constexpr like the gpt-oss parts, so the other launches compile as before):
the weights stay float8_e4m3fn with an fp32 ``scale_inv`` per ``[bn, bk]`` block of each expert's
matrix (``GROUP_N`` x ``GROUP_K``); both GEMMs load each fp8 tile and dequantize it in registers with
``triton_fp8_gemm._fp8_tile`` (the FP8 GEMM's own code: scale, then round to ``x.dtype``, as the CPU
loader dequantizes), so the tiles, numerics and dot are those of ``x.dtype`` weights.

MXFP4 experts (``MXFP4_W``, constexpr too; gpt-oss's, with ``HAS_BIAS`` and ``SWIGLU``): the weights
are uint8 blocks ``[E, N, K / 32, 16]``, two FP4 E2M1 codes a byte (low nibble first) along K, and a
uint8 E8M0 scale per 32 elements along K (``[E, N, K / 32]``); :func:`_mxfp4_tile` loads each tile's
bytes, splits and interleaves the nibbles, maps the codes to their values and multiplies by
``2 ** (scale - 127)`` in fp32 (exact: a power of two), then rounds the tile to ``x.dtype`` (the
values the CPU loader's ``mxfp4.dequantize_mxfp4`` and cast give, up to products below fp32's normal
range, which a GPU may flush to zero), and the tiles are multiplied as above.

Numerics: fp32 accumulation; bf16/fp16 weights feed ``tl.dot`` in their own dtype on a GPU,
fp32 weights use ``input_precision="ieee"``. Under the interpreter everything is fp32 (its bf16
arithmetic is wrong). The reference rounds ``gate_up`` and the down output to ``x.dtype``
before the fp32 weighting; this kernel rounds only ``inter``, so 16-bit results differ by a
few units in the last place.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvbatch.kernels.triton_attention import INTERPRETED, _numerics
from kvbatch.kernels.triton_fp8_gemm import _fp8_tile


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort the (token, choice) pairs by expert, padded per expert to ``block_m`` rows.

    Returns ``(sorted_pairs, block_expert)``: ``sorted_pairs`` ``[num_blocks * block_m]`` int32
    holds pair indices ``t * k + j`` (``T * k`` marks padding), ``block_expert``
    ``[num_blocks]`` int32 the expert of each block (-1 for blocks past the last expert's).
    ``num_blocks`` is an upper bound known without reading the ids, so nothing waits for the GPU.
    """
    device = topk_ids.device
    flat = topk_ids.reshape(-1)
    P, E, BM = flat.numel(), num_experts, block_m
    num_blocks = (P + min(E, P) * (BM - 1)) // BM
    valid = (flat >= 0) & (flat < E)
    key = torch.where(valid, flat, E)  # dropped pairs sort last, into bucket E
    counts = torch.zeros(E + 1, dtype=torch.long, device=device).scatter_add_(0, key, torch.ones_like(key))
    padded = (counts[:E] + BM - 1) // BM * BM
    ends = torch.cumsum(padded, 0)
    dump = num_blocks * BM  # where bucket E's pairs are written, then cut off
    # [E + 1]; torch.full rather than torch.tensor: no host-to-device copy.
    run_starts = torch.cat([ends - padded, torch.full((1,), dump, dtype=torch.long, device=device)])
    count_starts = torch.cumsum(counts, 0) - counts  # first position of each bucket after sorting
    order = torch.argsort(key, stable=True)
    key_sorted = key.index_select(0, order)
    rank = torch.arange(P, device=device) - count_starts.index_select(0, key_sorted)
    dest = torch.where(key_sorted < E, run_starts.index_select(0, key_sorted) + rank, dump)
    sorted_pairs = torch.full((dump + 1,), P, dtype=torch.int32, device=device)
    sorted_pairs.scatter_(0, dest, order.to(torch.int32))
    block_starts = torch.arange(num_blocks, device=device) * BM
    block_expert = torch.searchsorted(ends, block_starts, right=True)
    block_expert = torch.where(block_expert < E, block_expert, -1).to(torch.int32)
    return sorted_pairs[:dump], block_expert


@triton.jit
def _mxfp4_tile(w_e, s_e, rows, mask_n, k0, K, stride_wn, stride_wk, stride_sn, stride_sk,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Rows ``rows`` of an MXFP4 matrix ``[N, K]`` (bytes at ``w_e``, K offset ``k0``) as the fp32
    ``[BLOCK_K, BLOCK_N]`` tile of its transpose: each code's E2M1 value times its group's
    ``2 ** (scale - 127)`` (scales at ``s_e``), as :func:`kvbatch.engine.models.mxfp4.dequantize_mxfp4`."""
    tl.static_assert(BLOCK_K % 32 == 0, "MXFP4 tiles hold whole groups of 32 along K")
    offs_b = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    packed = tl.load(w_e + rows[:, None] * stride_wn + offs_b[None, :] * stride_wk,
                     mask=mask_n[:, None] & (offs_b[None, :] < K // 2), other=0)
    # [BLOCK_N, BLOCK_K]: element 2j of the tile row is byte j's low nibble, 2j + 1 its high one
    codes = tl.interleave(packed & 0xF, packed >> 4).to(tl.int32)
    mag = codes & 7
    # E2M1: exponent field 0 is 0 or 0.5; else 2 ** (e - 1) * (1 + m / 2), i.e. the fp32 whose exponent
    # field is e + 126 and whose top mantissa bit is m: (mag << 22) + (126 << 23)
    v = tl.where(mag < 2, mag.to(tl.float32) * 0.5, ((mag << 22) + (126 << 23)).to(tl.float32, bitcast=True))
    v = tl.where(codes >= 8, -v, v)
    offs_g = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    e8 = tl.load(s_e + rows[:, None] * stride_sn + offs_g[None, :] * stride_sk,
                 mask=mask_n[:, None] & (offs_g[None, :] < K // 32), other=127).to(tl.int32)
    # 2 ** (e8 - 127) as fp32 bits: the exponent field, or for e8 = 0 the subnormal 2 ** -127
    scale = tl.where(e8 == 0, 0x400000, e8 << 23).to(tl.float32, bitcast=True)
    scale = tl.reshape(tl.broadcast_to(scale[:, :, None], (BLOCK_N, BLOCK_K // 32, 32)), (BLOCK_N, BLOCK_K))
    return tl.trans(v * scale)


@triton.jit
def _moe_gate_up_kernel(
    x_ptr, w_ptr, s_ptr, bias_ptr, sorted_pairs_ptr, block_expert_ptr, inter_ptr,
    num_pairs, H, I, alpha, limit,
    stride_xt, stride_xh,
    stride_we, stride_wn, stride_wh,
    stride_se, stride_sn, stride_sk,
    stride_be, stride_bn,
    stride_ip, stride_ii,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    COMPUTE_F32: tl.constexpr, DOT_PRECISION: tl.constexpr, HAS_BIAS: tl.constexpr, SWIGLU: tl.constexpr,
    FP8_W: tl.constexpr, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, SCALE_PER_COLUMN: tl.constexpr,
    MXFP4_W: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if e < 0:  # a block past the last expert's run (the grid is an upper bound)
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pairs_ptr + offs_m).to(tl.int64)
    mask_m = pairs < num_pairs
    tokens = pairs // TOP_K
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < I
    offs_k = tl.arange(0, BLOCK_K)

    a_ptrs = x_ptr + tokens[:, None] * stride_xt + offs_k[None, :] * stride_xh
    # [BLOCK_K, BLOCK_N] views of the expert's gate rows and up rows (w is [E, 2I, H]).
    g_ptrs = w_ptr + e * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wh
    u_ptrs = g_ptrs + I * stride_wn
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, H, BLOCK_K):
        mask_k = offs_k < H - k0
        a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        if FP8_W:  # the fp8 tiles dequantized, rounded to x's dtype as the CPU loader rounds them
            s_e = s_ptr + e * stride_se
            bg = _fp8_tile(g_ptrs, s_e, (offs_n // GROUP_N) * stride_sn, k0, offs_k, mask_k, mask_n, stride_sk,
                           GROUP_K, SCALE_PER_COLUMN).to(x_ptr.dtype.element_ty)
            bu = _fp8_tile(u_ptrs, s_e, ((offs_n + I) // GROUP_N) * stride_sn, k0, offs_k, mask_k, mask_n,
                           stride_sk, GROUP_K, SCALE_PER_COLUMN).to(x_ptr.dtype.element_ty)
        elif MXFP4_W:  # likewise the MXFP4 tiles (gpt-oss): gate rows n, up rows I + n of the expert's blocks
            w_e, s_e = w_ptr + e * stride_we, s_ptr + e * stride_se
            bg = _mxfp4_tile(w_e, s_e, offs_n, mask_n, k0, H, stride_wn, stride_wh, stride_sn, stride_sk, BLOCK_N,
                             BLOCK_K).to(x_ptr.dtype.element_ty)
            bu = _mxfp4_tile(w_e, s_e, offs_n + I, mask_n, k0, H, stride_wn, stride_wh, stride_sn, stride_sk,
                             BLOCK_N, BLOCK_K).to(x_ptr.dtype.element_ty)
        else:
            b_mask = mask_k[:, None] & mask_n[None, :]
            bg = tl.load(g_ptrs, mask=b_mask, other=0.0)
            bu = tl.load(u_ptrs, mask=b_mask, other=0.0)
        if COMPUTE_F32:
            a = a.to(tl.float32)
            bg = bg.to(tl.float32)
            bu = bu.to(tl.float32)
        else:
            a = a.to(bg.dtype)
        acc_g = tl.dot(a, bg, acc_g, input_precision=DOT_PRECISION)
        acc_u = tl.dot(a, bu, acc_u, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K * stride_xh
        g_ptrs += BLOCK_K * stride_wh
        u_ptrs += BLOCK_K * stride_wh
    if HAS_BIAS:  # gate_up_bias[e]: gate columns, then up columns, like the weight's rows
        b_ptrs = bias_ptr + e * stride_be + offs_n * stride_bn
        acc_g += tl.load(b_ptrs, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        acc_u += tl.load(b_ptrs + I * stride_bn, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    if SWIGLU:  # gpt-oss: gate clamped above only, up both ways, then (up + 1) * gate * sigmoid(alpha * gate)
        g = tl.minimum(acc_g, limit)
        u = tl.minimum(tl.maximum(acc_u, -limit), limit)
        h = (u + 1.0) * (g / (1.0 + tl.exp(-alpha * g)))
    else:
        h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u  # silu(gate) * up
    tl.store(inter_ptr + pairs[:, None] * stride_ip + offs_n[None, :] * stride_ii,
             h.to(inter_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _moe_down_kernel(
    inter_ptr, w_ptr, s_ptr, bias_ptr, sorted_pairs_ptr, block_expert_ptr, weights_ptr, y_ptr,
    num_pairs, H, I,
    stride_ip, stride_ii,
    stride_we, stride_wh, stride_wi,
    stride_se, stride_sn, stride_sk,
    stride_be, stride_bh,
    stride_rt, stride_rk,
    stride_yp, stride_yh,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    COMPUTE_F32: tl.constexpr, DOT_PRECISION: tl.constexpr, HAS_BIAS: tl.constexpr,
    FP8_W: tl.constexpr, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, SCALE_PER_COLUMN: tl.constexpr,
    MXFP4_W: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if e < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pairs_ptr + offs_m).to(tl.int64)
    mask_m = pairs < num_pairs
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < H
    offs_k = tl.arange(0, BLOCK_K)

    a_ptrs = inter_ptr + pairs[:, None] * stride_ip + offs_k[None, :] * stride_ii
    b_ptrs = w_ptr + e * stride_we + offs_n[None, :] * stride_wh + offs_k[:, None] * stride_wi  # w_down[e]^T
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, I, BLOCK_K):
        mask_k = offs_k < I - k0
        a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        if FP8_W:
            b = _fp8_tile(b_ptrs, s_ptr + e * stride_se, (offs_n // GROUP_N) * stride_sn, k0, offs_k, mask_k, mask_n,
                          stride_sk, GROUP_K, SCALE_PER_COLUMN).to(inter_ptr.dtype.element_ty)
        elif MXFP4_W:
            b = _mxfp4_tile(w_ptr + e * stride_we, s_ptr + e * stride_se, offs_n, mask_n, k0, I, stride_wh,
                            stride_wi, stride_sn, stride_sk, BLOCK_N, BLOCK_K).to(inter_ptr.dtype.element_ty)
        else:
            b = tl.load(b_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        if COMPUTE_F32:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        else:
            a = a.to(b.dtype)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K * stride_ii
        b_ptrs += BLOCK_K * stride_wi
    if HAS_BIAS:  # down_bias[e], before the routing weight (the twin's F.linear bias)
        acc += tl.load(bias_ptr + e * stride_be + offs_n * stride_bh, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    t = pairs // TOP_K
    j = pairs % TOP_K
    w = tl.load(weights_ptr + t * stride_rt + j * stride_rk, mask=mask_m, other=0.0).to(tl.float32)
    tl.store(y_ptr + pairs[:, None] * stride_yp + offs_n[None, :] * stride_yh, acc * w[:, None],
             mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _moe_sum_kernel(
    y_ptr, ids_ptr, out_ptr,
    H, E,
    stride_yp, stride_yh, stride_it, stride_ik, stride_ot, stride_oh,
    TOP_K: tl.constexpr, BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = offs < H
    acc = tl.zeros([BLOCK_H], tl.float32)
    for j in range(TOP_K):  # in choice order; a dropped pair's row was never written
        e = tl.load(ids_ptr + t * stride_it + j * stride_ik)
        ok = (e >= 0) & (e < E)
        acc += tl.load(y_ptr + (t * TOP_K + j) * stride_yp + offs * stride_yh, mask=mask & ok, other=0.0)
    tl.store(out_ptr + t * stride_ot + offs * stride_oh, acc.to(out_ptr.dtype.element_ty), mask=mask)


def moe_tiles(num_pairs: int, num_experts: int, elem_bytes: int, *, interpreted: bool = INTERPRETED) -> dict[str, int]:
    """Tile sizes of both GEMMs: small row blocks when each expert sees few rows (decode), bigger
    tiles for prefill; 4-byte weights get fewer pipeline stages to fit shared memory.
    ``benchmarks/gpu_compile.py`` compiles every tile this returns."""
    if interpreted:
        return dict(block_m=16, block_n=32, block_k=32, num_warps=4, num_stages=1)
    rows_per_expert = num_pairs / max(num_experts, 1)
    if rows_per_expert <= 4:
        cfg = dict(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=4)
    elif rows_per_expert <= 64:
        cfg = dict(block_m=32, block_n=64, block_k=64, num_warps=4, num_stages=4)
    else:
        cfg = dict(block_m=64, block_n=128, block_k=64, num_warps=8, num_stages=3)
    if elem_bytes >= 4:
        cfg["num_stages"] = 2
    return cfg


def sum_block_h(hidden: int) -> int:
    """Columns per program of the kernel that adds each token's ``k`` expert rows."""
    return min(1024, max(16, triton.next_power_of_2(hidden)))


def _fp8_launch(w_gate_up: torch.Tensor, w_down: torch.Tensor, scales: tuple[torch.Tensor, torch.Tensor] | None,
                block: tuple[int, int] | None) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int]] | None:
    """(gate/up scales, down scales, block) for an FP8 launch, the scales contiguous (a unit K stride,
    as gpu_compile compiles it); None for plain weights. ValueError where weights, scales and block
    disagree: a wrong scale shape would read other blocks' scales, not fail."""
    fp8 = [str(w.dtype) == "torch.float8_e4m3fn" for w in (w_gate_up, w_down)]
    if scales is None:
        if any(fp8):
            raise ValueError("fused_moe: float8 expert weights need fp8_scales and fp8_block")
        return None
    if not all(fp8) or block is None:
        raise ValueError(f"fused_moe: fp8_scales need float8_e4m3fn weights (got {w_gate_up.dtype}, {w_down.dtype}) "
                         f"and fp8_block (got {block})")
    bn, bk = block
    out = []
    for name, w, s in (("gate_up", w_gate_up, scales[0]), ("down", w_down, scales[1])):
        E, N, K = w.shape
        want = (E, triton.cdiv(N, bn), triton.cdiv(K, bk))
        if tuple(s.shape) != want or s.dtype != torch.float32:
            raise ValueError(f"fused_moe: {name} scales {tuple(s.shape)} {s.dtype} for {tuple(w.shape)} weights in "
                             f"{bn}x{bk} blocks (expected fp32 {want})")
        out.append(s.contiguous())
    return out[0], out[1], (bn, bk)


def _mxfp4_launch(w_gate_up: torch.Tensor, w_down: torch.Tensor, scales: tuple[torch.Tensor, torch.Tensor] | None,
                  fp8_scales: object) -> tuple[torch.Tensor, ...] | None:
    """(gate/up bytes, down bytes, gate/up scales, down scales) for an MXFP4 launch: the uint8 blocks
    ``[E, N, K / 32, 16]`` viewed ``[E, N, K / 2]`` (contiguous along K, as the kernel reads them) and
    the scales ``[E, N, K / 32]``, contiguous; None for other weights. ValueError where blocks and
    scales disagree (a wrong shape would read other groups' scales, not fail)."""
    if scales is None:
        if torch.uint8 in (w_gate_up.dtype, w_down.dtype):
            raise ValueError("fused_moe: uint8 (MXFP4) expert weights need mxfp4_scales")
        return None
    if fp8_scales is not None:
        raise ValueError("fused_moe: fp8_scales and mxfp4_scales together")
    out = []
    for name, w, s in (("gate_up", w_gate_up, scales[0]), ("down", w_down, scales[1])):
        if (w.dtype != torch.uint8 or s.dtype != torch.uint8 or w.dim() != 4 or w.shape[3] != 16
                or tuple(s.shape) != tuple(w.shape[:3])):
            raise ValueError(f"fused_moe: {name} MXFP4 blocks {tuple(w.shape)} {w.dtype} with scales "
                             f"{tuple(s.shape)} {s.dtype}: expected uint8 [E, N, K / 32, 16] and [E, N, K / 32]")
        if w.stride(3) != 1 or w.stride(2) != 16:  # each row's bytes one run along K (experts may be strided)
            w = w.contiguous()
        out.append(w.as_strided((*w.shape[:2], w.shape[2] * 16), (w.stride(0), w.stride(1), 1), w.storage_offset()))
    return out[0], out[1], scales[0].contiguous(), scales[1].contiguous()


def fused_moe(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    swiglu: tuple[float, float] | None = None,
    *,
    fp8_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    fp8_block: tuple[int, int] | None = None,
    mxfp4_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Triton twin of :func:`reference.fused_moe` (same arguments and result, gpt-oss's expert
    biases and clamped SwiGLU included). ``fp8_scales``: the expert weights are float8_e4m3fn as an
    FP8 checkpoint publishes them, with these fp32 ``scale_inv`` ``[E, ceil(2I / bn), ceil(H / bk)]``
    and ``[E, ceil(H / bn), ceil(I / bk)]`` (each expert's matrix in ``fp8_block`` = ``(bn, bk)``
    blocks); the twin is then :func:`kvbatch.kernels.dispatch.fused_moe_fp8_reference`.
    ``mxfp4_scales``: the expert weights are MXFP4 uint8 blocks ``[E, 2I, H / 32, 16]`` and
    ``[E, H, I / 32, 16]`` with these uint8 E8M0 scales ``[E, 2I, H / 32]`` and ``[E, H, I / 32]``
    (groups of 32 along K); the twin is :func:`kvbatch.kernels.dispatch.fused_moe_mxfp4_reference`.
    The other keyword arguments override the tile configuration (both GEMMs use it; MXFP4 needs
    ``block_k`` a multiple of 32)."""
    mx = _mxfp4_launch(w_gate_up, w_down, mxfp4_scales, fp8_scales)
    unpack = 1  # weight elements per stored element along K
    if mx is not None:
        w_gate_up, w_down, unpack = mx[0], mx[1], 2
    if x.dim() != 2 or w_gate_up.dim() != 3 or w_down.dim() != 3:
        raise ValueError(f"fused_moe: expected x [T, H], w_gate_up [E, 2I, H], w_down [E, H, I]; got "
                         f"{tuple(x.shape)}, {tuple(w_gate_up.shape)}, {tuple(w_down.shape)}")
    T, H = x.shape
    E, two_i, _ = w_gate_up.shape
    I = two_i // 2
    if w_gate_up.shape[2] * unpack != H or tuple(w_down.shape[:2]) != (E, H) or w_down.shape[2] * unpack != I:
        raise ValueError(f"fused_moe: w_gate_up {tuple(w_gate_up.shape)} and w_down {tuple(w_down.shape)} "
                         f"do not fit x [T, {H}]")
    for name, bias, want in (("gate_up_bias", gate_up_bias, (E, 2 * I)), ("down_bias", down_bias, (E, H))):
        if bias is not None and tuple(bias.shape) != want:
            raise ValueError(f"fused_moe: {name} {tuple(bias.shape)}, expected {want}")
    fp8 = _fp8_launch(w_gate_up, w_down, fp8_scales, fp8_block)
    k = topk_ids.shape[1] if topk_ids.dim() == 2 else 0
    out = torch.empty((T, H), dtype=x.dtype, device=x.device)
    if T == 0 or H == 0:
        return out
    if k == 0 or E == 0 or I == 0:
        return out.zero_()
    # FP8/MXFP4 experts: tiled and multiplied as the activation dtype (the tiles are dequantized to it)
    quantized = fp8 is not None or mx is not None
    cfg = moe_tiles(T * k, E, x.element_size() if quantized else w_gate_up.element_size())
    for name, value in (("block_m", block_m), ("block_n", block_n), ("block_k", block_k),
                        ("num_warps", num_warps), ("num_stages", num_stages)):
        if value is not None:
            cfg[name] = value
    if mx is not None and cfg["block_k"] % 32:
        raise ValueError(f"fused_moe: MXFP4 experts need block_k a multiple of 32 (got {cfg['block_k']})")
    BM = cfg["block_m"]
    compute_f32, precision = _numerics(x.dtype if quantized else w_gate_up.dtype)
    launch = dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])

    P = T * k
    sorted_pairs, block_expert = moe_align(topk_ids, E, BM)
    num_blocks = block_expert.shape[0]
    inter = torch.empty((P, I), dtype=x.dtype, device=x.device)
    # Without a bias the kernels get ``inter`` as a stand-in pointer (never read: HAS_BIAS=False), with
    # strides (0, 1) so the plain launch specializes as it did before the bias arguments existed.
    gu_bias, gu_strides = (inter, (0, 1)) if gate_up_bias is None else (gate_up_bias, gate_up_bias.stride())
    dn_bias, dn_strides = (inter, (0, 1)) if down_bias is None else (down_bias, down_bias.stride())
    alpha, limit = (1.0, 0.0) if swiglu is None else (float(swiglu[0]), float(swiglu[1]))
    # Plain weights: ``inter`` stands in for the scales (never read: FP8_W=False), strides (0, 0, 1) and
    # blocks of 1, fixed, so the plain launch specializes one way whatever the FP8 arguments would be.
    # MXFP4 experts: their E8M0 scales in the same place, the FP8 constexprs at their plain values.
    gu_s = fp8[0] if fp8 is not None else mx[2] if mx is not None else None
    dn_s = fp8[1] if fp8 is not None else mx[3] if mx is not None else None
    gu_scale, gu_s_strides = (inter, (0, 0, 1)) if gu_s is None else (gu_s, gu_s.stride())
    dn_scale, dn_s_strides = (inter, (0, 0, 1)) if dn_s is None else (dn_s, dn_s.stride())
    bn, bk = (1, 1) if fp8 is None else fp8[2]
    quant = {"FP8_W": fp8 is not None, "GROUP_N": bn, "GROUP_K": bk,
             "SCALE_PER_COLUMN": fp8 is not None and bk % cfg["block_k"] == 0, "MXFP4_W": mx is not None}
    _moe_gate_up_kernel[(num_blocks, triton.cdiv(I, cfg["block_n"]))](
        x, w_gate_up, gu_scale, gu_bias, sorted_pairs, block_expert, inter,
        P, H, I, alpha, limit,
        *x.stride(), *w_gate_up.stride(), *gu_s_strides, *gu_strides, *inter.stride(),
        TOP_K=k, BLOCK_M=BM, BLOCK_N=cfg["block_n"], BLOCK_K=cfg["block_k"],
        COMPUTE_F32=compute_f32, DOT_PRECISION=precision, HAS_BIAS=gate_up_bias is not None,
        SWIGLU=swiglu is not None, **quant, **launch,
    )
    y = torch.empty((P, H), dtype=torch.float32, device=x.device)
    _moe_down_kernel[(num_blocks, triton.cdiv(H, cfg["block_n"]))](
        inter, w_down, dn_scale, dn_bias, sorted_pairs, block_expert, topk_weights, y,
        P, H, I,
        *inter.stride(), *w_down.stride(), *dn_s_strides, *dn_strides, *topk_weights.stride(), *y.stride(),
        TOP_K=k, BLOCK_M=BM, BLOCK_N=cfg["block_n"], BLOCK_K=cfg["block_k"],
        COMPUTE_F32=compute_f32, DOT_PRECISION=precision, HAS_BIAS=down_bias is not None, **quant, **launch,
    )
    block_h = sum_block_h(H)
    _moe_sum_kernel[(T, triton.cdiv(H, block_h))](
        y, topk_ids, out, H, E,
        *y.stride(), *topk_ids.stride(), *out.stride(),
        TOP_K=k, BLOCK_H=block_h,
    )
    return out
