"""Speculative decoding inside continuous batching: how many tokens each request drafts.

Per step, for every running request that is decoding:
1. ``plan`` sets ``seq.num_lookahead``, the draft slots the scheduler reserves next to the one
   real token (the request's current draft length, capped by max_tokens and the context);
2. after scheduling, ``draft`` asks the drafter for up to that many tokens and shrinks the step
   to what was proposed (a request may get none: then it is a plain decode row);
3. the target scores all of them in the same forward pass, the verifier keeps a prefix, and
   ``observe`` updates the request's acceptance estimate.

Draft length is confidence-aware. Each request estimates, for every draft position j, the
chance ``p_j`` that the j-th draft is kept given that the ones before it were (decayed counts of
how often position j was reached and kept, shrunk towards the whole run's counts for that
position, so a new request starts from what the others saw). Counts are kept apart by the
drafter's evidence for this step's draft (its ``outlook``, asked before slots are granted: the
n-gram match length), since that predicts acceptance far better than the request's history
alone: a draft after an 8-token match is kept ~95% of the time, after a 1-token match ~30%. Drafts are correlated (a prompt
lookup that copies its first token right tends to copy the next ones too), which a single
per-token rate would miss. The j-th draft of a step survives with probability
``p_1 * ... * p_j``. With ``adaptive`` on:

- a request never drafts past the k at which that survival falls below ``accept_threshold``,
  and a drafter that has its own probabilities (draft model, early exit) also stops as soon as
  its running estimate for the next draft falls below it;
- draft slots are only worth what they cost. Each slot adds one token to the target pass and
  one drafter call. The time of a pass as a function of its token count is learned online from
  the decode-only steps this engine ran (:class:`StepCostModel`). Slots are ranked by the chance
  that their draft is kept, and a step takes the number of best-ranked slots that maximises
  expected tokens per second. At batch 1 on a memory-bound machine slots are nearly free, so the
  threshold decides; with many requests in a step, compute dominates and only drafts that are
  very likely kept get a slot;
- a request whose estimate drops so low that it gets no slot probes with one draft every
  ``probe_every`` steps, so it can recover when the text turns repetitive; but only in a step
  that verifies drafts anyway, or where a step with drafts costs at most :data:`PROBE_SURCHARGE`
  more than one without. A step that verifies no draft runs the plain path (no verifier, on the
  CPU the fused decode layers), and with many requests a step that verifies even one draft costs
  measurably more (the engine's rows take the verifier's tensors and the batch leaves the fused
  decode path): a probe that turned every step into one would cost more than all it could find.
  The cost model therefore keeps steps that verified drafts apart from those that did not, both
  measured through sampling and verification.

With ``adaptive`` off, every request drafts ``max_len`` tokens whenever the drafter has them.
"""

from __future__ import annotations

import bisect
import heapq
from dataclasses import dataclass, field
from typing import Callable, Literal

from kvbatch.engine.runtime.sequence import Sequence

Method = Literal["ngram", "draft", "early-exit", "suffix"]

# ``--spec suffix:last-night`` in a pipeline: drafts from that pipeline's own results of its most
# recent earlier day (the decode step resolves it to those files: pipelines/last_night.py).
LAST_NIGHT = "last-night"

# A probe (a row's one draft after it stopped drafting) in a step that would verify no other draft
# is granted only while a step with drafts is predicted to cost at most this share more than one
# without: the probe's step then pays for the verifier and, on the CPU, leaves the fused decode path.
PROBE_SURCHARGE = 0.02


@dataclass(frozen=True)
class SpecConfig:
    method: Method
    max_len: int = 8
    adaptive: bool = True
    draft_model: str | None = None  # method "draft": path, URL or name of the draft checkpoint
    exit_layer: int | None = None  # method "early-exit": layers the drafter runs
    corpus: str | None = None  # method "suffix": earlier runs' answers (a file, glob or URL)
    # fsspec options for reading ``corpus`` (an object store's endpoint and credentials)
    corpus_options: dict | None = field(default=None, compare=False, hash=False, repr=False)
    ngram_min: int = 1
    ngram_max: int = 8
    # Low on purpose: where a slot is nearly free (batch 1 here) even a 10% draft pays, and where
    # it is not, the cost-aware allocation below withholds it anyway.
    accept_threshold: float = 0.1
    # A fresh request starts from the run's own acceptance so far (and from 2/3 before anything
    # was observed), worth this many observations of its own.
    prior_weight: float = 8.0
    initial_alpha: float = 2.0 / 3.0
    decay: float = 0.9  # weight of the past in the acceptance counts, per verification step
    probe_every: int = 16

    def __post_init__(self) -> None:
        if self.method not in ("ngram", "draft", "early-exit", "suffix"):
            raise ValueError(f"unknown speculative method {self.method!r} "
                             "(ngram, draft:MODEL, early-exit:K, suffix:ANSWERS)")
        if self.max_len < 1:
            raise ValueError(f"spec max_len must be >= 1, got {self.max_len}")
        if self.method == "draft" and not self.draft_model:
            raise ValueError("--spec draft:MODEL needs a model")
        if self.method == "suffix" and not self.corpus:
            raise ValueError("--spec suffix:ANSWERS needs earlier runs' answers (an output JSONL or results "
                             "Parquet: a file, glob or URL)")
        if self.method == "early-exit" and (self.exit_layer is None or self.exit_layer < 1):
            raise ValueError("--spec early-exit:K needs K >= 1 layers")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min}, {self.ngram_max}")
        if not 0.0 < self.accept_threshold < 1.0:
            raise ValueError(f"accept_threshold must be in (0, 1), got {self.accept_threshold}")

    @classmethod
    def parse(cls, text: str, max_len: int = 8, adaptive: bool = True,
              corpus_options: dict | None = None) -> "SpecConfig":
        """``ngram``, ``draft:MODEL``, ``early-exit:K`` or ``suffix:ANSWERS`` (the command line's
        ``--spec``); ``corpus_options``: fsspec options for reading ANSWERS."""
        method, _, arg = text.partition(":")
        if method == "ngram" and not arg:
            return cls("ngram", max_len, adaptive)
        if method == "draft":
            return cls("draft", max_len, adaptive, draft_model=arg or None)
        if method == "suffix":
            return cls("suffix", max_len, adaptive, corpus=arg or None, corpus_options=corpus_options)
        if method == "early-exit":
            try:
                layers = int(arg)
            except ValueError:
                raise ValueError(f"--spec early-exit:K needs an integer K, got {arg!r}") from None
            return cls("early-exit", max_len, adaptive, exit_layer=layers)
        raise ValueError(f"unknown --spec {text!r} (use ngram, draft:MODEL, early-exit:K or suffix:ANSWERS)")


@dataclass(frozen=True)
class DraftOutlook:
    """What a drafter can offer a request this step, asked before slots are granted."""

    available: int  # most tokens it can propose (0: nothing to propose)
    evidence: int = 0  # how strong its reason is (the n-gram match length; 0 for model drafters)


Outlook = Callable[[Sequence, int], DraftOutlook]


@dataclass
class Acceptance:
    """Decayed counts, per draft position, of how often it was reached and how often kept."""

    reached: list[float] = field(default_factory=list)
    kept: list[float] = field(default_factory=list)

    def add(self, drafted: int, accepted: int, decay: float) -> None:
        # Position j (0-based) is reached when drafted and every earlier draft was kept.
        reached = min(drafted, accepted + 1)
        while len(self.reached) < drafted:
            self.reached.append(0.0)
            self.kept.append(0.0)
        for j in range(len(self.reached)):
            self.reached[j] *= decay
            self.kept[j] *= decay
        for j in range(reached):
            self.reached[j] += 1.0
            if j < accepted:
                self.kept[j] += 1.0

    def rate(self, j: int, prior: float, weight: float) -> float:
        """Chance position ``j`` is kept given it is reached, ``weight`` pseudo-counts of ``prior``."""
        reached = self.reached[j] if j < len(self.reached) else 0.0
        kept = self.kept[j] if j < len(self.kept) else 0.0
        return (kept + weight * prior) / (reached + weight)


@dataclass
class StepCostModel:
    """Seconds of a target pass over ``tokens`` tokens (with the sampling and verification after
    it), plus ``per_draft`` seconds of drafter time per draft slot offered, learned from
    decode-only steps.

    Two parts. A table of measured step times per token count (decayed means) answers for sizes
    the engine has run; between two measured sizes it interpolates. The curve is not a line on a
    CPU: going from 1 to 2 rows switches BLAS from matrix-vector to matrix-matrix kernels and costs
    more than the next several rows together, which is why the table, not the line, decides.
    Elsewhere a line ``fixed + per_token * tokens`` (decayed least squares over every step, with
    a prior that a pass of ``prior_break_even`` tokens costs twice a one-token pass) extends the
    nearest measurement.

    Steps that verified drafts are measured apart (``drafted_table``): at the same token count
    they cost more than steps without (the verifier's work, and on the CPU the batch leaves the
    fused decode path), so a draft slot is priced at what a drafted step of that size measured.
    Until one was measured, drafted steps are priced as plain ones (drafting is tried, then
    learned).
    """

    prior_break_even: float = 16.0
    decay: float = 0.98
    fixed: float = 1.0
    per_token: float = 1.0 / 16.0
    per_draft: float = 0.0
    table: dict[int, float] = field(default_factory=dict)  # tokens -> decayed mean seconds
    drafted_table: dict[int, float] = field(default_factory=dict)  # the same, steps that verified drafts
    _n: float = 0.0
    _st: float = 0.0
    _stt: float = 0.0
    _sy: float = 0.0
    _sty: float = 0.0
    _draft_s: float = 0.0
    _drafted: float = 0.0
    # Prices age. A size's plain price is measured again once it is this many observed steps old
    # (while most steps draft, the plain table would keep what an early, perhaps busier, moment
    # measured, and every draft be weighed against it: :meth:`stale`); a drafted price that old
    # is no longer used (drafted steps at that size are priced as plain ones, so they are tried
    # and measured again: only drafted steps measure drafted steps, and one dear pass would
    # otherwise stop drafting for good). A stale price is replaced by the next measurement.
    refresh_every: int = 64
    steps: int = 0
    measured_at: dict[tuple[bool, int], int] = field(default_factory=dict)  # (drafted, tokens) -> step
    _drafted_view: tuple[int, dict[int, float]] = (-1, {})

    def _fresh(self, drafted: bool, tokens: int) -> bool:
        at = self.measured_at.get((drafted, tokens))
        return at is None or self.steps - at < self.refresh_every  # (a price set by hand has no age)

    def _table(self, drafted: bool) -> dict[int, float]:
        if not drafted:
            return self.table
        if self._drafted_view[0] != self.steps:  # the allocation asks many sizes per step: once
            view = {t: v for t, v in self.drafted_table.items() if self._fresh(True, t)}
            self._drafted_view = (self.steps, view)
        return self._drafted_view[1] or self.table

    def step_time(self, tokens: int, drafted: bool = False) -> float:
        """Predicted seconds of a step of ``tokens`` tokens; ``drafted``: one that verifies drafts."""
        table = self._table(drafted)
        if tokens in table:
            return table[tokens]
        known = sorted(table)  # a step's allocation asks for every size it weighs: bisect, no scan
        at = bisect.bisect_left(known, tokens)
        lower = known[at - 1] if at > 0 else None
        upper = known[at] if at < len(known) else None
        if lower is not None and upper is not None:
            w = (tokens - lower) / (upper - lower)
            return (1 - w) * table[lower] + w * table[upper]
        anchor = lower if lower is not None else upper
        if anchor is None:
            return self.fixed + self.per_token * tokens
        return max(table[anchor] + self.per_token * (tokens - anchor), 1e-9)

    def stale(self, tokens: int) -> bool:
        """Whether a plain step of ``tokens`` tokens was last measured ``refresh_every`` steps
        ago or more (or never, once drafted steps were measured): the next such step should
        then run plain, to measure it again."""
        if not self.drafted_table:
            return False
        if (False, tokens) not in self.measured_at:
            return tokens not in self.table
        return not self._fresh(False, tokens)

    def observe(self, tokens: int, target_s: float, drafted: int, draft_s: float, verified: bool = False) -> None:
        """One decode-only step: ``tokens`` tokens in ``target_s`` seconds, ``drafted`` draft slots
        offered to the drafter in ``draft_s`` seconds; ``verified``: the step verified drafts."""
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
        key = (verified, tokens)
        stale = key in self.measured_at and not self._fresh(verified, tokens)
        self.steps += 1
        self.measured_at[key] = self.steps
        table = self.drafted_table if verified else self.table
        old = table.get(tokens)
        table[tokens] = target_s if old is None or stale else 0.8 * old + 0.2 * target_s
        if drafted:  # a step that offered no slot says nothing of a slot's price: both sums wait
            # (fed and decayed on every step, the slots' sum decayed towards 0 while the time of
            # empty calls kept coming, and the price of a slot grew without bound: no draft again)
            self._draft_s = d * self._draft_s + draft_s
            self._drafted = d * self._drafted + drafted
            self.per_draft = self._draft_s / self._drafted

    def _add(self, t: float, y: float, w: float) -> None:
        self._n += w
        self._st += w * t
        self._stt += w * t * t
        self._sy += w * y
        self._sty += w * t * y


def self_contained(seq: Sequence) -> bool:
    """A seeded sampled request. Its draws depend on how many drafts each step had (rejection
    sampling consumes its random stream per draft), so to stay reproducible whatever runs beside
    it, its draft lengths come from its own history alone and are not traded in a step's
    allocation. Greedy output never depends on draft lengths. (The scheduler still cuts draft
    slots when a step's token budget or the KV cache runs short: then neighbours do matter.)"""
    return seq.generator is not None and not seq.sampling.greedy


def _survivals(rates: list[float]) -> list[float]:
    out, s = [], 1.0
    for r in rates:
        s *= r
        out.append(s)
    return out


@dataclass
class SpecController:
    config: SpecConfig
    cost: StepCostModel = field(default_factory=StepCostModel)
    states: dict[int, dict[int, Acceptance]] = field(default_factory=dict)  # request -> evidence -> counts
    by_evidence: dict[int, Acceptance] = field(default_factory=dict)  # the whole run's, per evidence
    overall: Acceptance = field(default_factory=Acceptance)  # the whole run's decayed counts
    idle: dict[int, int] = field(default_factory=dict)  # request -> steps since it last drafted
    planned: dict[int, int] = field(default_factory=dict)  # request -> evidence of this step's draft

    def rates(self, seq: Sequence, evidence: int | None = None,
              priors: dict[int, list[float]] | None = None) -> list[float]:
        """``p_1 .. p_max_len`` for the request's draft with this evidence (default: the one
        planned this step): its own counts, shrunk towards the run's for that evidence, shrunk
        towards the run's over all drafts, shrunk towards ``initial_alpha``. ``priors``: the
        run's rates per evidence, filled as met (a step's plan shares them across its rows)."""
        c, w = self.config, self.config.prior_weight
        ev = self.planned.get(seq.seq_id, 0) if evidence is None else evidence
        own = self.states.get(seq.seq_id, {}).get(ev)
        if self_contained(seq):
            own = own or Acceptance()
            return [own.rate(j, c.initial_alpha, w) for j in range(c.max_len)]
        prior = priors.get(ev) if priors is not None else None
        if prior is None:
            run = self.by_evidence.get(ev) or Acceptance()
            g = self.overall
            prior = [run.rate(j, g.rate(j, c.initial_alpha, w), w) for j in range(c.max_len)]
            if priors is not None:
                priors[ev] = prior
        if own is None:
            return list(prior)
        return [own.rate(j, prior[j], w) for j in range(c.max_len)]

    def alpha(self, seq: Sequence) -> float:
        """The chance the request's first draft is kept (model drafters scale it by confidence)."""
        return self.rates(seq)[0]

    def length(self, seq: Sequence, rates: list[float] | None = None) -> int:
        """The longest draft whose survival stays at or above the threshold (``max_len`` when
        not adaptive), or 1 when it is time to probe a request that has stopped drafting."""
        c = self.config
        if not c.adaptive:
            return c.max_len
        rates = rates if rates is not None else self.rates(seq)
        k, survival = 0, 1.0
        while k < c.max_len and survival * rates[k] >= c.accept_threshold:
            survival *= rates[k]
            k += 1
        return k if k else self._probe(seq)

    def _probe(self, seq: Sequence) -> int:
        return 1 if self.idle.get(seq.seq_id, 0) + 1 >= self.config.probe_every else 0

    def plan(self, running: list[Sequence], max_model_len: int, outlook: Outlook | None = None) -> None:
        """Set ``num_lookahead`` on every running request (0 for those still prefilling);
        ``outlook`` tells what the drafter has for a request (default: ``max_len`` tokens)."""
        c = self.config
        decoding: list[tuple[Sequence, int, list[float]]] = []
        priors: dict[int, list[float]] = {}
        for seq in running:
            seq.num_lookahead = 0
        # Where no draft could pay this step, only the rows whose probe is due are looked up (the
        # drafter's lookups are a measurable share of a large batch's step): how estimates recover.
        hopeless = c.adaptive and not self._could_pay(running)
        for seq in running:
            if seq.prefill_only or seq.num_pending_tokens != 1 or (hopeless and not self._probe(seq)):
                continue
            look = outlook(seq, c.max_len) if outlook is not None else DraftOutlook(c.max_len)
            self.planned[seq.seq_id] = look.evidence
            room_out = seq.sampling.max_tokens - seq.num_output_tokens - 1
            room_ctx = max_model_len - seq.num_tokens - 1
            rates = self.rates(seq, look.evidence, priors) if c.adaptive else []
            cap = max(0, min(self.length(seq, rates), room_out, room_ctx, look.available))
            decoding.append((seq, cap, rates))
        if not c.adaptive:
            for seq, cap, _ in decoding:
                seq.num_lookahead = cap
            return
        self._allocate(decoding)

    def _could_pay(self, running: list[Sequence]) -> bool:
        """Whether some draft slot could raise this step's tokens per second, were every draft as
        likely kept as the best kind of draft seen so far (the drafted steps' measured cost, the
        drafter's time per slot). Where none could (a compute-bound batch whose drafts were seen
        failing), the step skips the drafter's lookups: on a large batch of a small model they are
        a measurable share of the step (its rows whose probe is due are still looked up). Seeded
        sampled rows draft by their own history: always looked up."""
        c, cost = self.config, self.cost
        rows = [s for s in running if not s.prefill_only and s.num_pending_tokens == 1]
        if not rows or any(self_contained(s) for s in rows):
            return bool(rows)
        w = c.prior_weight
        base = self.overall.rate(0, c.initial_alpha, w)
        best = max((a.rate(0, base, w) for a in self.by_evidence.values()), default=base)
        n = len(rows)
        plain = n / cost.step_time(n)
        gain, survival = 0.0, 1.0
        for depth in range(c.max_len):  # the best m slots: every row's first, then every row's second, ...
            survival *= best
            for m in range(depth * n + 1, (depth + 1) * n + 1):
                gain += survival
                if (n + gain) / (cost.step_time(n + m, True) + cost.per_draft * m) > plain:
                    return True
        return False

    def _allocate(self, decoding: list[tuple[Sequence, int, list[float]]]) -> None:
        """Grant draft slots to maximise expected tokens per second of the step.

        Slots are ranked by the chance the draft in them is kept (a request's j-th slot:
        ``p_1 * ... * p_j``); the step then takes the best-ranked m slots for the m that
        maximises (expected tokens) / (pass time at that size + drafter time), searching every
        m, since the cost curve has steps a one-slot-at-a-time rule would never climb."""
        cost = self.cost
        tokens = len(decoding)
        expected = float(tokens)  # tokens this step is expected to emit
        drafts = 0
        heap: list[tuple[float, int]] = []
        probes: list[Sequence] = []
        for i, (seq, cap, rates) in enumerate(decoding):
            if cap > 0 and self_contained(seq):
                seq.num_lookahead = cap  # its own history decides, never its neighbours
                tokens, drafts = tokens + cap, drafts + cap
                expected += sum(_survivals(rates[:cap]))
            elif cap > 0 and rates[0] < self.config.accept_threshold:
                probes.append(seq)  # how a stopped estimate recovers: granted below, if cheap enough
            elif cap > 0:
                heapq.heappush(heap, (-rates[0], i))
        if drafts == 0 and cost.stale(tokens):
            return  # a plain step, to price this size afresh: the drafts below are weighed against it
        ranked: list[tuple[float, int]] = []
        granted = [0] * len(decoding)
        while heap:
            neg_gain, i = heapq.heappop(heap)
            ranked.append((-neg_gain, i))
            granted[i] += 1
            _, cap, rates = decoding[i]
            if granted[i] < cap:
                heapq.heappush(heap, (neg_gain * rates[granted[i]], i))
        best_m, best_rate, gain = 0, expected / (cost.step_time(tokens, drafts > 0) + cost.per_draft * drafts), 0.0
        for m, (g, _) in enumerate(ranked, start=1):
            gain += g
            rate = (expected + gain) / (cost.step_time(tokens + m, True) + cost.per_draft * (drafts + m))
            if rate > best_rate:
                best_m, best_rate = m, rate
        for _, i in ranked[:best_m]:
            decoding[i][0].num_lookahead += 1
        if probes and (drafts + best_m > 0 or cost.step_time(tokens + len(probes), True)
                       <= (1.0 + PROBE_SURCHARGE) * cost.step_time(tokens)):
            for seq in probes:
                seq.num_lookahead = 1

    def observe_step(self, tokens: int, target_s: float, slots: int, draft_s: float, drafted: bool = False) -> None:
        """Feed the cost model one decode-only step (``slots``: draft slots offered to the drafter;
        ``drafted``: the step verified drafts)."""
        self.cost.observe(tokens, target_s, slots, draft_s, drafted)

    def observe(self, seq: Sequence, drafted: int, accepted: int) -> None:
        if drafted == 0:
            self.idle[seq.seq_id] = self.idle.get(seq.seq_id, 0) + 1
            return
        self.idle[seq.seq_id] = 0
        ev = self.planned.get(seq.seq_id, 0)
        self.states.setdefault(seq.seq_id, {}).setdefault(ev, Acceptance()).add(drafted, accepted, self.config.decay)
        self.by_evidence.setdefault(ev, Acceptance()).add(drafted, accepted, 0.99)
        self.overall.add(drafted, accepted, 0.99)

    def release(self, seq: Sequence) -> None:
        for table in (self.states, self.idle, self.planned):
            table.pop(seq.seq_id, None)
