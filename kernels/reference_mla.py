"""Readable PyTorch twins of the Multi-head Latent Attention (MLA) kernels, over the compressed cache.

The specification a fast (Triton) version is tested against; on a CPU the engine runs these.

Layout of one layer's MLA cache: ``kv_cache`` ``[num_blocks, block_size, 1, C + R]`` where the
first ``C = kv_lora_rank`` numbers of a token are its normalised latent ``c_kv`` and the last
``R = qk_rope_head_dim`` its rotated rope key ``k_pe`` (shared by every head). Nothing per head is
stored: that is the point of MLA.

Attention runs in the "absorbed" form. With ``kv_b_proj`` split per head into ``W_UK[h]``
(``[dn, C]``, keys) and ``W_UV[h]`` (``[dv, C]``, values), head h's key for token s is
``[W_UK[h] c_s ; k_pe_s]`` and its value ``W_UV[h] c_s``. So

    score(t, s) = q_nope[t,h] . W_UK[h] c_s + q_pe[t,h] . k_pe_s
                = [W_UK[h]^T q_nope[t,h] ; q_pe[t,h]] . [c_s ; k_pe_s]
    out[t, h]   = W_UV[h] sum_s p(t, s) c_s

The caller folds ``W_UK`` into the query (``q_latent = W_UK^T q_nope``, ``[.., Hq, C]``) and
``W_UV`` into the output; these functions compute ``sum_s p(t, s) c_s`` — multi-query attention
with one shared key/value "head" of width ``C + R`` whose value is the key's first ``C`` numbers.
Block tables, slot mappings and context lengths mean what they mean in
:mod:`kvbatch.kernels.reference`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvbatch.kernels.reference import DECODE_GROUP, gather_slots


def store_mla_kv(latent: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write the new tokens' ``[c_kv ; k_pe]`` rows (``latent``: ``[T, C + R]``) into their
    cache slots, in place."""
    flat = kv_cache.view(-1, kv_cache.shape[-1])
    flat.index_copy_(0, slot_mapping, latent.to(kv_cache.dtype))


def _query(q_latent: torch.Tensor, q_pe: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[.., Hq, C + R]``: the absorbed query laid out like a cache row."""
    return torch.cat([q_latent, q_pe], dim=-1).to(dtype)


def mla_decode_attention(
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    workspace: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query token per sequence against its paged compressed context.

    ``q_latent``: [B, Hq, C], ``q_pe``: [B, Hq, R] (rotated) -> [B, Hq, C], the attention-weighted
    sum of the context latents per head. ``context_lens[b]`` includes the new token, whose row
    must already be in the cache. ``workspace``: a reusable buffer of at least
    ``[B * block_tables.shape[1], block_size, 1, C + R]`` to gather blocks into.
    """
    B, Hq, C = q_latent.shape
    block_size, width_cr = kv_cache.shape[1], kv_cache.shape[-1]
    if B == 0:
        return q_latent.new_empty((0, Hq, C))
    if B > DECODE_GROUP:
        # Sequences of similar length together, so each group pads only to its own longest.
        order = torch.argsort(context_lens, stable=True)
        lens_sorted = context_lens.index_select(0, order)
        out = torch.empty_like(q_latent)
        for start in range(0, B, DECODE_GROUP):
            idx = order[start:start + DECODE_GROUP]
            width = -(-int(lens_sorted[start:start + DECODE_GROUP].max()) // block_size)
            out[idx] = mla_decode_attention(q_latent.index_select(0, idx), q_pe.index_select(0, idx), kv_cache,
                                            block_tables.index_select(0, idx)[:, :width],
                                            context_lens.index_select(0, idx), scale, workspace)
        return out
    width = block_tables.shape[1]
    blocks = block_tables.reshape(-1).long()
    if workspace is None:
        rows = kv_cache.index_select(0, blocks)
    else:
        rows = torch.index_select(kv_cache, 0, blocks, out=workspace[: blocks.numel()])
    kv = rows.view(B, 1, width * block_size, width_cr)  # one shared head
    valid = torch.arange(width * block_size, device=q_latent.device)[None, :] < context_lens[:, None].to(
        q_latent.device)
    q = _query(q_latent, q_pe, kv.dtype).view(B, 1, Hq, width_cr)  # the heads are query rows
    out = F.scaled_dot_product_attention(q, kv, kv[..., :C], attn_mask=valid[:, None, None, :], scale=scale)
    return out.view(B, Hq, C).to(q_latent.dtype)


def mla_prefill_attention(
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_query_lens: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention for chunks of new tokens over their cached prefix plus themselves.

    ``q_latent``: [T, Hq, C] and ``q_pe``: [T, Hq, R], the new tokens of S sequences back to
    back (``cu_query_lens``: [S+1] offsets); sequence s's new tokens sit at positions
    ``context_lens[s] - q_len_s .. context_lens[s] - 1`` and their rows are already in the
    cache. Query at position p attends to tokens ``0..p``. Returns [T, Hq, C].
    """
    T, Hq, C = q_latent.shape
    block_size, width_cr = kv_cache.shape[1], kv_cache.shape[-1]
    flat = kv_cache.view(-1, width_cr)
    out = torch.empty_like(q_latent)
    cu = cu_query_lens.tolist()
    lens = context_lens.tolist()
    for s in range(len(lens)):
        start, end = cu[s], cu[s + 1]
        n_new, n_ctx = end - start, lens[s]
        if n_new == 0:
            continue
        kv = flat.index_select(0, gather_slots(block_tables[s:s + 1], n_ctx, block_size)[0])  # [n_ctx, C+R]
        # [n_new, Hq, C+R] -> [Hq * n_new, C+R]: row (h, i) is head h, token i.
        q = _query(q_latent[start:end], q_pe[start:end], kv.dtype).transpose(0, 1).reshape(Hq * n_new, width_cr)
        q_pos = torch.arange(n_ctx - n_new, n_ctx, device=q.device)
        mask = torch.arange(n_ctx, device=q.device)[None, :] <= q_pos[:, None]
        o = F.scaled_dot_product_attention(q[None], kv[None], kv[None, :, :C], attn_mask=mask.repeat(Hq, 1),
                                           scale=scale)
        out[start:end] = o.view(Hq, n_new, C).transpose(0, 1).to(q_latent.dtype)
    return out
