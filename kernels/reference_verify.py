"""Readable, batched PyTorch twins of the speculative verifier's accept/reject step.

:func:`kvbatch.engine.speculative.verifier.verify` is the specification: one request at a time, a
Python loop over its drafts. These functions make the same decisions for a whole batch at once,
given the same random numbers, so the engine can switch to them (and on a GPU to their Triton
twins in :mod:`kvbatch.kernels.triton_verify`) without changing a single sampled token.

How :func:`verify` maps onto them, for request n with ``k_n`` drafts ``d`` (padded to ``k``):

- ``uniforms[n, :k_n] = torch.rand(k_n, generator=gen_n)``, drawn up front as verify does;
- ``p_draft_token[n, i] = p_i(d_i)`` (the target's filtered probability of the draft) and
  ``q_draft_token[n, i] = q_i(d_i)`` (1.0 for a deterministic drafter, whose ``q`` is one-hot);
- ``num_accepted = spec_accept(...)``: draft i is kept while ``q > 0 and u * q < p``, the
  product and the comparison in fp64 exactly as verify's Python floats;
- then ``noise[n] = torch.empty(V).exponential_(generator=gen_n)`` (verify's next draw) and
  ``spec_recover(...)`` gives the token after the kept drafts: from
  ``norm(max(0, p_j - q_j))`` at the first rejection ``j`` (``p_j`` when that is all zeros),
  or the bonus token from ``p_k`` when every draft was kept.

A deterministic drafter's one-hot ``q`` may be passed as ``draft_probs=None``: ``max(0, p - onehot(d))``
is exactly ``p`` with ``d`` zeroed, verify's residual for that case. Greedy requests fit too:
``p_draft_token = (d == argmax)``, ``q = 1`` keeps a draft exactly while it is the argmax
(``u < 1`` always holds); their next token is the argmax of the row, not a draw.

Layouts: ``target_probs`` ``[N, k + 1, V]`` (row i scores the token after draft i),
``draft_probs`` ``[N, k, V]``, ``draft_tokens`` ``[N, k]``, ``num_drafts`` ``[N]`` (``<= k``;
entries past it are ignored), ``noise`` ``[N, V]`` fp32.
"""

from __future__ import annotations

import torch


def spec_accept(
    p_draft_token: torch.Tensor,
    q_draft_token: torch.Tensor,
    uniforms: torch.Tensor,
    num_drafts: torch.Tensor,
) -> torch.Tensor:
    """How many leading drafts each request keeps: ``[N]`` int64.

    All inputs ``[N, k]`` except ``num_drafts`` ``[N]``. Draft i of request n is kept when
    ``q > 0 and u * q < p`` (no division, so a tiny ``q`` cannot overflow), computed in fp64:
    the product of two fp32 numbers is exact there, as in verify's Python floats.
    """
    N, k = p_draft_token.shape
    p = p_draft_token.double()
    q = q_draft_token.double()
    keep = (q > 0) & (uniforms.double() * q < p)
    keep &= torch.arange(k, device=keep.device)[None, :] < num_drafts.to(keep.device)[:, None]
    # The leading run of kept drafts: a running product turns to 0 at the first rejection.
    return keep.long().cumprod(dim=1).sum(dim=1) if k else torch.zeros(N, dtype=torch.long, device=keep.device)


def spec_residual(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    draft_tokens: torch.Tensor,
    num_accepted: torch.Tensor,
    num_drafts: torch.Tensor,
) -> torch.Tensor:
    """``[N, V]`` fp32: the (unnormalised) distribution the next token is drawn from.

    ``max(0, p_j - q_j)`` at the first rejected draft ``j = num_accepted`` (``p_j`` when that
    is all zeros: ``p == q`` up to rounding, so any draw from ``p`` is exact); ``p_k`` with
    ``k = num_drafts`` when every draft was kept.
    """
    N = target_probs.shape[0]
    rows = torch.arange(N, device=target_probs.device)
    j = num_accepted.long()
    p = target_probs[rows, j].float()
    k = draft_tokens.shape[1]
    if k == 0:
        return p
    jd = j.clamp(max=k - 1)  # the draft row (only read for rejected requests)
    if draft_probs is None:
        residual = p.clone()
        residual[rows, draft_tokens[rows, jd].long()] = 0.0
    else:
        residual = (p - draft_probs[rows, jd]).clamp_min(0.0)
    rejected = j < num_drafts.to(j.device).long()
    has_mass = residual.sum(-1) > 0
    return torch.where((rejected & has_mass)[:, None], residual, p)


def spec_recover(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    draft_tokens: torch.Tensor,
    num_accepted: torch.Tensor,
    num_drafts: torch.Tensor,
    noise: torch.Tensor,
) -> torch.Tensor:
    """``[N]`` int64: the token emitted after the kept drafts, drawn from :func:`spec_residual`
    by the exponential race ``argmax(w / noise)`` (the sampler's draw; the first index wins a
    tie, as in ``torch.argmax``)."""
    w = spec_residual(target_probs, draft_probs, draft_tokens, num_accepted, num_drafts)
    return torch.argmax(w / noise, dim=-1)
