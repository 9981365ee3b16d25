"""Triton twin of :func:`reference.apply_rotary`, working in place.

Rotate-half (GPT-NeoX / Llama) convention. One program per token rotates all its query and
key heads; ``q`` and ``k`` may be strided views (e.g. slices of a fused qkv projection), and
are updated through those views. The rotation is computed in fp32 and rounded once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate(x_ptr, stride_t, stride_h, stride_d, t, num_heads, cos, sin,
            HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask = (offs_h[:, None] < num_heads) & (offs_d[None, :] < HALF)
    p1 = x_ptr + t * stride_t + offs_h[:, None] * stride_h + offs_d[None, :] * stride_d
    p2 = p1 + HALF * stride_d
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p2, mask=mask, other=0.0).to(tl.float32)
    dtype = x_ptr.dtype.element_ty
    tl.store(p1, (x1 * cos[None, :] - x2 * sin[None, :]).to(dtype), mask=mask)
    tl.store(p2, (x2 * cos[None, :] + x1 * sin[None, :]).to(dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, positions_ptr, cos_sin_ptr,
    stride_qt, stride_qh, stride_qd,
    stride_kt, stride_kh, stride_kd,
    stride_cs, num_q_heads, num_k_heads,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + t).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    row = cos_sin_ptr + pos * stride_cs
    cos = tl.load(row + offs_d, mask=offs_d < HALF, other=0.0).to(tl.float32)
    sin = tl.load(row + HALF + offs_d, mask=offs_d < HALF, other=0.0).to(tl.float32)
    _rotate(q_ptr, stride_qt, stride_qh, stride_qd, t, num_q_heads, cos, sin, HALF, BLOCK_HQ, BLOCK_HALF)
    _rotate(k_ptr, stride_kt, stride_kh, stride_kd, t, num_k_heads, cos, sin, HALF, BLOCK_HK, BLOCK_HALF)


def rotary_blocks(head_dim: int, num_q_heads: int, num_k_heads: int) -> dict[str, int]:
    """The kernel's constexprs for [T, Hq, D] queries and [T, Hkv, D] keys: ``HALF``, and the
    power-of-two tiles ``BLOCK_HALF``, ``BLOCK_HQ``, ``BLOCK_HK``."""
    half = head_dim // 2
    return dict(HALF=half, BLOCK_HALF=triton.next_power_of_2(half), BLOCK_HQ=triton.next_power_of_2(num_q_heads),
                BLOCK_HK=triton.next_power_of_2(num_k_heads))


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
    *, num_warps: int = 4,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of :func:`reference.apply_rotary`; rotates ``q`` and ``k`` in place and
    returns them."""
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q, k: expected [T, Hq, D] and [T, Hkv, D], got {tuple(q.shape)} and {tuple(k.shape)}")
    T, Hq, D = q.shape
    if D % 2 or cos_sin.dim() != 2 or cos_sin.shape[1] != D or cos_sin.stride(1) != 1:
        raise ValueError(f"cos_sin: expected a row-major [max_positions, {D}] table, got {tuple(cos_sin.shape)}")
    if positions.shape != (T,):
        raise ValueError(f"positions: expected shape ({T},), got {tuple(positions.shape)}")
    if T == 0:
        return q, k
    _rotary_kernel[(T,)](
        q, k, positions, cos_sin,
        *q.stride(), *k.stride(), cos_sin.stride(0), Hq, k.shape[1],
        **rotary_blocks(D, Hq, k.shape[1]), num_warps=num_warps,
    )
    return q, k
