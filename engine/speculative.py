"""Speculative decoding inside continuous batching: how many tokens each request drafts.

Per step, for every running request that is decoding:
1. ``plan`` sets ``seq.num_lookahead``, the draft slots the scheduler reserves next to the one
   real token (the request's current draft length, capped by max_tokens and the context);
2. after scheduling, ``draft`` asks the drafter for up to that many tokens and shrinks the step
   to what was proposed (a request may get none: then it is a plain decode row);
3. the target scores all of them in the same forward pass, the verifier keeps a prefix, and
   ``observe`` updates the request's acceptance estimate.

Draft length is confidence-aware. Each request keeps an estimate ``alpha`` of the probability
that one drafted token is accepted (decayed counts of accepted tokens and rejections, with a
prior), so the k-th draft of a step survives with probability about ``alpha ** k``. With
``adaptive`` on:

- a request never drafts past the k at which that estimate falls below ``accept_threshold``,
  and a drafter that has its own probabilities (draft model, early exit) also stops as soon as
  its running estimate for the next draft falls below it;
- draft slots are only worth what they cost. Each slot adds one token to the target pass and
  one drafter call. A step costs about ``a + b * tokens`` seconds (a: streaming the weights,
  b: compute per token; fitted online from the decode-only steps this engine ran, see
  :class:`StepCostModel`). Slots are handed out greedily to the requests whose next draft is
  most likely kept, and only while that likelihood beats the throughput the step already has
  per second of added cost. At batch 1 on a memory-bound machine slots are nearly free, so the
  threshold decides; with many requests in a step, compute dominates and only drafts that are
  very likely kept get a slot;
- a request whose estimate drops so low that it gets no slot probes with one draft every
  ``probe_every`` steps, so it can recover when the text turns repetitive.

With ``adaptive`` off, every request drafts ``max_len`` tokens whenever the drafter has them.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Literal

from kvbatch.engine.sequence import Sequence

Method = Literal["ngram", "draft", "early-exit"]


@dataclass(frozen=True)
class SpecConfig:
    method: Method
    max_len: int = 4
    adaptive: bool = True
    draft_model: str | None = None  # method "draft": path, URL or name of the draft checkpoint
    exit_layer: int | None = None  # method "early-exit": layers the drafter runs
    ngram_min: int = 2
    ngram_max: int = 4
    accept_threshold: float = 0.35
    prior_accepted: float = 2.0  # pseudo-counts: a fresh request starts at alpha = 2/3
    prior_rejected: float = 1.0
    decay: float = 0.9  # weight of the past in the acceptance counts, per verification step
    probe_every: int = 8

    def __post_init__(self) -> None:
        if self.method not in ("ngram", "draft", "early-exit"):
            raise ValueError(f"unknown speculative method {self.method!r} (ngram, draft:MODEL, early-exit:K)")
        if self.max_len < 1:
            raise ValueError(f"spec max_len must be >= 1, got {self.max_len}")
        if self.method == "draft" and not self.draft_model:
            raise ValueError("--spec draft:MODEL needs a model")
        if self.method == "early-exit" and (self.exit_layer is None or self.exit_layer < 1):
            raise ValueError("--spec early-exit:K needs K >= 1 layers")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min}, {self.ngram_max}")
        if not 0.0 < self.accept_threshold < 1.0:
            raise ValueError(f"accept_threshold must be in (0, 1), got {self.accept_threshold}")

    @classmethod
    def parse(cls, text: str, max_len: int = 4, adaptive: bool = True) -> "SpecConfig":
        """``ngram``, ``draft:MODEL`` or ``early-exit:K`` (the command line's ``--spec``)."""
        method, _, arg = text.partition(":")
        if method == "ngram" and not arg:
            return cls("ngram", max_len, adaptive)
        if method == "draft":
            return cls("draft", max_len, adaptive, draft_model=arg or None)
        if method == "early-exit":
            try:
                layers = int(arg)
            except ValueError:
                raise ValueError(f"--spec early-exit:K needs an integer K, got {arg!r}") from None
            return cls("early-exit", max_len, adaptive, exit_layer=layers)
        raise ValueError(f"unknown --spec {text!r} (use ngram, draft:MODEL or early-exit:K)")


@dataclass
class Acceptance:
    """One request's decayed acceptance counts."""

    accepted: float = 0.0
    rejected: float = 0.0
    steps_without_draft: int = 0


@dataclass
class StepCostModel:
    """Seconds of a target pass as ``fixed + per_token * tokens``, plus ``per_draft`` seconds of
    drafter time per draft slot offered, fitted by decayed least squares over decode-only steps.

    Until steps have been seen it assumes a pass of ``prior_break_even`` tokens costs twice a
    one-token pass (weights streamed once, then compute per token: about 16 tokens for a small
    model in fp32 on a 2-core CPU, far more on a GPU); the prior stays in the fit as two pseudo
    observations of small weight, so the fit is defined even when every step has the same size.
    """

    prior_break_even: float = 16.0
    decay: float = 0.98
    _n: float = 0.0
    _st: float = 0.0
    _stt: float = 0.0
    _sy: float = 0.0
    _sty: float = 0.0
    _draft_s: float = 0.0
    _drafted: float = 0.0
    fixed: float = 1.0
    per_token: float = 1.0 / 16.0
    per_draft: float = 0.0

    def step_time(self, tokens: int) -> float:
        return self.fixed + self.per_token * tokens

    def observe(self, tokens: int, target_s: float, drafted: int, draft_s: float) -> None:
        if self._n == 0.0:
            # Anchor the prior's scale on the first real step.
            unit = target_s / (1.0 + tokens / self.prior_break_even)
            for t, y in ((1.0, unit * (1 + 1 / self.prior_break_even)), (4 * self.prior_break_even, 5 * unit)):
                self._add(t, y, 0.5)
        d = self.decay
        self._n, self._st, self._stt, self._sy, self._sty = (
            d * self._n, d * self._st, d * self._stt, d * self._sy, d * self._sty)
        self._add(float(tokens), target_s, 1.0)
        var = self._n * self._stt - self._st ** 2
        if var > 1e-9:
            b = (self._n * self._sty - self._st * self._sy) / var
            a = (self._sy - b * self._st) / self._n
            self.per_token = max(b, 1e-7)
            self.fixed = max(a, 1e-6)
        self._draft_s = d * self._draft_s + draft_s
        self._drafted = d * self._drafted + drafted
        self.per_draft = self._draft_s / self._drafted if self._drafted > 0 else 0.0

    def _add(self, t: float, y: float, w: float) -> None:
        self._n += w
        self._st += w * t
        self._stt += w * t * t
        self._sy += w * y
        self._sty += w * t * y


@dataclass
class SpecController:
    config: SpecConfig
    states: dict[int, Acceptance] = field(default_factory=dict)
    cost: StepCostModel = field(default_factory=StepCostModel)

    def alpha(self, seq: Sequence) -> float:
        c = self.config
        st = self.states.get(seq.seq_id) or Acceptance()
        return (st.accepted + c.prior_accepted) / (st.accepted + st.rejected + c.prior_accepted + c.prior_rejected)

    def length(self, seq: Sequence) -> int:
        """The longest draft the acceptance threshold allows (``max_len`` when not adaptive),
        or 1 when it is time to probe a request that has stopped drafting."""
        c = self.config
        if not c.adaptive:
            return c.max_len
        a = self.alpha(seq)
        k = 0
        while k < c.max_len and a ** (k + 1) >= c.accept_threshold:
            k += 1
        return k if k else self._probe(seq)

    def _probe(self, seq: Sequence) -> int:
        st = self.states.setdefault(seq.seq_id, Acceptance())
        return 1 if st.steps_without_draft + 1 >= self.config.probe_every else 0

    def plan(self, running: list[Sequence], max_model_len: int) -> None:
        """Set ``num_lookahead`` on every running request (0 for those still prefilling)."""
        decoding: list[tuple[Sequence, int]] = []
        for seq in running:
            seq.num_lookahead = 0
            if seq.prefill_only or seq.num_pending_tokens != 1:
                continue
            room_out = seq.sampling.max_tokens - seq.num_output_tokens - 1
            room_ctx = max_model_len - seq.num_tokens - 1
            cap = max(0, min(self.length(seq), room_out, room_ctx))
            decoding.append((seq, cap))
        if not self.config.adaptive:
            for seq, cap in decoding:
                seq.num_lookahead = cap
            return
        self._allocate(decoding)

    def _allocate(self, decoding: list[tuple[Sequence, int]]) -> None:
        """Hand out draft slots while the next one pays for itself (see the module docstring)."""
        cost = self.cost
        tokens = len(decoding)
        expected = float(tokens)  # tokens this step is expected to emit
        heap: list[tuple[float, int]] = []
        alphas = []
        for i, (seq, cap) in enumerate(decoding):
            a = self.alpha(seq)
            alphas.append(a)
            if cap > 0 and a < self.config.accept_threshold:
                seq.num_lookahead = 1  # a probe: granted whatever it costs, it is how alpha recovers
                tokens += 1
            elif cap > 0:
                heapq.heappush(heap, (-a, i))
        slot_cost = cost.per_token + cost.per_draft
        while heap:
            neg_gain, i = heapq.heappop(heap)
            gain = -neg_gain
            seq, cap = decoding[i]
            if gain * cost.step_time(tokens) < slot_cost * expected:
                break
            seq.num_lookahead += 1
            tokens += 1
            expected += gain
            if seq.num_lookahead < cap:
                heapq.heappush(heap, (-(gain * alphas[i]), i))

    def observe_step(self, tokens: int, target_s: float, slots: int, draft_s: float) -> None:
        """Feed the cost model one decode-only step (``slots``: draft slots offered to the drafter)."""
        self.cost.observe(tokens, target_s, slots, draft_s)

    def observe(self, seq: Sequence, drafted: int, accepted: int) -> None:
        st = self.states.setdefault(seq.seq_id, Acceptance())
        if drafted == 0:
            st.steps_without_draft += 1
            return
        st.steps_without_draft = 0
        d = self.config.decay
        st.accepted = d * st.accepted + accepted
        st.rejected = d * st.rejected + (1.0 if accepted < drafted else 0.0)

    def release(self, seq: Sequence) -> None:
        self.states.pop(seq.seq_id, None)
