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
plain sampler draws from, so speculation changes speed, never what is sampled. A request's logit
bias and presence and frequency penalties are part of it: :func:`penalize_positions` applies them
to every draft position's logits as the plain sampler would have at that point of the output (the
output so far plus the drafts before the position), before the verifier reads them. So is a
constrained request's grammar: the engine masks each draft position's logits with the grammar's
state after the drafts before it (:func:`kvbatch.engine.runtime.grammar_mask.fill_draft_bitmask`),
so ``p`` is the masked distribution plain sampling would draw from there.

:func:`verify` is the specification, one request at a time on the host. The engine runs
:func:`verify_batch`: every request of a step at once, on the logits' device, through the batched
accept and recover kernels of :mod:`kvbatch.kernels.dispatch` (Triton on CUDA, the PyTorch twins
of :mod:`kvbatch.kernels.reference_verify` on the CPU). It draws the same random numbers from
each request's generator in the same order (its uniforms, then one row of exponential noise), so
it emits exactly the tokens :func:`verify` would, and it reads nothing back: its verdict stays on
the device until the engine's one read of the step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbatch.engine.runtime.sampler import filter_logits, host_to_device, penalize_rows
from kvbatch.engine.runtime.sampling_params import SamplingParams
from kvbatch.kernels import dispatch as K


def penalize_positions(logits: torch.Tensor,
                       entries: list[tuple[SamplingParams, list[int], list[int]]]) -> torch.Tensor:
    """A step's ``logits`` with each entry's bias and penalties applied. ``entries``, in the order
    of their rows: (params, the output so far, the drafts verified this step); an entry owns
    ``len(drafts) + 1`` rows, row ``j`` scoring the token after ``drafts[:j]``, so its penalties
    count the output plus those drafts, exactly what plain decoding counts when it reaches that
    position."""
    params: list[SamplingParams] = []
    outputs: list[list[int]] = []
    for p, output, drafts in entries:
        for j in range(len(drafts) + 1):
            params.append(p)
            outputs.append(output + drafts[:j] if p.penalized else [])
    return penalize_rows(logits, params, outputs)


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



@dataclass
class VerifyRow:
    """One request's share of a step's verification (the arguments of :func:`verify`)."""

    logits: torch.Tensor  # [k + 1, V] target logits, on the device the engine runs on
    drafts: list[int]
    draft_probs: torch.Tensor | None  # [k, V] filtered draft distributions; None: deterministic drafter
    params: SamplingParams
    generator: torch.Generator | None


@dataclass
class BatchVerdict:
    """:func:`verify_batch`'s result, on the logits' device (nothing read back yet)."""

    num_accepted: torch.Tensor  # [N] int64
    tokens: torch.Tensor  # [N, k_max + 1] int64: row n emits tokens[n, :num_accepted[n] + 1]


def verify_batch(rows: list[VerifyRow]) -> BatchVerdict:
    """:func:`verify` for every row at once, as two batched kernels (module docstring).

    How each request maps onto :func:`kvbatch.kernels.reference_verify.spec_accept` and
    ``spec_recover`` (whose docstring derives it): a sampled request's target rows are its
    filtered probabilities, its uniforms and noise come from its generator; a greedy request's
    rows are one-hot at the argmax of its logits, with uniform 0.5 and noise 1, so a draft is
    kept exactly while it is the argmax and the token after them is the argmax of the next row;
    a request without draft distributions (n-gram, or greedy) gets one-hot ``q`` rows when
    another request of the batch has real ones."""
    N = len(rows)
    assert N, "verify_batch needs at least one row"
    if all(r.params.greedy for r in rows):
        return _verify_greedy(rows)
    device = rows[0].logits.device
    V = rows[0].logits.shape[-1]
    k_max = max(len(r.drafts) for r in rows)
    target = torch.zeros((N, k_max + 1, V), dtype=torch.float32, device=device)
    with_q = any(r.draft_probs is not None and r.drafts for r in rows)
    q = torch.zeros((N, k_max, V), dtype=torch.float32, device=device) if with_q else None
    tokens = torch.zeros((N, k_max), dtype=torch.int64)
    uniforms = torch.full((N, k_max), 0.5, dtype=torch.float32)
    noise = torch.ones((N, V), dtype=torch.float32)
    for n, r in enumerate(rows):
        k = len(r.drafts)
        assert r.logits.shape[0] == k + 1, "one target row per draft plus the bonus row"
        tokens[n, :k] = torch.tensor(r.drafts, dtype=torch.int64)
        if r.params.greedy:
            best = torch.argmax(r.logits, dim=-1, keepdim=True)
            target[n, :k + 1].scatter_(1, best, 1.0)
        else:
            target[n, :k + 1] = filter_logits(r.logits, r.params).softmax(-1)
            # verify()'s draws, in its order: the uniforms up front, then one row of noise.
            if k:
                uniforms[n, :k] = torch.rand(k, generator=r.generator)
            noise[n] = torch.empty(V, dtype=torch.float32).exponential_(generator=r.generator)
        if q is not None and k and r.draft_probs is not None and not r.params.greedy:
            q[n, :k] = r.draft_probs.to(device=device, dtype=torch.float32)
    tokens_dev = host_to_device(tokens, device)
    num_drafts = host_to_device(torch.tensor([len(r.drafts) for r in rows], dtype=torch.int64), device)
    if q is not None:
        # One-hot q for the rows without real draft distributions: max(0, p - onehot(d)) is p
        # with d zeroed, verify()'s residual for them; q(d) = 1 keeps the rule u < p.
        real = host_to_device(torch.tensor([r.draft_probs is not None and not r.params.greedy for r in rows]), device)
        one_hot = torch.zeros_like(q).scatter_(2, tokens_dev[..., None], 1.0)
        q = torch.where(real[:, None, None], q, one_hot)
        q_tok = q.gather(2, tokens_dev[..., None])[..., 0]
    else:
        q_tok = torch.ones((N, k_max), dtype=torch.float32, device=device)
    p_tok = target[:, :k_max].gather(2, tokens_dev[..., None])[..., 0]
    accepted = K.spec_accept(p_tok, q_tok, host_to_device(uniforms, device), num_drafts)
    nxt = K.spec_recover(target, q, tokens_dev, accepted, num_drafts, host_to_device(noise, device))
    emitted = torch.cat([tokens_dev, torch.zeros((N, 1), dtype=torch.int64, device=device)], dim=1)
    emitted.scatter_(1, accepted.view(N, 1), nxt.view(N, 1))
    return BatchVerdict(accepted, emitted)


def _verify_greedy(rows: list[VerifyRow]) -> BatchVerdict:
    """:func:`verify_batch` when every row is greedy. A draft is kept while it equals its row's
    argmax (the accept kernel on p = [draft is the argmax], q = 1, u = 1/2, as the general path's
    one-hot rows give it) and the token after the kept ones is the next row's argmax, so the
    emitted tokens are the rows' argmaxes themselves: no ``[N, k + 1, V]`` target and no recover
    kernel, whose work is what a step with few drafts would otherwise spend most on."""
    device = rows[0].logits.device
    N, k_max = len(rows), max(len(r.drafts) for r in rows)
    best = torch.nn.utils.rnn.pad_sequence([torch.argmax(r.logits, dim=-1) for r in rows], batch_first=True)
    drafts = host_to_device(torch.tensor([r.drafts + [0] * (k_max - len(r.drafts)) for r in rows],
                                         dtype=torch.int64).view(N, k_max), device)
    num_drafts = host_to_device(torch.tensor([len(r.drafts) for r in rows], dtype=torch.int64), device)
    p_tok = (drafts == best[:, :k_max]).float()
    accepted = K.spec_accept(p_tok, torch.ones_like(p_tok), torch.full_like(p_tok, 0.5), num_drafts)
    return BatchVerdict(accepted, best)
