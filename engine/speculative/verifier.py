"""The speculative verifier: which drafted tokens the target keeps, and the token after them.

Rejection sampling as in Leviathan et al. (2023) and Chen et al. (2023). For draft position i
with target distribution ``p_i`` and draft distribution ``q_i``, the drafted token ``d`` is kept
with probability ``min(1, p_i(d) / q_i(d))``; at the first rejection a token is drawn from
``norm(max(0, p_i - q_i))`` and drafting stops; if every draft is kept, a bonus token is drawn
from ``p_k``. The emitted tokens are then distributed exactly as if the target had sampled them
one at a time. A drafter that proposes deterministically (n-gram lookup) has a one-hot ``q``:
``d`` is kept with probability ``p_i(d)`` and the residual is ``p_i`` without ``d``.

Greedy requests keep a draft exactly while it equals the target's argmax, so their output is
token for token that of plain greedy decoding.

``p`` is the target's *filtered* distribution (temperature, top-k/p, min-p), the same one the
plain sampler draws from, so speculation changes speed, never what is sampled.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbatch.engine.runtime.sampler import filter_logits
from kvbatch.engine.runtime.sampling_params import SamplingParams


@dataclass
class Verdict:
    tokens: list[int]  # the kept drafts, then one token drawn by the target
    num_accepted: int  # how many drafts were kept


def verify(
    target_logits: torch.Tensor,
    draft_tokens: list[int],
    draft_probs: torch.Tensor | None,
    params: SamplingParams,
    generator: torch.Generator | None,
) -> Verdict:
    """``target_logits``: [k + 1, V] fp32, row i scoring the token after draft i (row 0 follows
    the last accepted token). ``draft_probs``: [k, V] filtered draft distributions, or None for
    a deterministic drafter."""
    k = len(draft_tokens)
    assert target_logits.shape[0] == k + 1, "one target row per draft plus the bonus row"
    if params.greedy:
        best = torch.argmax(target_logits, dim=-1).tolist()
        n = 0
        while n < k and best[n] == draft_tokens[n]:
            n += 1
        return Verdict(draft_tokens[:n] + [best[n]], n)
    p = filter_logits(target_logits, params).softmax(-1)
    # One uniform per draft position, drawn up front: a request's random stream depends only on
    # its own seed and how many tokens it drafted, never on its batch neighbours.
    u = torch.rand(k, generator=generator) if k else None
    for i, d in enumerate(draft_tokens):
        q_d = 1.0 if draft_probs is None else float(draft_probs[i, d])
        p_d = float(p[i, d])
        if q_d > 0 and float(u[i]) * q_d < p_d:  # u < p/q without dividing by a tiny q
            continue
        if draft_probs is None:
            residual = p[i].clone()
            residual[d] = 0.0
        else:
            residual = (p[i] - draft_probs[i]).clamp_min_(0.0)
        total = float(residual.sum())
        if total <= 0.0:  # p == q up to rounding: any draw from p is exact
            residual = p[i]
        return Verdict(draft_tokens[:i] + [_draw(residual, generator)], i)
    return Verdict(list(draft_tokens) + [_draw(p[k], generator)], k)


def _draw(weights: torch.Tensor, generator: torch.Generator | None) -> int:
    """One index with probability proportional to ``weights`` (exponential race, as the sampler)."""
    noise = torch.empty_like(weights).exponential_(generator=generator)
    return int(torch.argmax(weights / noise))

