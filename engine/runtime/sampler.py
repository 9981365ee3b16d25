"""Token selection: greedy, temperature, top-k, top-p, min-p, with per-request generators;
repetition, presence and frequency penalties and logit bias.

The engine applies each request's logit bias and presence and frequency penalties
(:class:`~kvbatch.engine.runtime.sampling_params.SamplingParams`) with :func:`penalize_rows`
before anything chooses from its logits: the sampler, greedy argmax, the speculative verifier
(each draft position seeing the drafts before it), and before a grammar's mask, so a token the
grammar forbids stays forbidden whatever its bias.

A step samples every row of its batch at once, on the logits' device: the parameters travel as
``[N]`` tensors (:class:`SamplingTensors`, one host-to-device copy), the filters run over the
whole ``[N, V]`` block and each row picks its token by inverse transform sampling: the first
token whose cumulative probability (fp64) exceeds the row's uniform ``u`` times the row's total.
:func:`filter_logits` is the readable one-row specification the batched filters are pinned to.

Every non-greedy request owns a ``torch.Generator`` and draws exactly one fp64 uniform per
sampled token from it, so its tokens depend only on its own seed, how many draws it has made and
its logits, never on what else shares the batch; and a seeded request draws the same stream on
either device, because generators live on the host. Those ``N`` numbers are the only per-row host
work: nothing here reads the device. :func:`sample_on_device` and :func:`logprobs_on_device`
leave their results there, and the engine reads everything a step produced (sampled ids,
verifier verdicts, logprobs) in one copy through :class:`HostReadback`, the step's one
device-to-host sync and the one place that counts them.
"""

from __future__ import annotations

from dataclasses import dataclass

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


@dataclass
class SamplingTensors:
    """One batch's sampling parameters, a ``[N]`` tensor each on the logits' device, plus the
    host-known facts that let :func:`filter_logits_batch` skip filters no row asked for.

    Greedy rows carry temperature 1 and no filters (never divided by 0, no work asked for) and
    take the argmax of their raw logits; a row's ``top_k`` is 0 when off, ``top_p`` 1 and
    ``min_p`` 0 likewise."""

    greedy: torch.Tensor  # bool
    temperature: torch.Tensor  # fp32
    top_k: torch.Tensor  # int64
    top_p: torch.Tensor  # fp32
    min_p: torch.Tensor  # fp32
    uniforms: torch.Tensor  # fp64 in [0, 1): each row's one random number for this token
    max_top_k: int  # the largest top_k asked for below the vocabulary (0: no row filters by top-k)
    any_top_p: bool
    any_min_p: bool
    any_greedy: bool
    all_greedy: bool

    @classmethod
    def build(cls, params: list[SamplingParams], uniforms: torch.Tensor | list[float], vocab: int,
              device: torch.device) -> SamplingTensors:
        """The tensors of ``params`` (one per row) and their ``uniforms`` (host, ``[N]``), moved to
        ``device`` in one copy (pinned and non-blocking on CUDA: no sync)."""
        uniforms = torch.as_tensor(uniforms, dtype=torch.float64)
        if uniforms.shape != (len(params),):
            raise ValueError(f"uniforms: expected one per row ({len(params)}), got shape {tuple(uniforms.shape)}")
        greedy_row = [1.0, 1.0, 0.0, 1.0, 0.0]
        rows = [greedy_row if p.greedy else [0.0, p.temperature, float(p.top_k), p.top_p, p.min_p] for p in params]
        # fp64 carries every field exactly (top_k < 2**53), so one upload serves them all.
        host = torch.cat([torch.tensor(rows, dtype=torch.float64).reshape(len(params), 5).T.reshape(-1), uniforms])
        dev = host_to_device(host, device).view(6, len(params))
        ks = [p.top_k for p in params if not p.greedy and 0 < p.top_k < vocab]
        return cls(greedy=dev[0] > 0, temperature=dev[1].float(), top_k=dev[2].long(), top_p=dev[3].float(),
                   min_p=dev[4].float(), uniforms=dev[5], max_top_k=max(ks, default=0),
                   any_top_p=any(p.top_p < 1.0 and not p.greedy for p in params),
                   any_min_p=any(p.min_p > 0.0 and not p.greedy for p in params),
                   any_greedy=any(p.greedy for p in params), all_greedy=all(p.greedy for p in params))


def filter_logits_batch(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """:func:`filter_logits` of every row of ``logits`` [N, V] with that row's parameters, in
    batched tensor ops (the same operations, so the same kept sets and values)."""
    x = logits.float() / t.temperature[:, None]
    if t.max_top_k:
        vals = torch.topk(x, t.max_top_k, dim=-1).values
        on = (t.top_k > 0) & (t.top_k < x.shape[-1])
        pick = (t.top_k.clamp(1, t.max_top_k) - 1)[:, None]
        kth = torch.where(on[:, None], vals.gather(1, pick), float("-inf"))
        x = x.masked_fill(x < kth, float("-inf"))
    if t.any_top_p:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        probs = sorted_x.softmax(-1)
        cum_before = probs.cumsum(-1) - probs
        # top_p == 1 is off: cum_before can round up to 1 and must not cut the tail then.
        drop_sorted = (cum_before >= t.top_p[:, None]) & (t.top_p < 1.0)[:, None]
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    if t.any_min_p:
        probs = x.softmax(-1)
        x = x.masked_fill(probs < t.min_p[:, None] * probs.amax(-1, keepdim=True), float("-inf"))
    return x


def sample_batch(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """One token per row of ``logits`` [N, V]: ``[N]`` int64 on the logits' device, no sync.

    Sampled rows: inverse transform over the filtered distribution, the first token whose fp64
    cumulative probability exceeds ``u`` times the row's total (removed tokens have zero width,
    so they are never picked). Greedy rows: the argmax of their logits."""
    if t.all_greedy:
        return K.argmax_rows(logits)
    probs = filter_logits_batch(logits, t).softmax(-1)
    cdf = probs.double().cumsum_(-1)
    target = t.uniforms[:, None] * cdf[:, -1:]
    picked = torch.searchsorted(cdf, target, right=True)[:, 0].clamp_(max=logits.shape[-1] - 1)
    return torch.where(t.greedy, K.argmax_rows(logits), picked) if t.any_greedy else picked


def penalize_logits(logits: torch.Tensor, prompt_ids: list[int], output_ids: list[int], repetition: float = 1.0,
                    presence: float = 0.0, frequency: float = 0.0,
                    logit_bias: dict[int, float] | None = None) -> torch.Tensor:
    """The readable one-row specification of :class:`Penalties` (fp32 ``logits`` [V]):
    ``logit_bias`` added first (OpenAI's), then the repetition penalty on every token of the prompt
    or the output (a positive logit divided by it, a negative one multiplied: Keskar et al. 2019,
    as HF and vLLM), then the presence penalty once and the frequency penalty per occurrence for
    each token of the output (OpenAI's)."""
    x = logits.float().clone()
    for tok, b in (logit_bias or {}).items():
        x[tok] += b
    for tok in set(prompt_ids) | set(output_ids):
        x[tok] = x[tok] / repetition if x[tok] > 0 else x[tok] * repetition
    for tok in set(output_ids):
        x[tok] -= presence + frequency * output_ids.count(tok)
    return x


@dataclass
class Penalties:
    """:func:`penalize_logits` for a whole batch, as device tensors: ``[N]`` penalties (1, 0 and 0
    are off), each row's output-token counts and prompt-or-output flags ``[N, V]``, and the logit
    biases as (row, token, value) triples. Built on the host from per-row lists in one upload;
    applied in a handful of batched ops, no sync."""

    repetition: torch.Tensor  # [N] fp32
    presence: torch.Tensor  # [N] fp32
    frequency: torch.Tensor  # [N] fp32
    output_counts: torch.Tensor  # [N, V] fp32
    seen: torch.Tensor  # [N, V] bool: in the prompt or the output
    bias_index: torch.Tensor  # [2, M] int64 (row, token)
    bias_value: torch.Tensor  # [M] fp32

    @classmethod
    def build(cls, prompt_ids: list[list[int]], output_ids: list[list[int]], repetition: list[float],
              presence: list[float], frequency: list[float], logit_bias: list[dict[int, float]], vocab: int,
              device: torch.device) -> Penalties:
        n = len(prompt_ids)
        for name, got in (("output_ids", output_ids), ("repetition", repetition), ("presence", presence),
                          ("frequency", frequency), ("logit_bias", logit_bias)):
            if len(got) != n:
                raise ValueError(f"Penalties.build: {name} has {len(got)} rows, prompt_ids {n}")
        for row, ids in enumerate([*prompt_ids, *output_ids, *[list(b) for b in logit_bias]]):
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"Penalties.build: token id {bad[0]} of row {row % n} is outside the vocabulary "
                                 f"(0..{vocab - 1})")
        # One packed fp64 upload (ids < 2**53 are exact): per-row values, padded id matrices
        # (pad = vocab: a scratch column dropped after the scatter), the bias triples.
        width_p = max((len(i) for i in prompt_ids), default=0)
        width_o = max((len(i) for i in output_ids), default=0)
        triples = [(r, t, v) for r, b in enumerate(logit_bias) for t, v in b.items()]
        parts = [torch.tensor([repetition, presence, frequency], dtype=torch.float64).reshape(3 * n),
                 torch.tensor([i + [vocab] * (width_p - len(i)) for i in prompt_ids], dtype=torch.float64).reshape(-1),
                 torch.tensor([i + [vocab] * (width_o - len(i)) for i in output_ids], dtype=torch.float64).reshape(-1),
                 torch.tensor(triples, dtype=torch.float64).reshape(-1)]
        dev = host_to_device(torch.cat(parts), device)
        vals, prompt, out, bias = dev.split([p.numel() for p in parts])
        prompt, out = prompt.long().view(n, width_p), out.long().view(n, width_o)
        counts = torch.zeros((n, vocab + 1), dtype=torch.float32, device=device)
        counts.scatter_add_(1, out, torch.ones_like(out, dtype=torch.float32))
        seen = torch.zeros((n, vocab + 1), dtype=torch.bool, device=device)
        seen.scatter_(1, prompt, True).scatter_(1, out, True)
        bias = bias.view(-1, 3)
        vals = vals.float().view(3, n)
        return cls(repetition=vals[0], presence=vals[1], frequency=vals[2], output_counts=counts[:, :vocab],
                   seen=seen[:, :vocab], bias_index=bias[:, :2].long().T, bias_value=bias[:, 2].float())


def apply_penalties(logits: torch.Tensor, pen: Penalties) -> torch.Tensor:
    """:func:`penalize_logits` of every row of ``logits`` [N, V] at once (a new fp32 tensor)."""
    x = logits.float().clone()
    x.index_put_((pen.bias_index[0], pen.bias_index[1]), pen.bias_value, accumulate=True)
    r = pen.repetition[:, None]
    x = torch.where(pen.seen, torch.where(x > 0, x / r, x * r), x)
    x = x - pen.output_counts * pen.frequency[:, None] - (pen.output_counts > 0) * pen.presence[:, None]
    return x


def penalize_rows(logits: torch.Tensor, params: list[SamplingParams], outputs: list[list[int]]) -> torch.Tensor:
    """``logits`` [R, V] with each row's logit bias, presence and frequency penalties applied
    (row ``r``: ``params[r]``, the output so far ``outputs[r]``), as :func:`penalize_logits`
    specifies. ``logits`` itself when no row asks for any (no copy, no upload); otherwise only the
    rows that ask are computed (one :class:`Penalties` over them) and copied into a new tensor."""
    if len(params) != logits.shape[0] or len(outputs) != len(params):
        raise ValueError(f"penalize_rows: {logits.shape[0]} logits rows, {len(params)} params, {len(outputs)} outputs")
    rows = [r for r, p in enumerate(params) if p.penalized]
    if not rows:
        return logits
    pen = Penalties.build([[] for _ in rows], [outputs[r] for r in rows], [1.0] * len(rows),
                          [params[r].presence_penalty for r in rows], [params[r].frequency_penalty for r in rows],
                          [dict(params[r].logit_bias) for r in rows], logits.shape[1], logits.device)
    if len(rows) == len(params):
        return apply_penalties(logits, pen)
    idx = host_to_device(torch.tensor(rows, dtype=torch.long), logits.device)
    return logits.float().index_copy(0, idx, apply_penalties(logits.index_select(0, idx), pen))


def draw_uniforms(params: list[SamplingParams], generators: list[torch.Generator | None]) -> torch.Tensor:
    """Each sampled row's one fp64 uniform for this token, from its own (host) generator, as a
    host tensor ``[N]`` (never read into Python: the engine's read checks count such reads);
    greedy rows draw nothing (0), so a request's stream advances once per token it samples."""
    zero = torch.zeros(1, dtype=torch.float64)
    return torch.cat([zero if p.greedy else torch.rand(1, dtype=torch.float64, generator=g)
                      for p, g in zip(params, generators)])


def race(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """The sampled id of one row ``logits`` [V] as a 0-d tensor on the logits' device (no sync):
    :func:`sample_on_device` of a batch of one."""
    return sample_on_device(logits[None], [p], [generator])[0]


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
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
    penalties: Penalties | None = None,
) -> torch.Tensor:
    """:func:`sample` without the read: the ids ``[N]`` int64 on the logits' device. ``penalties``
    (greedy rows included) change the logits first. All greedy: the argmax alone, no upload of
    parameters; otherwise one :func:`sample_batch` over the whole batch."""
    n = len(params)
    if len(generators) != n:
        raise ValueError(f"generators: expected one per row ({n}), got {len(generators)}")
    if logits.dim() != 2 or logits.shape[0] != n:
        raise ValueError(f"logits: expected [{n}, V] for {n} rows, got {tuple(logits.shape)}")
    if n == 0:
        return torch.empty(0, dtype=torch.int64, device=logits.device)
    if penalties is not None:
        logits = apply_penalties(logits, penalties)
    if all(p.greedy for p in params):
        return K.argmax_rows(logits)
    t = SamplingTensors.build(params, draw_uniforms(params, generators), logits.shape[1], logits.device)
    return sample_batch(logits, t)


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
