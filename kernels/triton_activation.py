"""Triton twin of :func:`reference.silu_and_mul`: the gated MLP's ``silu(gate) * up``.

A 2-D grid: one program per (row, block of ``block`` output columns). The gate and up halves of
a row are read once each, the product written once: one pass over ``3 I`` numbers per row, where
the PyTorch version (``F.silu`` then a multiply) reads and writes an intermediate ``[T, I]``
tensor in between. Arithmetic in fp32; ``silu(gate)`` is rounded to the input dtype before the
multiply and the product rounded again, as the two PyTorch ops round. Offsets are int64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, inter, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


SILU_BLOCK = 1024  # output columns per program at most


def silu_block(inter: int, block: int = SILU_BLOCK) -> int:
    """Output columns per program for rows of ``inter`` outputs (``block`` at most)."""
    return min(block, max(16, triton.next_power_of_2(inter)))


def silu_and_mul(x: torch.Tensor, *, block: int = SILU_BLOCK, num_warps: int = 4) -> torch.Tensor:
    """Triton twin of :func:`reference.silu_and_mul` (same argument and result)."""
    if x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul: the last axis holds gate and up halves, got odd width {x.shape[-1]}")
    inter = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], inter), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    x2 = x.reshape(-1, 2 * inter)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    o2 = out.view(-1, inter)
    block = silu_block(inter, block)
    _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(inter, block))](
        x2, o2, inter, x2.stride(0), o2.stride(0), BLOCK=block, num_warps=num_warps)
    return out
