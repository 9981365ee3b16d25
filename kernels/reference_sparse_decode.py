"""Decode attention over the paged cache in place, as sparse products: the CPU fp32 path of
:func:`kvbatch.kernels.reference.paged_decode_attention` from a few rows on.

The padded path gathers every sequence's whole K and V into a workspace (block by block, padded to
the longest context of its group) and reads them again in SDPA. Here nothing is copied: with the
cache of one layer seen as rows ``slot * Hkv + kv_head`` of ``D`` values, a CSR pattern holds one
row per (sequence, query head) and one column per cache row it attends to, and

- ``torch.sparse.sampled_addmm`` computes exactly those q.k dots (scaled),
- a segmented softmax (``scatter_reduce`` max, ``segment_reduce`` sum) runs over each pattern row's
  values,
- ``F.embedding_bag`` sums the V rows weighted by the unnormalised probabilities, and the sum is
  divided once per (sequence, head).

Work is proportional to the real context lengths (no padding), and every K/V byte is read from
the cache where it lies. The pattern depends only on the block tables, context lengths and head
layout: it is built once per forward pass and serves every layer.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class SparseDecode:
    """The pattern of one step's decode attention (see the module docstring)."""

    pattern: torch.Tensor  # sparse CSR [B * Hq, cache_rows] (values: zeros)
    cols: torch.Tensor  # [nnz] int64: the pattern's column indices, the embedding_bag indices
    crow: torch.Tensor  # [B * Hq + 1] int64: row offsets, the embedding_bag offsets (last included)
    row_lens: torch.Tensor  # [B * Hq] int64: keys per row
    row_of: torch.Tensor  # [nnz] int64: the row of every value


def sorted_slots(block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int) -> torch.Tensor:
    """The cache slot of every context token, sequence after sequence, ascending within each
    (attention does not depend on the order of its keys, and a CSR row's columns are sorted)."""
    lens = context_lens.long()
    dev = lens.device
    seq = torch.repeat_interleave(torch.arange(lens.numel(), device=dev), lens)
    pos = torch.arange(seq.numel(), device=dev) - (torch.cumsum(lens, 0) - lens).index_select(0, seq)
    slots = block_tables.long()[seq, pos // block_size] * block_size + pos % block_size
    if slots.numel() == 0:
        return slots
    span = int(slots.max()) + 1  # one sort of (sequence, slot) keys sorts within each sequence
    return torch.sort(seq * span + slots).values - seq * span


def plan(slots: torch.Tensor, context_lens: torch.Tensor, num_heads: int, num_kv_heads: int, cache_rows: int,
         dtype: torch.dtype) -> SparseDecode:
    """The pattern for ``slots`` (:func:`sorted_slots`) over a cache of ``cache_rows`` rows
    (``num_blocks * block_size * num_kv_heads``); query head ``h`` reads KV head
    ``h // (num_heads // num_kv_heads)``."""
    lens = context_lens.long()
    dev = lens.device
    B = lens.numel()
    row_lens = lens.repeat_interleave(num_heads)  # row b * Hq + h: sequence b, query head h
    crow = torch.zeros(B * num_heads + 1, dtype=torch.int64, device=dev)
    torch.cumsum(row_lens, 0, out=crow[1:])
    nnz = int(crow[-1])
    row_of = torch.repeat_interleave(torch.arange(B * num_heads, device=dev), row_lens, output_size=nnz)
    # Each value's token: its sequence's first token plus its place in the row.
    first_token = (torch.cumsum(lens, 0) - lens).repeat_interleave(num_heads)
    token = torch.arange(nnz, device=dev) + (first_token - crow[:-1]).index_select(0, row_of)
    kv_head = (torch.arange(num_heads, device=dev) // (num_heads // num_kv_heads)).repeat(B).index_select(0, row_of)
    cols = slots.index_select(0, token) * num_kv_heads + kv_head
    with warnings.catch_warnings():  # "sparse CSR support is in beta": the three ops used are pinned by tests
        warnings.simplefilter("ignore")
        pattern = torch.sparse_csr_tensor(crow, cols, torch.zeros(nnz, dtype=dtype, device=dev),
                                          (B * num_heads, cache_rows), check_invariants=False)
    return SparseDecode(pattern, cols, crow, row_lens, row_of)


def applies(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """fp32 on the CPU over contiguous caches: what this path was measured and tested on (16-bit
    caches and CUDA tensors keep the padded path)."""
    return (q.dtype == k_cache.dtype == v_cache.dtype == torch.float32 and not q.is_cuda
            and k_cache.is_contiguous() and v_cache.is_contiguous())


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, sp: SparseDecode,
              scale: float) -> torch.Tensor:
    """``q`` [B, Hq, D] against the caches ``[num_blocks, block_size, Hkv, D]`` along ``sp``."""
    B, Hq, D = q.shape
    k_rows, v_rows = k_cache.view(-1, D), v_cache.view(-1, D)  # row slot * Hkv + kv_head
    scores = torch.sparse.sampled_addmm(sp.pattern, q.reshape(B * Hq, D), k_rows.t(), beta=0.0,
                                        alpha=scale).values()
    # Each row's max (scatter_reduce measured about twice as fast as segment_reduce here; a max
    # is exact in any order).
    top = torch.full((B * Hq,), float("-inf"), dtype=scores.dtype, device=scores.device).scatter_reduce_(
        0, sp.row_of, scores, "amax")
    weights = scores.sub_(top.index_select(0, sp.row_of)).exp_()
    total = torch.segment_reduce(weights, "sum", lengths=sp.row_lens)
    out = F.embedding_bag(sp.cols, v_rows, sp.crow, mode="sum", per_sample_weights=weights,
                          include_last_offset=True)
    # An empty context (no keys) gives 0 / tiny = 0, as the padded path and the kernels do.
    return out.div_(total.clamp_min_(torch.finfo(total.dtype).tiny)[:, None]).view(B, Hq, D)
