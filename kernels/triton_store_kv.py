"""Triton twin of :func:`reference.store_kv` ("reshape and cache").

One program per new token copies its K and V rows ([Hkv, D]) into the cache slot that
``slot_mapping`` names, casting to the cache dtype. A negative slot is skipped (a padding
token), which the reference would reject.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_kcb, stride_kcs, stride_kch, stride_kcd,
    stride_vcb, stride_vcs, stride_vch, stride_vcd,
    num_heads, head_dim, block_size,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    blk = slot // block_size
    off = slot % block_size
    offs_h = tl.arange(0, BLOCK_H)[:, None]
    offs_d = tl.arange(0, BLOCK_D)[None, :]
    mask = (offs_h < num_heads) & (offs_d < head_dim) & (slot >= 0)
    k = tl.load(k_ptr + t * stride_kt + offs_h * stride_kh + offs_d * stride_kd, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + offs_h * stride_vh + offs_d * stride_vd, mask=mask)
    tl.store(k_cache_ptr + blk * stride_kcb + off * stride_kcs + offs_h * stride_kch + offs_d * stride_kcd,
             k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + blk * stride_vcb + off * stride_vcs + offs_h * stride_vch + offs_d * stride_vcd,
             v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv_blocks(num_heads: int, head_dim: int) -> dict[str, int]:
    """The kernel's [heads, head dim] tile for one token: ``BLOCK_H``, ``BLOCK_D`` (powers of two)."""
    return dict(BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_D=triton.next_power_of_2(head_dim))


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *, num_warps: int = 4,
) -> None:
    """Triton twin of :func:`reference.store_kv`: writes ``k``/``v`` ([T, Hkv, D]) into the
    ``[num_blocks, block_size, Hkv, D]`` caches at ``slot_mapping`` ([T]), in place."""
    if k.dim() != 3 or k.shape != v.shape or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"k, v: expected [T, Hkv, D] each and 4-d caches, got {tuple(k.shape)}, "
                         f"{tuple(v.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    T, Hkv, D = k.shape
    if k_cache.shape[2:] != (Hkv, D):
        raise ValueError(f"caches hold [{k_cache.shape[2]}, {k_cache.shape[3]}] per slot, k has [{Hkv}, {D}]")
    if slot_mapping.shape != (T,):
        raise ValueError(f"slot_mapping: expected shape ({T},), got {tuple(slot_mapping.shape)}")
    if T == 0:
        return
    _store_kv_kernel[(T,)](
        k, v, k_cache, v_cache, slot_mapping,
        *k.stride(), *v.stride(), *k_cache.stride(), *v_cache.stride(),
        Hkv, D, k_cache.shape[1],
        **store_kv_blocks(Hkv, D), num_warps=num_warps,
    )
