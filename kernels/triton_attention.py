"""Triton twins of :func:`reference.paged_decode_attention` and :func:`reference.prefill_attention`.

Both read K/V straight out of the paged cache through the block tables (one block-table
lookup per key, so any block size works) and run an online softmax in fp32.

Decode is split over the context ("flash decoding"): program ``(b, kv_head, part)`` handles
``partition_size`` keys of sequence ``b`` for all the query heads that share ``kv_head`` (the
GQA group becomes the rows of one ``tl.dot``), so each K/V byte is read once per step. When
there is more than one partition a second, small kernel merges the partial results. The grid is
sized for the longest context the launch may see; a program whose partition starts past its own
sequence's end returns at once, and the merge reads only the partitions below a sequence's
length, so short sequences in a long batch (or in a CUDA graph captured for a longer context)
cost little more than their own keys. ``partition_size`` defaults to
:func:`decode_partition_size` of the longest context, the batch and the KV heads.

Prefill runs one program per (tile of ``block_m`` new tokens, sequence, query head) and stops
at the causal diagonal of the tile.

Both take a sliding ``window`` (0: none; Gemma 3's sliding layers): a query at position p sees
keys ``p - window + 1 .. p`` only, and a program starts reading at the ``block_n`` tile holding
the first key any of its queries sees (a decode partition wholly before the window reads nothing
and leaves an empty partial, which the merge weighs 0).

Both take ``sinks`` (gpt-oss): one logit per query head that joins its softmax's denominator and
contributes no value, ``m = max(max_j s_j, sink)``, ``out = sum_j exp(s_j - m) v_j / (sum_j
exp(s_j - m) + exp(sink - m))`` (:func:`reference.attention_with_sinks`). After the key loop the
sink joins the online softmax's state as one more score with no value (the running maximum and sum
take it, the accumulator is rescaled): once per row, outside the loop, so the loop is the one a call
without sinks runs (starting the loop from the sink instead made sm_90's fp32 split decode spill
272 bytes, against none without sinks). A split decode's partitions run without sinks, and the merge
kernel adds each head's sink to the merged maximum and denominator, once. A row that sees no key
gives zeros.

Numerics: like the reference, ``q`` is rounded to the cache dtype first; scores, softmax and
accumulators are fp32. fp16/bf16 caches feed ``tl.dot`` in their own dtype on a GPU (fp32
accumulate); fp32 caches use ``input_precision="ieee"`` (no tf32). Under the Triton
interpreter everything is computed in fp32, because its bf16 arithmetic is wrong.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_NEG_BIG = tl.constexpr(-1.0e30)  # finite "minus infinity" for running maxima: keeps fully masked rows NaN-free
_LOG2E = 1.4426950408889634
_LOG2E_C = tl.constexpr(_LOG2E)  # the kernels' scores are in log2 units (exp2): sinks are scaled to match


@triton.jit
def _load_kv_tile(bt_row, offs_n, mask_n, offs_d, mask_d, kvh, k_cache_ptr, v_cache_ptr, stride_btn,
                  stride_kb, stride_ks, stride_kh, stride_kd, stride_vb, stride_vs, stride_vh, stride_vd,
                  BLOCK_SIZE: tl.constexpr, COMPUTE_F32: tl.constexpr):
    """K and V of context positions ``offs_n`` (masked by ``mask_n``) for KV head ``kvh``, found
    through the sequence's block-table row: the tile load both attention kernels share."""
    blk = tl.load(bt_row + (offs_n // BLOCK_SIZE) * stride_btn, mask=mask_n, other=0).to(tl.int64)
    tok = offs_n % BLOCK_SIZE
    kv_mask = mask_n[:, None] & mask_d[None, :]
    k = tl.load(
        k_cache_ptr + (blk * stride_kb + tok * stride_ks + kvh * stride_kh)[:, None] + offs_d[None, :] * stride_kd,
        mask=kv_mask, other=0.0,
    )
    v = tl.load(
        v_cache_ptr + (blk * stride_vb + tok * stride_vs + kvh * stride_vh)[:, None] + offs_d[None, :] * stride_vd,
        mask=kv_mask, other=0.0,
    )
    if COMPUTE_F32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return k, v


@triton.jit
def _sink_log2(sink):
    """A sink logit in the kernels' log2 units, held at or above ``_NEG_BIG`` so that a sink of -inf
    (no sink) keeps every maximum finite and the state NaN-free."""
    return tl.maximum(sink.to(tl.float32) * _LOG2E_C, _NEG_BIG)


@triton.jit
def _add_sink(sink, m_i, l_i, acc):
    """The online softmax's state (running max, running sum, accumulator) after one more score, the
    row's sink (``_sink_log2``): it joins the maximum and the sum but adds no value. Applied once,
    after the key loop, so the loop is the one a call without sinks runs."""
    m_new = tl.maximum(m_i, sink)
    alpha = tl.exp2(m_i - m_new)
    return l_i * alpha + tl.exp2(sink - m_new), acc * alpha[:, None]


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr, sinks_ptr,
    out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr,
    scale_log2e,
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_btb, stride_btn,
    stride_ob, stride_oh, stride_od,
    num_partitions, num_q_heads, window,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, PARTITION_SIZE: tl.constexpr,
    SPLIT: tl.constexpr, COMPUTE_F32: tl.constexpr, DOT_PRECISION: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    part = tl.program_id(2)
    ctx = tl.load(context_lens_ptr + b).to(tl.int32)
    start = part * PARTITION_SIZE
    if SPLIT:
        if start >= ctx:  # past this sequence's end: nothing to do (the merge never reads this partition)
            return
        end = tl.minimum(start + PARTITION_SIZE, ctx)
    else:  # one program per (sequence, KV head) covers the whole context
        end = ctx

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kvh * GROUP + offs_g
    mask_g = offs_g < GROUP
    mask_d = offs_d < HEAD_DIM
    kv_dtype = k_cache_ptr.dtype.element_ty

    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
        mask=mask_g[:, None] & mask_d[None, :], other=0.0,
    ).to(kv_dtype)
    if COMPUTE_F32:
        q = q.to(tl.float32)

    m_i = tl.full([GROUP_PAD], _NEG_BIG, tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, BLOCK_D], tl.float32)
    bt_row = block_tables_ptr + b * stride_btb
    first = tl.where(window > 0, tl.maximum(ctx - window, 0), 0)  # the first key the window lets in
    for n0 in range(tl.maximum(start, first // BLOCK_N * BLOCK_N), end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = (offs_n < end) & (offs_n >= first)
        k, v = _load_kv_tile(bt_row, offs_n, mask_n, offs_d, mask_d, kvh, k_cache_ptr, v_cache_ptr, stride_btn,
                             stride_kb, stride_ks, stride_kh, stride_kd, stride_vb, stride_vs, stride_vh, stride_vd,
                             BLOCK_SIZE, COMPUTE_F32)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2e
        qk = tl.where(mask_n[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    if SPLIT:
        # Unnormalized partial results; the merge kernel reads only partitions that hold keys.
        row = (b * num_q_heads + heads) * num_partitions + part
        tl.store(part_acc_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], acc,
                 mask=mask_g[:, None] & mask_d[None, :])
        tl.store(part_max_ptr + row, m_i, mask=mask_g)
        tl.store(part_sum_ptr + row, l_i, mask=mask_g)
    else:
        if HAS_SINKS:  # the whole context is here (split, the merge adds them: once per head, not per partition)
            sink = _sink_log2(tl.load(sinks_ptr + heads, mask=mask_g, other=0.0))
            l_i, acc = _add_sink(sink, m_i, l_i, acc)
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # an empty context gives zeros (with sinks too), like the twin
        tl.store(
            out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :] * stride_od,
            out.to(out_ptr.dtype.element_ty),
            mask=mask_g[:, None] & mask_d[None, :],
        )


@triton.jit
def _paged_decode_merge_kernel(
    part_acc_ptr, part_max_ptr, part_sum_ptr, context_lens_ptr, sinks_ptr, out_ptr,
    stride_ob, stride_oh, stride_od,
    num_partitions, num_q_heads,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PARTITION_SIZE: tl.constexpr, BLOCK_P: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    ctx = tl.load(context_lens_ptr + b).to(tl.int32)
    # Only the partitions holding keys: those past the end returned without writing anything.
    n_parts = tl.minimum(tl.cdiv(ctx, PARTITION_SIZE), num_partitions)
    base = (b * num_q_heads + h) * num_partitions
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM

    m_all = tl.full([BLOCK_P], _NEG_BIG, tl.float32)
    for p0 in range(0, n_parts, BLOCK_P):
        offs_p = p0 + tl.arange(0, BLOCK_P)
        m_all = tl.maximum(m_all, tl.load(part_max_ptr + base + offs_p, mask=offs_p < n_parts, other=_NEG_BIG))
    m_glob = tl.max(m_all, 0)
    if HAS_SINKS:  # the head's sink: one more score of the merged softmax, with no value
        sink = _sink_log2(tl.load(sinks_ptr + h))
        m_glob = tl.maximum(m_glob, sink)

    denom = tl.zeros([BLOCK_P], tl.float32)
    acc = tl.zeros([BLOCK_P, BLOCK_D], tl.float32)
    for p0 in range(0, n_parts, BLOCK_P):
        offs_p = p0 + tl.arange(0, BLOCK_P)
        mask_p = offs_p < n_parts
        m = tl.load(part_max_ptr + base + offs_p, mask=mask_p, other=_NEG_BIG)
        s = tl.load(part_sum_ptr + base + offs_p, mask=mask_p, other=0.0)
        a = tl.load(part_acc_ptr + (base + offs_p)[:, None] * HEAD_DIM + offs_d[None, :],
                    mask=mask_p[:, None] & mask_d[None, :], other=0.0)
        w = tl.where(mask_p, tl.exp2(m - m_glob), 0.0)
        denom += w * s
        acc += w[:, None] * a
    total = tl.sum(denom, 0)
    if HAS_SINKS:
        total += tl.exp2(sink - m_glob)
    out = tl.sum(acc, 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_d * stride_od,
             out.to(out_ptr.dtype.element_ty), mask=mask_d)


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, cu_query_lens_ptr, context_lens_ptr, sinks_ptr, out_ptr,
    scale_log2e,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_btb, stride_btn,
    stride_ot, stride_oh, stride_od,
    window,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    COMPUTE_F32: tl.constexpr, DOT_PRECISION: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    mb = tl.program_id(0)
    s = tl.program_id(1).to(tl.int64)
    h = tl.program_id(2)
    kvh = h // GROUP
    q_start = tl.load(cu_query_lens_ptr + s).to(tl.int64)
    n_new = (tl.load(cu_query_lens_ptr + s + 1) - q_start).to(tl.int32)
    ctx = tl.load(context_lens_ptr + s).to(tl.int32)
    first_pos = ctx - n_new  # position of the chunk's first new token

    offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < n_new
    mask_d = offs_d < HEAD_DIM
    q_pos = first_pos + offs_m
    rows = q_start + offs_m
    kv_dtype = k_cache_ptr.dtype.element_ty

    q = tl.load(
        q_ptr + rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :] * stride_qd,
        mask=mask_m[:, None] & mask_d[None, :], other=0.0,
    ).to(kv_dtype)
    if COMPUTE_F32:
        q = q.to(tl.float32)

    # Keys this tile can see: 0 .. position of its last valid row (none for an idle tile).
    hi = tl.minimum(ctx, first_pos + (mb + 1) * BLOCK_M)
    hi = tl.where(mb * BLOCK_M < n_new, hi, 0)

    m_i = tl.full([BLOCK_M], _NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    bt_row = block_tables_ptr + s * stride_btb
    # under a window, each row sees keys above q_pos - window (-1 without: all of them), and the
    # tile's first row sees the lowest
    below = tl.where(window > 0, q_pos - window, -1)
    lo = tl.where(window > 0, tl.maximum(first_pos + mb * BLOCK_M - window + 1, 0), 0)
    for n0 in range(lo // BLOCK_N * BLOCK_N, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < hi
        k, v = _load_kv_tile(bt_row, offs_n, mask_n, offs_d, mask_d, kvh, k_cache_ptr, v_cache_ptr, stride_btn,
                             stride_kb, stride_ks, stride_kh, stride_kd, stride_vb, stride_vs, stride_vh, stride_vd,
                             BLOCK_SIZE, COMPUTE_F32)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2e
        visible = mask_n[None, :] & (offs_n[None, :] <= q_pos[:, None]) & (offs_n[None, :] > below[:, None])
        qk = tl.where(visible, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    if HAS_SINKS:  # every row of the tile is head h: one sink
        l_i, acc = _add_sink(_sink_log2(tl.load(sinks_ptr + h)), m_i, l_i, acc)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :] * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=mask_m[:, None] & mask_d[None, :],
    )


try:  # which flavour triton.jit produced: decided once, when this module was imported
    from triton.runtime.interpreter import InterpretedFunction as _Interpreted

    INTERPRETED = isinstance(_paged_decode_kernel, _Interpreted)
except ImportError:  # pragma: no cover - a Triton without an interpreter
    INTERPRETED = False


# Launch choices, one function each, so that the launchers and benchmarks/gpu_compile.py (which
# compiles every configuration the engine can launch for sm_90 on a CPU) read the same rule.

# Keys per decode program that decode_partition_size picks from (each is one compiled variant).
DECODE_PARTITION_SIZES = (256, 512, 1024, 2048)
# Programs a decode launch should have to fill a GPU: 4 per SM of an H100 (132 SMs; an H200 has
# as many).
DECODE_TARGET_PROGRAMS = 4 * 132


def decode_partition_size(max_context: int, batch: int = 1, num_kv_heads: int = 1,
                          target_programs: int = DECODE_TARGET_PROGRAMS) -> int:
    """Keys per program of the paged decode kernel for a launch over ``batch`` sequences of up
    to ``max_context`` keys and ``num_kv_heads`` KV heads: the largest of
    :data:`DECODE_PARTITION_SIZES` whose grid, ``batch * num_kv_heads * ceil(max_context /
    size)`` programs, still reaches ``target_programs``, else the smallest. Large partitions
    mean fewer partial results to merge (none when one partition holds the context); small ones
    put more of the GPU to work on few, long sequences. A pure function of its arguments (the
    CUDA graphs and the sm_90 compile enumeration call it with the shapes they launch)."""
    if max_context < 0 or batch < 1 or num_kv_heads < 1 or target_programs < 1:
        raise ValueError(f"decode_partition_size: max_context ({max_context}) must be >= 0 and batch ({batch}), "
                         f"num_kv_heads ({num_kv_heads}), target_programs ({target_programs}) >= 1")
    for size in reversed(DECODE_PARTITION_SIZES):
        if batch * num_kv_heads * triton.cdiv(max(max_context, 1), size) >= target_programs:
            return size
    return DECODE_PARTITION_SIZES[0]


def block_d(width: int) -> int:
    """The tile width covering a row of ``width`` numbers: a power of two, at least 16 (tl.dot's minimum)."""
    return max(16, triton.next_power_of_2(width))


def decode_tiles(head_dim: int, group: int, *, interpreted: bool = INTERPRETED) -> dict[str, int]:
    """The paged decode kernel's tile and launch: ``block_d``, ``group_pad`` (the GQA group as
    ``tl.dot`` rows, at least 16), ``block_n`` (keys per step), ``num_warps``, ``num_stages``.
    Heads wider than 128 take half the keys per step to keep the K/V tiles in shared memory."""
    bd = block_d(head_dim)
    return dict(block_d=bd, group_pad=max(16, triton.next_power_of_2(group)),
                block_n=16 if interpreted else (64 if bd <= 128 else 32), num_warps=4, num_stages=2)


def split_plan(max_context_len: int, partition_size: int, block_n: int) -> tuple[int, int]:
    """(keys per partition, a multiple of ``block_n``; partitions the longest context needs)."""
    partition_size = triton.cdiv(max(partition_size, block_n), block_n) * block_n
    return partition_size, triton.cdiv(max_context_len, partition_size)


def merge_block_p(num_partitions: int) -> int:
    """Partitions the merge kernel combines per step."""
    return min(16, triton.next_power_of_2(num_partitions))


def prefill_tiles(head_dim: int, elem_bytes: int, *, interpreted: bool = INTERPRETED) -> dict[str, int]:
    """The prefill kernel's tile and launch: ``block_d``, ``block_m`` (new tokens per program),
    ``block_n`` (keys per step), ``num_warps``, ``num_stages``.

    Up to 256 wide rows take 64 x 64 (x 32 above 128) tiles in two stages. MLA prefill's
    576-wide latent rows (``block_d`` 1024) needed 256 KiB of shared memory that way (measured by
    ``benchmarks/gpu_compile.py`` for sm_90, bf16), more than an SM's 227 KiB: they take 32 new
    tokens and 16 keys per step in one stage over 8 warps (97 KiB), and fp32 rows (whose dots
    run on the FMA units, through more shared memory) 16 and 16 over 4 warps (192 KiB). The tile
    changes only how the work is cut, not the arithmetic of any one score or output.
    """
    bd = block_d(head_dim)
    if interpreted:
        return dict(block_d=bd, block_m=16, block_n=16, num_warps=4, num_stages=2)
    if bd <= 256:
        return dict(block_d=bd, block_m=64, block_n=64 if bd <= 128 else 32, num_warps=4, num_stages=2)
    if elem_bytes <= 2:
        return dict(block_d=bd, block_m=32, block_n=16, num_warps=8, num_stages=1)
    return dict(block_d=bd, block_m=16, block_n=16, num_warps=4, num_stages=1)


def _numerics(cache_dtype: torch.dtype, *, interpreted: bool = INTERPRETED) -> tuple[bool, str]:
    """(compute in fp32, tl.dot input precision) for a cache dtype."""
    if interpreted or cache_dtype == torch.float32:
        return True, "ieee"
    return False, "tf32"  # unused for 16-bit inputs: the dot runs in the cache dtype


def _check_cache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int]:
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError(
            f"k_cache/v_cache: expected two [num_blocks, block_size, Hkv, D] tensors of one dtype, "
            f"got {tuple(k_cache.shape)} {k_cache.dtype} and {tuple(v_cache.shape)} {v_cache.dtype}"
        )
    if q.dim() != 3 or q.shape[-1] != k_cache.shape[-1]:
        raise ValueError(f"q: expected [N, Hq, {k_cache.shape[-1]}], got {tuple(q.shape)}")
    Hq, Hkv = q.shape[1], k_cache.shape[2]
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"q heads ({Hq}) must be a multiple of the cache's KV heads ({Hkv})")
    return Hq, Hkv, q.shape[-1]


def _sinks(sinks: torch.Tensor | None, num_q_heads: int, dummy: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """(the pointer the kernels take for ``sinks``, whether they read it). Without sinks ``dummy``
    stands in, never read. The engine's sinks are contiguous fp32 already: no copy per call (a
    CUDA graph captures the same buffer)."""
    if sinks is None:
        return dummy, False
    if sinks.shape != (num_q_heads,):
        raise ValueError(f"sinks: expected one logit per query head [{num_q_heads}], got {tuple(sinks.shape)}")
    return sinks.to(torch.float32).contiguous(), True


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    slots: torch.Tensor | None = None,
    *,
    max_context_len: int | None = None,
    partition_size: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    window: int = 0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton twin of :func:`reference.paged_decode_attention` (same arguments and result;
    ``window`` > 0: each sequence's last ``window`` keys only, as the native kernel's window;
    ``sinks`` [Hq] fp32: gpt-oss's sink logits, as the reference's).

    ``slots`` is accepted for signature parity and ignored (keys are looked up through
    ``block_tables`` in the kernel), but its width, the longest context, sizes the grid.
    Otherwise ``max_context_len`` does, or else the block-table capacity
    ``block_tables.shape[1] * block_size``: no host sync either way. Partitions past a
    sequence's end return at once. ``partition_size`` keys per program (rounded up to a
    multiple of ``block_n``; by default :func:`decode_partition_size` of that longest context,
    the batch and the KV heads); one partition skips the merge kernel.
    """
    Hq, Hkv, D = _check_cache(q, k_cache, v_cache)
    if window < 0:
        raise ValueError(f"window must be >= 0, got {window}")
    B = q.shape[0]
    out = torch.empty((B, Hq, D), dtype=q.dtype, device=q.device)
    block_size = k_cache.shape[1]
    if max_context_len is None:
        max_context_len = slots.shape[1] if slots is not None else block_tables.shape[1] * block_size
    if B == 0 or max_context_len == 0:
        return out.zero_()
    compute_f32, precision = _numerics(k_cache.dtype)
    group = Hq // Hkv
    tiles = decode_tiles(D, group)
    block_n = block_n or tiles["block_n"]
    if partition_size is None:
        partition_size = decode_partition_size(max_context_len, B, Hkv)
    partition_size, num_partitions, split, (part_acc, part_max, part_sum) = _partitions(
        out, max_context_len, partition_size, block_n, D)
    sinks, has_sinks = _sinks(sinks, Hq, q)
    _paged_decode_kernel[(B, Hkv, num_partitions)](
        q, k_cache, v_cache, block_tables, context_lens, sinks,
        out, part_acc, part_max, part_sum,
        scale * _LOG2E,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *block_tables.stride(), *out.stride(),
        num_partitions, Hq, window,
        GROUP=group, GROUP_PAD=tiles["group_pad"],
        HEAD_DIM=D, BLOCK_D=tiles["block_d"],
        BLOCK_SIZE=block_size, BLOCK_N=block_n, PARTITION_SIZE=partition_size,
        SPLIT=split, COMPUTE_F32=compute_f32, DOT_PRECISION=precision,
        HAS_SINKS=has_sinks and not split,  # split: the merge adds them, and this kernel is the one without
        num_warps=num_warps or tiles["num_warps"], num_stages=num_stages or tiles["num_stages"],
    )
    if split:
        _merge_partitions(part_acc, part_max, part_sum, context_lens, out, partition_size, tiles["block_d"],
                          sinks if has_sinks else None)
    return out


def _partitions(out: torch.Tensor, max_context_len: int, partition_size: int, block_n: int,
                width: int) -> tuple[int, int, bool, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Split-context decode plan shared by the paged and MLA decode kernels: the partition size
    (a multiple of ``block_n``), how many partitions the longest context needs, whether to split,
    and the fp32 partial results (``out`` itself, untouched, when not splitting). ``out`` is
    [B, H, width]."""
    B, H = out.shape[0], out.shape[1]
    partition_size, num_partitions = split_plan(max_context_len, partition_size, block_n)
    split = num_partitions > 1
    if not split:
        return partition_size, num_partitions, split, (out, out, out)
    part_acc = torch.empty((B, H, num_partitions, width), dtype=torch.float32, device=out.device)
    part_max = torch.empty((B, H, num_partitions), dtype=torch.float32, device=out.device)
    return partition_size, num_partitions, split, (part_acc, part_max, torch.empty_like(part_max))


def _merge_partitions(part_acc: torch.Tensor, part_max: torch.Tensor, part_sum: torch.Tensor,
                      context_lens: torch.Tensor, out: torch.Tensor, partition_size: int, block_d: int,
                      sinks: torch.Tensor | None = None) -> None:
    """Combine the per-partition softmax partials into ``out`` (log-sum-exp merge), with each head's
    sink (fp32 [H], checked by the caller) in the denominator when given."""
    B, H, num_partitions = part_max.shape
    _paged_decode_merge_kernel[(B, H)](
        part_acc, part_max, part_sum, context_lens, part_max if sinks is None else sinks, out,
        *out.stride(), num_partitions, H,
        HEAD_DIM=out.shape[2], BLOCK_D=block_d, PARTITION_SIZE=partition_size,
        BLOCK_P=merge_block_p(num_partitions), HAS_SINKS=sinks is not None,
        num_warps=4,
    )


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_query_lens: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    max_query_len: int | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    window: int = 0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton twin of :func:`reference.prefill_attention` (same arguments and result; ``window``
    > 0: a sliding window, as :func:`reference.plan_prefill`'s; ``sinks`` [Hq] fp32: gpt-oss's
    sink logits, as the reference's).

    ``max_query_len`` (the longest chunk) sizes the grid; without it it is read from
    ``cu_query_lens`` (one host sync, as in the reference).
    """
    Hq, Hkv, D = _check_cache(q, k_cache, v_cache)
    if window < 0:
        raise ValueError(f"window must be >= 0, got {window}")
    T = q.shape[0]
    S = context_lens.shape[0]
    if cu_query_lens.shape[0] != S + 1:
        raise ValueError(f"cu_query_lens: expected {S + 1} offsets for {S} sequences, got {cu_query_lens.shape[0]}")
    out = torch.empty((T, Hq, D), dtype=q.dtype, device=q.device)
    if T == 0 or S == 0:
        return out
    if max_query_len is None:
        max_query_len = int((cu_query_lens[1:] - cu_query_lens[:-1]).max())
    if max_query_len == 0:
        return out
    compute_f32, precision = _numerics(k_cache.dtype)
    tiles = prefill_tiles(D, k_cache.element_size())
    block_m = block_m or tiles["block_m"]
    block_n = block_n or tiles["block_n"]
    grid = (triton.cdiv(max_query_len, block_m), S, Hq)
    sinks, has_sinks = _sinks(sinks, Hq, q)
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, cu_query_lens, context_lens, sinks, out,
        scale * _LOG2E,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *block_tables.stride(), *out.stride(),
        window,
        GROUP=Hq // Hkv, HEAD_DIM=D, BLOCK_D=tiles["block_d"],
        BLOCK_SIZE=k_cache.shape[1], BLOCK_M=block_m, BLOCK_N=block_n,
        COMPUTE_F32=compute_f32, DOT_PRECISION=precision, HAS_SINKS=has_sinks,
        num_warps=num_warps or tiles["num_warps"], num_stages=num_stages or tiles["num_stages"],
    )
    return out
