"""Triton twin of :func:`reference_mla.mla_decode_attention`: MLA decode over the paged latent cache.

Absorbed form (see :mod:`kvbatch.kernels.reference_mla`): every head attends over one shared
row ``[c_kv ; k_pe]`` per token, ``score = q_latent . c_kv + q_pe . k_pe`` and the value is
``c_kv`` itself, so the output stays in latent space ``[B, Hq, C]``.

Split over the context like :func:`triton_attention.paged_decode_attention` ("flash
decoding"): program ``(b, head block, partition)`` reads ``partition_size`` cache rows of
sequence ``b`` through its block table once for ``block_h`` query heads (the heads are the rows
of the ``tl.dot``s), with an fp32 online softmax. With more than one partition the partial
results are merged by the same kernel the paged decode attention uses.

Numerics as there: ``q`` is rounded to the cache dtype first; scores, softmax and accumulators
are fp32; 16-bit caches feed ``tl.dot`` in their own dtype on a GPU; fp32 caches use
``input_precision="ieee"``; under the interpreter everything is fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvbatch.kernels.triton_attention import (_LOG2E, _NEG_BIG, INTERPRETED, _merge_partitions, _numerics,
                                              _partitions, block_d)

MLA_PARTITION_SIZE = 1024  # cache rows per decode program when the context is split


def mla_decode_tiles(kv_lora_rank: int, rope_dim: int, *, interpreted: bool = INTERPRETED) -> dict[str, int]:
    """The MLA decode kernel's tile and launch (the launcher's choice; ``benchmarks/gpu_compile.py``
    compiles what it returns): ``block_c``/``block_r`` (latent and rope widths), ``block_h``
    (query heads per program), ``block_n`` (cache rows per step; 16 above a 512-wide latent),
    ``num_warps``, ``num_stages``."""
    bc = block_d(kv_lora_rank)
    return dict(block_c=bc, block_r=block_d(rope_dim) if rope_dim else 16, block_h=16,
                block_n=16 if interpreted else (32 if bc <= 512 else 16), num_warps=4, num_stages=2)


@triton.jit
def _mla_decode_kernel(
    q_lat_ptr, q_pe_ptr, kv_ptr, block_tables_ptr, context_lens_ptr,
    out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr,
    scale_log2e,
    stride_qlb, stride_qlh, stride_qlc,
    stride_qpb, stride_qph, stride_qpr,
    stride_kvb, stride_kvs, stride_kvc,
    stride_btb, stride_btn,
    stride_ob, stride_oh, stride_oc,
    num_partitions, num_heads,
    C: tl.constexpr, R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, PARTITION_SIZE: tl.constexpr,
    SPLIT: tl.constexpr, COMPUTE_F32: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    part = tl.program_id(2)
    ctx = tl.load(context_lens_ptr + b).to(tl.int32)
    start = part * PARTITION_SIZE
    if SPLIT:
        end = tl.minimum(start + PARTITION_SIZE, ctx)
    else:
        end = ctx

    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = heads < num_heads
    offs_c = tl.arange(0, BLOCK_C)
    mask_c = offs_c < C
    kv_dtype = kv_ptr.dtype.element_ty
    q_lat = tl.load(q_lat_ptr + b * stride_qlb + heads[:, None] * stride_qlh + offs_c[None, :] * stride_qlc,
                    mask=mask_h[:, None] & mask_c[None, :], other=0.0).to(kv_dtype)
    if R > 0:
        offs_r = tl.arange(0, BLOCK_R)
        mask_r = offs_r < R
        q_pe = tl.load(q_pe_ptr + b * stride_qpb + heads[:, None] * stride_qph + offs_r[None, :] * stride_qpr,
                       mask=mask_h[:, None] & mask_r[None, :], other=0.0).to(kv_dtype)
    if COMPUTE_F32:
        q_lat = q_lat.to(tl.float32)
        if R > 0:
            q_pe = q_pe.to(tl.float32)

    m_i = tl.full([BLOCK_H], _NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_C], tl.float32)
    bt_row = block_tables_ptr + b * stride_btb
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        blk = tl.load(bt_row + (offs_n // BLOCK_SIZE) * stride_btn, mask=mask_n, other=0).to(tl.int64)
        rows = kv_ptr + blk * stride_kvb + (offs_n % BLOCK_SIZE) * stride_kvs  # [BLOCK_N] row starts
        c = tl.load(rows[:, None] + offs_c[None, :] * stride_kvc, mask=mask_n[:, None] & mask_c[None, :], other=0.0)
        if COMPUTE_F32:
            c = c.to(tl.float32)
        qk = tl.dot(q_lat, tl.trans(c), input_precision=DOT_PRECISION)
        if R > 0:
            pe = tl.load(rows[:, None] + (C + offs_r)[None, :] * stride_kvc,
                         mask=mask_n[:, None] & mask_r[None, :], other=0.0)
            if COMPUTE_F32:
                pe = pe.to(tl.float32)
            qk = tl.dot(q_pe, tl.trans(pe), qk, input_precision=DOT_PRECISION)
        qk = tl.where(mask_n[None, :], qk * scale_log2e, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c, input_precision=DOT_PRECISION)
        m_i = m_new

    if SPLIT:
        # The layout _paged_decode_merge_kernel reads: row (b, head, partition) of width C.
        row = (b * num_heads + heads) * num_partitions + part
        tl.store(part_acc_ptr + row[:, None] * C + offs_c[None, :], acc, mask=mask_h[:, None] & mask_c[None, :])
        tl.store(part_max_ptr + row, m_i, mask=mask_h)
        tl.store(part_sum_ptr + row, l_i, mask=mask_h)
    else:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # an empty context gives zeros
        tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_c[None, :] * stride_oc,
                 out.to(out_ptr.dtype.element_ty), mask=mask_h[:, None] & mask_c[None, :])


def mla_decode_attention(
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    max_context_len: int | None = None,
    partition_size: int = MLA_PARTITION_SIZE,
    block_h: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Triton twin of :func:`reference_mla.mla_decode_attention` (same arguments and result;
    the reference's ``workspace`` is not needed).

    ``max_context_len`` (the longest context) sizes the grid; without it the block-table
    capacity ``block_tables.shape[1] * block_size`` does (no host sync either way; partitions
    past a sequence's end do nothing). ``partition_size`` keys per program (rounded up to a
    multiple of ``block_n``); one partition skips the merge kernel.
    """
    if kv_cache.dim() != 4 or kv_cache.shape[2] != 1:
        raise ValueError(f"kv_cache: expected [num_blocks, block_size, 1, C + R], got {tuple(kv_cache.shape)}")
    B, Hq, C = q_latent.shape
    R = q_pe.shape[-1]
    if q_pe.shape[:2] != (B, Hq) or C + R != kv_cache.shape[-1]:
        raise ValueError(f"q_latent {tuple(q_latent.shape)} and q_pe {tuple(q_pe.shape)} do not fit a cache row "
                         f"of {kv_cache.shape[-1]}")
    out = torch.empty((B, Hq, C), dtype=q_latent.dtype, device=q_latent.device)
    block_size = kv_cache.shape[1]
    if max_context_len is None:
        max_context_len = block_tables.shape[1] * block_size
    if B == 0 or Hq == 0 or C == 0:
        return out
    if max_context_len == 0:
        return out.zero_()
    compute_f32, precision = _numerics(kv_cache.dtype)
    tiles = mla_decode_tiles(C, R)
    block_c, block_r = tiles["block_c"], tiles["block_r"]
    block_h = block_h or tiles["block_h"]
    block_n = block_n or tiles["block_n"]
    partition_size, num_partitions, split, (part_acc, part_max, part_sum) = _partitions(
        out, max_context_len, partition_size, block_n, C)
    kv = kv_cache[:, :, 0]  # [num_blocks, block_size, C + R], a view
    _mla_decode_kernel[(B, triton.cdiv(Hq, block_h), num_partitions)](
        q_latent, q_pe, kv, block_tables, context_lens,
        out, part_acc, part_max, part_sum,
        scale * _LOG2E,
        *q_latent.stride(), *q_pe.stride(), *kv.stride(), *block_tables.stride(), *out.stride(),
        num_partitions, Hq,
        C=C, R=R, BLOCK_C=block_c, BLOCK_R=block_r,
        BLOCK_H=block_h, BLOCK_SIZE=block_size, BLOCK_N=block_n, PARTITION_SIZE=partition_size,
        SPLIT=split, COMPUTE_F32=compute_f32, DOT_PRECISION=precision,
        num_warps=num_warps or tiles["num_warps"], num_stages=num_stages or tiles["num_stages"],
    )
    if split:
        _merge_partitions(part_acc, part_max, part_sum, context_lens, out, partition_size, block_c)
    return out
