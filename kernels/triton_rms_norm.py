"""Triton twin of :func:`reference.rms_norm`: RMSNorm fused with the residual add.

One program per row. The sum ``x + residual`` is rounded to its dtype before the norm reads
it, and the normalized row is rounded to that dtype before the weight multiplies it, so the
result matches the reference's casts (fp32 inside, like transformers' LlamaRMSNorm).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, new_res_ptr,
    stride_x, stride_r, stride_o, stride_n,
    hidden, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        summed = (x + r).to(new_res_ptr.dtype.element_ty)
        tl.store(new_res_ptr + row * stride_n + offs, summed, mask=mask)
        x = summed.to(tl.float32)
    var = tl.sum(x * x, 0) / hidden
    normed = (x * tl.rsqrt(var + eps)).to(new_res_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_launch(hidden: int) -> dict[str, int]:
    """The kernel's row tile (``block``, the row padded to a power of two) and ``num_warps``
    (one per 512 numbers, 1 to 16); ``benchmarks/gpu_compile.py`` compiles what this returns."""
    block = triton.next_power_of_2(hidden)
    return dict(block=block, num_warps=min(16, max(1, block // 512)))


def _rows(t: torch.Tensor, hidden: int) -> torch.Tensor:
    """``t`` as [rows, hidden] with a unit stride along hidden (a view where possible)."""
    t2 = t.reshape(-1, hidden)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
    *, num_warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of :func:`reference.rms_norm`: returns ``(normed, new_residual)``;
    ``new_residual`` is ``x`` itself when there is no residual, a new tensor otherwise."""
    hidden = x.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(f"weight: expected shape ({hidden},), got {tuple(weight.shape)}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual: expected shape {tuple(x.shape)}, got {tuple(residual.shape)}")
    res_dtype = x.dtype if residual is None else torch.result_type(x, residual)
    out_dtype = torch.result_type(weight, torch.empty((), dtype=res_dtype))
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    new_res = x if residual is None else torch.empty(x.shape, dtype=res_dtype, device=x.device)
    if x.numel() == 0:
        return out, new_res
    x2 = _rows(x, hidden)
    r2 = x2 if residual is None else _rows(residual, hidden)
    o2 = out.view(-1, hidden)
    n2 = x2 if residual is None else new_res.view(-1, hidden)  # without a residual: only its dtype is read
    launch = rms_norm_launch(hidden)
    block = launch["block"]
    if num_warps is None:
        num_warps = launch["num_warps"]
    _rms_norm_kernel[(x2.shape[0],)](
        x2, r2, weight, o2, n2,
        x2.stride(0), r2.stride(0), o2.stride(0), n2.stride(0),
        hidden, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=num_warps,
    )
    return out, new_res
