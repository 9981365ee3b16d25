"""Token selection: greedy, temperature, top-k, top-p, min-p, with per-request generators.

Every non-greedy request owns a ``torch.Generator`` and draws exactly one batch of uniform
noise per sampled token, so its tokens depend only on its own seed and logits, never on what
else shares the batch.

On CUDA the same code runs on the device: the filters and the race run where the logits are,
the noise is drawn on the host from the request's (CPU) generator, so a seeded request draws
the same stream on either device. Nothing here reads the device: :func:`sample_on_device` and
:func:`logprobs_on_device` leave their results there, and the engine reads everything a step
produced (sampled ids, verifier verdicts, logprobs) in one copy through :class:`HostReadback`,
the step's one device-to-host sync and the one place that counts them.
"""

from __future__ import annotations

import torch

from kvbatch.engine.runtime.sampling_params import SamplingParams
from kvbatch.kernels import dispatch as K


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
    return sample_on_device(logits, params, generators).tolist() if params else []


def sample_on_device(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> torch.Tensor:
    """:func:`sample` without the read: the ids ``[N]`` int64 on the logits' device."""
    n = len(params)
    out = torch.empty(n, dtype=torch.int64, device=logits.device)
    if n == 0:
        return out
    greedy = [i for i, p in enumerate(params) if p.greedy]
    if len(greedy) == n:
        out = K.argmax_rows(logits)
    elif greedy:
        idx = host_to_device(torch.tensor(greedy), logits.device)
        out.index_copy_(0, idx, K.argmax_rows(logits.index_select(0, idx)))
    for i, p in enumerate(params):
        if not p.greedy:
            out[i] = race(logits[i], p, generators[i])
    return out


def host_to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device``; on CUDA through pinned memory with a non-blocking copy (a
    plain copy from pageable memory would wait for the stream: a sync)."""
    return t if device.type != "cuda" else t.pin_memory().to(device, non_blocking=True)


def logprobs_on_device(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> torch.Tensor:
    """:func:`top_logprobs` for every row of ``logits`` [R, V] at once, left on the device:
    ``[R, 1 + 2 k]`` float64 rows of (the chosen token's logprob, the top ``k`` logprobs, their
    ids). Ids are exact in float64, so the row travels in the step's one host copy."""
    logp = logits.log_softmax(-1)
    chosen = logp.gather(1, tokens.view(-1, 1).to(logp.device))
    vals, ids = torch.topk(logp, k, dim=-1) if k else (logp[:, :0], logp[:, :0])
    return torch.cat([chosen.double(), vals.double(), ids.double()], dim=1)


def logprob_entry(row: list[float], token: int, k: int) -> dict:
    """A row of :func:`logprobs_on_device` (read to the host, top ``kmax >= k`` wide) as
    :func:`top_logprobs` returns it."""
    kmax = (len(row) - 1) // 2
    entry: dict = {"token_id": token, "logprob": row[0]}
    if k:
        entry["top"] = [(int(row[1 + kmax + j]), row[1 + j]) for j in range(k)]
    return entry


class HostReadback:
    """Everything one engine step must read from the device, read in one copy.

    ``add`` queues device tensors (any numeric dtype; they travel as float64, exact for token ids
    and for fp32 values), ``read`` concatenates them on the device, copies the result into a
    pinned host buffer kept across steps, waits for that copy (the step's one device-to-host
    sync) and hands back each tensor's values as Python lists. ``syncs`` counts reads: with
    :class:`~kvbatch.engine.runtime.llm.LLM` it is one per step that samples. On the CPU the
    "copy" is the concatenation itself, counted the same way."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.syncs = 0
        self._pending: list[torch.Tensor] = []
        self._pinned: torch.Tensor | None = None

    def add(self, t: torch.Tensor) -> int:
        """Queue ``t`` for the next read; returns its index in what ``read`` returns."""
        self._pending.append(t)
        return len(self._pending) - 1

    def read(self) -> list:
        """The queued tensors' values as (nested) Python lists of floats, in ``add`` order: the
        engine reads nothing else, so no other tensor read can hide in a step."""
        pending, self._pending = self._pending, []
        if not pending:
            return []
        self.syncs += 1
        flat = torch.cat([t.reshape(-1).to(torch.float64) for t in pending])
        if flat.device.type == "cuda":
            n = flat.numel()
            if self._pinned is None or self._pinned.numel() < n:
                self._pinned = torch.empty(max(n, 1 << 12), dtype=torch.float64, pin_memory=True)
            host = self._pinned[:n]
            host.copy_(flat, non_blocking=True)
            torch.cuda.current_stream(flat.device).synchronize()
            flat = host.clone()  # the pinned buffer is reused by the next step
        values = []
        for part, t in zip(flat.split([t.numel() for t in pending]), pending):  # views of one host tensor
            values.append(part.view(t.shape).tolist())
        return values
