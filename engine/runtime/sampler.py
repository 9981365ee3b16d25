"""Token selection: greedy, temperature, top-k, top-p, min-p, with per-request generators.

Every non-greedy request owns a ``torch.Generator`` and draws exactly one batch of uniform
noise per sampled token, so its tokens depend only on its own seed and logits, never on what
else shares the batch.

On CUDA the same code runs on the device: the filters and the race run where the logits are,
the noise is drawn on the host from the request's (CPU) generator, so a seeded request draws
the same stream on either device, and the chosen ids of the whole batch come back to the host in
one copy (``sample``'s single device-to-host sync).
"""

from __future__ import annotations

import torch

from kvbatch.engine.runtime.sampling_params import SamplingParams


def filter_logits(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Temperature then top-k, top-p and min-p on fp32 logits ([V] or [N, V], each row on its
    own); removed tokens get -inf."""
    x = logits / p.temperature
    if p.top_k and p.top_k < x.shape[-1]:
        kth = torch.topk(x, p.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        probs = sorted_x.softmax(-1)
        # Keep the smallest prefix whose mass reaches top_p (the token crossing it included).
        cum_before = probs.cumsum(-1) - probs
        drop_sorted = cum_before >= p.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    if p.min_p > 0.0:
        probs = x.softmax(-1)
        x = x.masked_fill(probs < p.min_p * probs.amax(-1, keepdim=True), float("-inf"))
    return x


def race(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """The sampled id of one row ``logits`` [V] as a 0-d tensor on the logits' device (no sync).

    Exponential race (Gumbel-max in another form): argmax(probs / E), E ~ Exp(1), picks i with
    probability probs[i]; one draw of noise per token keeps the generator's stream aligned. The
    noise comes from ``generator`` on its own device (the host for per-request generators)."""
    probs = filter_logits(logits, p).softmax(-1)
    gen_device = generator.device if generator is not None else probs.device
    noise = torch.empty(probs.shape, dtype=probs.dtype, device=gen_device).exponential_(generator=generator)
    return torch.argmax(probs / noise.to(probs.device, non_blocking=True))


def sample_row(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator | None) -> int:
    if p.greedy:
        return int(torch.argmax(logits))
    return int(race(logits, p, generator))


def top_logprobs(logits: torch.Tensor, token: int, k: int) -> dict:
    """The chosen token's log-probability under the model (before any filtering) and the top k."""
    logp = logits.log_softmax(-1)
    entry: dict = {"token_id": token, "logprob": float(logp[token])}
    if k:
        vals, ids = torch.topk(logp, k)
        entry["top"] = [(int(i), float(v)) for v, i in zip(vals, ids)]
    return entry


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> list[int]:
    """One token per row of ``logits`` [N, V], computed on the logits' device; the ids reach the
    host in one copy at the end (the only sync)."""
    n = len(params)
    if n == 0:
        return []
    out = torch.empty(n, dtype=torch.int64, device=logits.device)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    if len(greedy) == n:
        out = torch.argmax(logits, dim=-1)
    elif greedy:
        idx = torch.tensor(greedy, device=logits.device)
        out.index_copy_(0, idx, torch.argmax(logits.index_select(0, idx), dim=-1))
    for i, p in enumerate(params):
        if not p.greedy:
            out[i] = race(logits[i], p, generators[i])
    return out.tolist()
