"""Triton twins of :func:`reference_verify.spec_accept` and :func:`reference_verify.spec_recover`.

``spec_accept``: one program per ``block_n`` requests; each row's drafts are compared at once
(fp64, like the twin) and the first rejection found with a min-reduction.

``spec_recover``: one program per request streams its chosen target row, the matching draft
row and its noise over the vocabulary once, keeping two running exponential-race winners (the
residual's and the plain row's, first index on ties) and whether the residual has any mass;
the right one is stored at the end. Division is IEEE round-to-nearest (``div_rn``), as on the
CPU, so a race decides like ``torch.argmax(w / noise)``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _spec_accept_kernel(
    p_ptr, q_ptr, u_ptr, num_drafts_ptr, out_ptr,
    N, K,
    stride_pn, stride_pk, stride_qn, stride_qk, stride_un, stride_uk,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_n = offs_n < N
    rows = offs_n.to(tl.int64)
    nd = tl.load(num_drafts_ptr + rows, mask=mask_n, other=0).to(tl.int32)
    nd = tl.minimum(nd, K)
    mask = mask_n[:, None] & (offs_k[None, :] < nd[:, None])
    p = tl.load(p_ptr + rows[:, None] * stride_pn + offs_k[None, :] * stride_pk, mask=mask, other=0.0).to(tl.float64)
    q = tl.load(q_ptr + rows[:, None] * stride_qn + offs_k[None, :] * stride_qk, mask=mask, other=0.0).to(tl.float64)
    u = tl.load(u_ptr + rows[:, None] * stride_un + offs_k[None, :] * stride_uk, mask=mask, other=1.0).to(tl.float64)
    keep = (q > 0) & (u * q < p)
    first_reject = tl.min(tl.where(keep | ~mask, BLOCK_K, offs_k[None, :]), axis=1)
    tl.store(out_ptr + rows, tl.minimum(first_reject, nd).to(tl.int64), mask=mask_n)


@triton.jit
def _spec_recover_kernel(
    p_ptr, q_ptr, tok_ptr, acc_ptr, nd_ptr, noise_ptr, out_ptr,
    V, K,
    stride_pn, stride_pk, stride_pv,
    stride_qn, stride_qk, stride_qv,
    stride_tn, stride_tk,
    stride_zn, stride_zv,
    HAS_Q: tl.constexpr, BLOCK_V: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    j = tl.load(acc_ptr + n).to(tl.int32)
    rejected = j < tl.minimum(tl.load(nd_ptr + n).to(tl.int32), K)
    jd = tl.minimum(j, tl.maximum(K - 1, 0))  # the draft row, read only for a rejection
    # The rejected draft token: a one-hot q zeroes it (read only without a draft distribution).
    if HAS_Q:
        d = -1
    else:
        d = tl.load(tok_ptr + n * stride_tn + jd * stride_tk, mask=rejected, other=-1).to(tl.int32)
    p_row = p_ptr + n * stride_pn + j.to(tl.int64) * stride_pk
    q_row = q_ptr + n * stride_qn + jd.to(tl.int64) * stride_qk
    z_row = noise_ptr + n * stride_zn

    # Running winners: (best value, its index) for the residual and for the plain row.
    best_r = -1.0
    idx_r = 0
    best_p = -1.0
    idx_p = 0
    mass = 0.0
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        mask = offs < V
        p = tl.load(p_row + offs * stride_pv, mask=mask, other=0.0).to(tl.float32)
        z = tl.load(z_row + offs * stride_zv, mask=mask, other=1.0).to(tl.float32)
        if HAS_Q:
            q = tl.load(q_row + offs * stride_qv, mask=mask & rejected, other=0.0).to(tl.float32)
            r = tl.maximum(p - q, 0.0)
        else:
            r = tl.where(offs == d, 0.0, p)
        mass = tl.maximum(mass, tl.max(r, 0))
        race_p = tl.where(mask, tl.math.div_rn(p, z), -1.0)
        race_r = tl.where(mask, tl.math.div_rn(r, z), -1.0)
        bp, ip = tl.max(race_p, 0, return_indices=True, return_indices_tie_break_left=True)
        br, ir = tl.max(race_r, 0, return_indices=True, return_indices_tie_break_left=True)
        # Strictly greater: an earlier block keeps a tie, so the first index wins overall.
        take_p = bp > best_p
        idx_p = tl.where(take_p, v0 + ip, idx_p)
        best_p = tl.where(take_p, bp, best_p)
        take_r = br > best_r
        idx_r = tl.where(take_r, v0 + ir, idx_r)
        best_r = tl.where(take_r, br, best_r)
    use_residual = rejected & (mass > 0)
    tl.store(out_ptr + n, tl.where(use_residual, idx_r, idx_p).to(tl.int64))


SPEC_ACCEPT_BLOCK_N = 64  # requests per accept program
SPEC_RECOVER_BLOCK_V = 1024  # vocabulary entries per recover step at most


def accept_block_k(num_drafts: int) -> int:
    """Draft columns the accept kernel compares at once (at least 2)."""
    return max(2, triton.next_power_of_2(num_drafts))


def recover_block_v(vocab: int, block_v: int = SPEC_RECOVER_BLOCK_V) -> int:
    """Vocabulary entries per step of the recover kernel (``block_v`` at most)."""
    return min(block_v, max(16, triton.next_power_of_2(vocab)))


def spec_accept(
    p_draft_token: torch.Tensor,
    q_draft_token: torch.Tensor,
    uniforms: torch.Tensor,
    num_drafts: torch.Tensor,
    *,
    block_n: int = SPEC_ACCEPT_BLOCK_N,
) -> torch.Tensor:
    """Triton twin of :func:`reference_verify.spec_accept` (same arguments and result)."""
    N, K = p_draft_token.shape
    out = torch.empty(N, dtype=torch.int64, device=p_draft_token.device)
    if N == 0:
        return out
    if K == 0:
        return out.zero_()
    _spec_accept_kernel[(triton.cdiv(N, block_n),)](
        p_draft_token, q_draft_token, uniforms, num_drafts, out, N, K,
        *p_draft_token.stride(), *q_draft_token.stride(), *uniforms.stride(),
        BLOCK_N=block_n, BLOCK_K=accept_block_k(K),
    )
    return out


def spec_recover(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    draft_tokens: torch.Tensor,
    num_accepted: torch.Tensor,
    num_drafts: torch.Tensor,
    noise: torch.Tensor,
    *,
    block_v: int = SPEC_RECOVER_BLOCK_V,
    num_warps: int = 4,
) -> torch.Tensor:
    """Triton twin of :func:`reference_verify.spec_recover` (same arguments and result)."""
    N, _, V = target_probs.shape
    K = draft_tokens.shape[1]
    out = torch.empty(N, dtype=torch.int64, device=target_probs.device)
    if N == 0:
        return out
    has_q = draft_probs is not None and K > 0
    q = draft_probs if has_q else target_probs  # not read without a draft distribution
    tokens = draft_tokens if K > 0 else num_accepted.view(N, 1)  # not read when K == 0
    _spec_recover_kernel[(N,)](
        target_probs, q, tokens, num_accepted, num_drafts, noise, out,
        V, K,
        *target_probs.stride(), *q.stride(), *tokens.stride(), *noise.stride(),
        HAS_Q=has_q, BLOCK_V=recover_block_v(V, block_v),
        num_warps=num_warps,
    )
    return out
