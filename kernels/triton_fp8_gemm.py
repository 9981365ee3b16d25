"""Triton twin of :func:`kvbatch.kernels.dispatch.fp8_block_linear_reference`: ``y = x @ dequant(W)^T
(+ b)`` for an FP8 block-scaled weight as DeepSeek-V3 and Qwen3-*-FP8 publish it, the weight kept in
float8 on the GPU (a byte per value: half of bf16's bytes streamed per decode step).

``W`` is float8_e4m3fn ``[N, K]`` with ``scale_inv`` ``[ceil(N / bn), ceil(K / bk)]`` (fp32, one per
``bn x bk`` block; partial blocks at the edges). Program ``(row block, column block)`` walks K in
tiles of ``BLOCK_K``: it loads the fp8 tile of ``W^T`` ``[BLOCK_K, BLOCK_N]``, casts it to fp32,
multiplies each value by its block's scale and rounds the product to the activation dtype in
registers (the CPU loader's dequantization, value for value), then ``tl.dot`` with the ``x`` tile,
accumulating in fp32. No fp8 ``tl.dot``: it needs K tiles that are multiples of 32 on sm_90 and the
interpreter has none, and the CPU path it must match dequantizes before multiplying.

Scales: when ``BLOCK_K`` divides ``bk`` (the 128 x 128 blocks of every published checkpoint) a K
tile lies inside one column of blocks and the scales are one ``[BLOCK_N]`` vector per tile
(``SCALE_PER_COLUMN``); other block sizes gather a scale per element.

Numerics: bf16/fp16 activations feed ``tl.dot`` in their own dtype with the dequantized tile rounded
to it; fp32 activations use ``input_precision="ieee"``. Under the interpreter everything is fp32
(its bf16 arithmetic is wrong), the dequantized tile still rounded to the activation dtype first.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvbatch.kernels.triton_attention import INTERPRETED, _numerics


@triton.jit
def _fp8_tile(w_ptrs, s_ptr, s_rows, k0, offs_k, mask_k, mask_n, stride_sk,
              GROUP_K: tl.constexpr, SCALE_PER_COLUMN: tl.constexpr):
    """The fp8 tile at ``w_ptrs`` ([BLOCK_K, BLOCK_N] of ``W^T``, K offset ``k0``) in fp32, each value
    times its block's scale: ``s_ptr + s_rows`` is each column's row of scales. Shared with the MoE
    kernels' FP8 experts (``triton_moe.py``), so both dequantize value for value as the loader does."""
    w = tl.load(w_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0).to(tl.float32)
    if SCALE_PER_COLUMN:  # the whole K tile in one column of blocks
        s = tl.load(s_ptr + s_rows + (k0 // GROUP_K) * stride_sk, mask=mask_n, other=0.0)
        w = w * s[None, :]
    else:
        s = tl.load(s_ptr + s_rows[None, :] + ((k0 + offs_k[:, None]) // GROUP_K) * stride_sk,
                    mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        w = w * s
    return w


@triton.jit
def _fp8_block_gemm_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, y_ptr,
    M, N, K,
    stride_xm, stride_xk,
    stride_wn, stride_wk,
    stride_sn, stride_sk,
    stride_ym, stride_yn,
    GROUP_N: tl.constexpr, GROUP_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SCALE_PER_COLUMN: tl.constexpr, HAS_BIAS: tl.constexpr,
    COMPUTE_F32: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :] * stride_xk
    # [BLOCK_K, BLOCK_N]: W^T's tile (W is [N, K])
    w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None] * stride_wk
    s_rows = (offs_n // GROUP_N) * stride_sn  # each column's row of scales
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        mask_k = offs_k < K - k0
        a = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w = _fp8_tile(w_ptrs, s_ptr, s_rows, k0, offs_k, mask_k, mask_n, stride_sk, GROUP_K, SCALE_PER_COLUMN)
        w = w.to(x_ptr.dtype.element_ty)  # the dequantized weight, rounded as the CPU loader rounds it
        if COMPUTE_F32:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :] * stride_yn,
             acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


# Rows per launch above which the prefill tile is used (decode steps and small batches below).
FP8_SMALL_M = 16
FP8_MEDIUM_M = 64


def fp8_gemm_tiles(rows: int, block: tuple[int, int], elem_bytes: int, *,
                   interpreted: bool = INTERPRETED) -> dict[str, int]:
    """The tile and launch for ``rows`` activation rows against a weight in ``block`` (bn, bk)
    blocks. 16-bit activations: decode and small batches take 16 rows and 64 columns per program
    over 128-deep K tiles (many programs: the weight is what streams), up to 64 rows 64 x 64, prefill
    128 x 128 over 32-deep tiles in 8 warps and 4 stages. fp32 activations (their dots on the FMA
    units) 16 x 32, then 32 x 32, over 32-deep tiles. Each is the largest tile of its kind that the
    sm_90 compilation (``benchmarks/gpu_compile.py``) showed without register spills (128 x 128 x 64
    and 64 x 64 x 128 fp32 spilled). ``block_k`` is halved until it divides ``bk`` (one scale per
    column of a tile) while it stays >= 16."""
    if interpreted:
        cfg = dict(block_m=16, block_n=32, block_k=32, num_warps=4, num_stages=1)
    elif elem_bytes >= 4:
        cfg = dict(block_m=16 if rows <= FP8_SMALL_M else 32, block_n=32, block_k=32, num_warps=4, num_stages=2)
    elif rows <= FP8_SMALL_M:
        cfg = dict(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=4)
    elif rows <= FP8_MEDIUM_M:
        cfg = dict(block_m=64, block_n=64, block_k=128, num_warps=4, num_stages=3)
    else:
        cfg = dict(block_m=128, block_n=128, block_k=32, num_warps=8, num_stages=4)
    bk = block[1]
    while bk % cfg["block_k"] and cfg["block_k"] > 16:
        cfg["block_k"] //= 2
    return cfg


def fp8_block_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                     bias: torch.Tensor | None = None, **overrides: int) -> torch.Tensor:
    """Triton twin of :func:`~kvbatch.kernels.dispatch.fp8_block_linear_reference` (same arguments
    and result: ``[M, N]`` in ``x.dtype``). ``overrides`` replace entries of :func:`fp8_gemm_tiles`."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"fp8_block_linear: expected x [M, K] and weight [N, K]; got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    if str(weight.dtype) != "torch.float8_e4m3fn":
        raise ValueError(f"fp8_block_linear: the weight is {weight.dtype}, not float8_e4m3fn")
    M, K = x.shape
    N = weight.shape[0]
    bn, bk = block
    if tuple(scale_inv.shape) != (triton.cdiv(N, bn), triton.cdiv(K, bk)) or scale_inv.dtype != torch.float32:
        raise ValueError(f"fp8_block_linear: scale_inv {tuple(scale_inv.shape)} {scale_inv.dtype} for a [{N}, {K}] "
                         f"weight in {bn}x{bk} blocks (expected fp32 {(triton.cdiv(N, bn), triton.cdiv(K, bk))})")
    if bias is not None and tuple(bias.shape) != (N,):
        raise ValueError(f"fp8_block_linear: bias {tuple(bias.shape)} for {N} outputs")
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return y
    # unit inner strides in every launch (benchmarks/gpu_compile.py compiles them as constants)
    x = x if x.stride(1) == 1 else x.contiguous()
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    scale_inv = scale_inv.contiguous()
    bias = None if bias is None else bias.to(x.dtype).contiguous()
    cfg = {**fp8_gemm_tiles(M, block, x.element_size()), **overrides}
    compute_f32, precision = _numerics(x.dtype)
    grid = (triton.cdiv(M, cfg["block_m"]), triton.cdiv(N, cfg["block_n"]))
    _fp8_block_gemm_kernel[grid](
        x, weight, scale_inv, bias if bias is not None else y, y,
        M, N, K,
        *x.stride(), *weight.stride(), *scale_inv.stride(), *y.stride(),
        GROUP_N=bn, GROUP_K=bk, BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"], BLOCK_K=cfg["block_k"],
        SCALE_PER_COLUMN=bk % cfg["block_k"] == 0, HAS_BIAS=bias is not None,
        COMPUTE_F32=compute_f32, DOT_PRECISION=precision,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return y
