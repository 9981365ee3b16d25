"""Drafters: cheap proposals of the next few tokens, verified afterwards by the target.

- :class:`NgramDrafter` (prompt lookup): find the most recent earlier occurrence of the
  sequence's last n tokens (longest n first) and propose what followed it. Free to run, and
  right often when the output copies from the input (summaries, edits, extraction); the
  longer the match, the likelier (its ``outlook`` tells the controller n before slots are granted).
- :class:`SuffixDrafter` (drafts from last night): earlier runs' answers, indexed by
  ``suffix.py``, beside prompt lookup; per request the longer match proposes.
- :class:`EarlyExitDrafter` (self-speculation): the target's first K layers and its head. It
  writes those layers' K/V into the target's own cache slots, which the verification pass
  then overwrites, so there is no second cache to keep in sync.
- :class:`DraftModelDrafter`: a smaller model with the same tokenizer and its own paged cache.
  Each request has a shadow sequence in the draft's block manager; after verification the
  shadow is cut back to the accepted tokens, so draft and target never disagree about history.

Model drafters sample their proposals from the same filtered distribution the target uses
(greedy requests take the argmax) and return it, since rejection sampling needs ``q``. In
adaptive mode they stop early when the estimated chance that the next draft survives falls
below the threshold. A token's acceptance estimate is the request's observed acceptance rate
scaled by how confident the drafter is in this token relative to its average confidence for
the request (raw draft probabilities are badly calibrated across models: a draft that copies
the target well can still spread its mass thinly), and the estimates multiply along the draft.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from kvbatch.engine.runtime.model_runner import ModelRunner, WorkItem
from kvbatch.engine.runtime.sampler import filter_logits
from kvbatch.engine.runtime.sampling_params import SamplingParams
from kvbatch.engine.runtime.sequence import Sequence
from kvbatch.engine.speculative.controller import LAST_NIGHT, DraftOutlook
from kvbatch.engine.speculative.suffix import CORPUS_EVIDENCE, MAX_PATTERN, SuffixIndex, read_corpus


@dataclass
class DraftRequest:
    seq: Sequence
    max_len: int  # draft slots reserved for this request this step (>= 1)
    alpha: float = 1.0  # the request's estimated per-token acceptance rate so far


@dataclass
class Draft:
    tokens: list[int]
    probs: torch.Tensor | None = None  # [len(tokens), V] draft distributions; None: deterministic


class Drafter(Protocol):
    """What the engine calls, in this order, each step of a speculative run."""

    deterministic: bool  # proposals carry no distribution (q is one-hot on the proposal)

    def outlook(self, seq: Sequence, max_len: int) -> DraftOutlook:
        """Before slots are granted, for each decoding request: how much it could propose."""

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        """After scheduling: at most ``max_len`` tokens for each request (fewer is fine)."""

    def after_verify(self, seq: Sequence, num_tokens_before: int, accepted: int) -> None:
        """After verification: ``accepted`` drafts were kept; roll any own state back to them."""

    def release(self, seq: Sequence) -> None:
        """The request finished or was dropped: forget it."""


class NgramDrafter:
    """Prompt lookup. The match length is the evidence: measured on SmolLM2 copy tasks, the
    first proposed token is kept 30% of the time after a 1-token match, 60% after 2, 80% after
    4 and 95% after 8 or more, so the controller keeps acceptance figures per match length."""

    deterministic = True

    def __init__(self, min_n: int = 1, max_n: int = 8):
        self.min_n, self.max_n = min_n, max_n
        # seq -> (its num_tokens, tokens asked for, match length, continuation) of the last lookup
        self._found: dict[int, tuple[int, int, int, list[int]]] = {}

    def outlook(self, seq: Sequence, max_len: int) -> DraftOutlook:
        n, tokens = self._lookup_once(seq, max_len)
        return DraftOutlook(len(tokens), n)

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        return [Draft(self._lookup_once(r.seq, r.max_len)[1][:r.max_len]) for r in requests]

    def _lookup_once(self, seq: Sequence, k: int) -> tuple[int, list[int]]:
        """The match for the sequence as it stands, computed once per step (outlook, then propose)."""
        hit = self._found.get(seq.seq_id)
        if hit is None or hit[0] != seq.num_tokens or hit[1] < k:
            n, tokens = self.match(seq.token_ids, k)
            hit = (seq.num_tokens, k, n, tokens)
            self._found[seq.seq_id] = hit
        return hit[2], hit[3]

    def after_verify(self, seq: Sequence, num_tokens_before: int, accepted: int) -> None:
        pass

    def release(self, seq: Sequence) -> None:
        self._found.pop(seq.seq_id, None)

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the longest
        matching suffix (``max_n`` down to ``min_n`` tokens long); [] when nothing matches."""
        return self.match(tokens, k)[1]

    def match(self, tokens: list[int], k: int) -> tuple[int, list[int]]:
        """(match length, continuation) of :meth:`lookup`; (0, []) when nothing matches.

        Grows the match from the last token backwards over the positions that still agree, so
        the cost is one pass over the history plus the (few) candidates, not one per length."""
        size = len(tokens)
        if size <= self.min_n:
            return 0, []
        arr = np.asarray(tokens, dtype=np.int64)
        ends = np.flatnonzero(arr[:-1] == arr[-1])  # earlier positions holding the last token
        n = 1 if ends.size else 0
        while ends.size and n < self.max_n:
            longer = ends[ends >= n]
            longer = longer[arr[longer - n] == arr[size - 1 - n]]
            if not longer.size:
                break
            ends, n = longer, n + 1
        if n < self.min_n:
            return 0, []
        start = int(ends[-1]) + 1
        return n, arr[start:start + k].tolist()


@dataclass
class _SuffixLookup:
    """A request's last lookup: the match for its tokens as they stood at ``num_tokens``."""

    num_tokens: int
    asked: int  # tokens asked for
    evidence: int  # the winning source's match length (the corpus's offset by CORPUS_EVIDENCE)
    tokens: list[int] | None  # the proposal; None while the corpus's continuation is not walked
    # the corpus match (n, lo, hi) and prompt lookup's (n, tokens), kept until the walk
    corpus: tuple[int, int, int] | None = None
    ngram: tuple[int, list[int]] | None = None


class SuffixDrafter:
    """Drafts from earlier runs' answers (``suffix.py``) beside prompt lookup; per request, per
    step, the longer match proposes (ties: the corpus, whose continuation is the most frequent of
    all its occurrences). The two report their match lengths as different evidence (the corpus's
    offset by ``CORPUS_EVIDENCE``), so the controller learns each source's acceptance apart."""

    deterministic = True

    def __init__(self, index: SuffixIndex, ngram: NgramDrafter, max_pattern: int = MAX_PATTERN) -> None:
        self.index = index
        self.ngram = ngram  # a NgramDrafter: prompt lookup over the request's own tokens
        self.max_pattern = max_pattern
        self._found: dict[int, _SuffixLookup] = {}  # seq -> its last lookup
        self.corpus_drafts = 0  # proposals that came from the corpus (the rest from the prompt)

    def _lookup_once(self, seq: Sequence, k: int) -> tuple[int, list[int] | None]:
        """(evidence, proposal) of the request's latest tokens; the proposal is None where the
        corpus matched longer and its continuation is not walked yet (:meth:`_walk`): the outlook
        of every row needs the match lengths only, and most rows of a large batch get no slot."""
        hit = self._found.get(seq.seq_id)
        if hit is None or hit.num_tokens != seq.num_tokens or hit.asked < k:
            tokens = seq.token_ids
            ngram_n, ngram_tokens = self.ngram.match(tokens, k)
            n, lo, hi = self.index.longest_match(tokens, self.max_pattern)
            if n and n >= ngram_n:
                hit = _SuffixLookup(seq.num_tokens, k, CORPUS_EVIDENCE + n, None, (n, lo, hi), (ngram_n, ngram_tokens))
            else:
                hit = _SuffixLookup(seq.num_tokens, k, ngram_n, ngram_tokens)
            self._found[seq.seq_id] = hit
        return hit.evidence, hit.tokens

    def _walk(self, seq: Sequence) -> tuple[int, list[int]]:
        """The proposal of the request's last lookup, the corpus's continuation walked now; where
        the corpus has none (the answer ended there), prompt lookup's."""
        hit = self._found[seq.seq_id]
        if hit.tokens is None:
            assert hit.corpus is not None and hit.ngram is not None
            hit.tokens = self.index.continuation(*hit.corpus, hit.asked)
            if not hit.tokens:
                hit.evidence, hit.tokens = hit.ngram
            hit.corpus = hit.ngram = None
        return hit.evidence, hit.tokens

    def outlook(self, seq: Sequence, max_len: int) -> DraftOutlook:
        # A corpus match offers up to max_len tokens (its continuation, walked if a slot is granted,
        # may be shorter: the step then shrinks to what was proposed).
        evidence, tokens = self._lookup_once(seq, max_len)
        return DraftOutlook(max_len if tokens is None else len(tokens), evidence)

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        drafts = []
        for r in requests:
            self._lookup_once(r.seq, r.max_len)
            evidence, tokens = self._walk(r.seq)
            if evidence >= CORPUS_EVIDENCE and tokens:
                self.corpus_drafts += 1
            drafts.append(Draft(tokens[:r.max_len]))
        return drafts

    def after_verify(self, seq: Sequence, num_tokens_before: int, accepted: int) -> None:
        pass

    def release(self, seq: Sequence) -> None:
        self._found.pop(seq.seq_id, None)


class _ModelDrafter:
    """Shared by the two model drafters: pick a token from draft logits, track confidence."""

    deterministic = False

    def __init__(self, threshold: float | None):
        self.threshold = threshold  # None: draft every reserved slot (fixed length)
        self._generators: dict[int, torch.Generator] = {}
        self._mean_conf: dict[int, float] = {}  # per request: decayed mean draft confidence

    def _generator(self, seq: Sequence) -> torch.Generator | None:
        if seq.generator is None:
            return None
        gen = self._generators.get(seq.seq_id)
        if gen is None:
            # The draft's own stream, derived from the request's seed: seeded requests stay
            # reproducible and the target's stream is never consumed by drafting.
            gen = torch.Generator().manual_seed((seq.generator.initial_seed() * 6364136223846793005 + 1) % 2**63)
            self._generators[seq.seq_id] = gen
        return gen

    def _pick(self, logits: torch.Tensor, p: SamplingParams, seq: Sequence) -> tuple[int, torch.Tensor, float]:
        """(token, q row, confidence) from one row of draft logits."""
        if p.greedy:
            q = logits.softmax(-1)
            tok = int(torch.argmax(logits))
            return tok, q, float(q[tok])
        q = filter_logits(logits, p).softmax(-1)
        noise = torch.empty_like(q).exponential_(generator=self._generator(seq))
        tok = int(torch.argmax(q / noise))
        return tok, q, float(q[tok])

    def outlook(self, seq: Sequence, max_len: int) -> DraftOutlook:
        return DraftOutlook(max_len)  # a model can always propose; its evidence is per token

    def release(self, seq: Sequence) -> None:
        self._generators.pop(seq.seq_id, None)
        self._mean_conf.pop(seq.seq_id, None)

    def _survival(self, req: DraftRequest, confidence: float) -> float:
        """Estimated probability that a draft with this confidence is accepted."""
        mean = self._mean_conf.get(req.seq.seq_id, confidence)
        self._mean_conf[req.seq.seq_id] = 0.9 * mean + 0.1 * confidence
        return min(1.0, req.alpha * confidence / max(mean, 1e-9))

    def _draft_loop(self, requests: list[DraftRequest], first: list[WorkItem], runner: ModelRunner,
                    num_layers: int | None, vocab: int) -> list[Draft]:
        """Autoregressive drafting: ``first`` computes what each request still lacks and gives
        its first draft; then one token per request per pass until its slots or confidence run out."""
        tokens: list[list[int]] = [[] for _ in requests]
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        conf = [1.0] * len(requests)
        active = list(range(len(requests)))
        items = first
        while active:
            logits, order = runner.run([items[i] for i in range(len(active))], num_layers)
            row_of = {item_idx: row for row, item_idx in enumerate(order)}
            still: list[int] = []
            next_items: list[WorkItem] = []
            for j, r in enumerate(active):
                req = requests[r]
                tok, q, c = self._pick(logits[row_of[j]], req.seq.sampling, req.seq)
                if self.threshold is not None:
                    conf[r] *= self._survival(req, c)
                    if conf[r] < self.threshold:
                        continue
                tokens[r].append(tok)
                probs[r].append(_fit(q, vocab))
                if len(tokens[r]) < req.max_len:
                    it = items[j]
                    pos = it.start + len(it.tokens)
                    table, window_table = self._tables(req.seq)
                    next_items.append(WorkItem([tok], pos, table, 1, window_table))
                    still.append(r)
            active, items = still, next_items
        return [Draft(t, torch.stack(p) if p else None) for t, p in zip(tokens, probs)]

    def _tables(self, seq: Sequence) -> tuple[list[int], list[int] | None]:
        """The block table and the window table (None: no sliding layers) a draft of ``seq`` writes to."""
        raise NotImplementedError


def _fit(q: torch.Tensor, vocab: int) -> torch.Tensor:
    """A draft distribution over the target's vocabulary (padding rows differ between models)."""
    if q.shape[0] == vocab:
        return q
    if q.shape[0] > vocab:
        q = q[:vocab]
        return q / q.sum()
    return torch.cat([q, q.new_zeros(vocab - q.shape[0])])


class EarlyExitDrafter(_ModelDrafter):
    def __init__(self, runner: ModelRunner, exit_layer: int, threshold: float | None):
        super().__init__(threshold)
        layers = runner.model.config.num_layers
        if not 1 <= exit_layer < layers:
            raise ValueError(f"early-exit:{exit_layer} needs 1 <= K < {layers} (the model's layers)")
        self.runner, self.exit_layer = runner, exit_layer

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        if not requests:
            return []
        # The scheduler reserved the draft slots in each target block table already.
        first = [WorkItem([r.seq.token_ids[-1]], r.seq.num_tokens - 1, r.seq.block_table, 1, r.seq.window_table or None)
                 for r in requests]
        vocab = self.runner.model.config.vocab_size
        return self._draft_loop(requests, first, self.runner, self.exit_layer, vocab)

    def _tables(self, seq: Sequence) -> tuple[list[int], list[int] | None]:
        return seq.block_table, seq.window_table or None

    def after_verify(self, seq: Sequence, num_tokens_before: int, accepted: int) -> None:
        pass  # the verification pass overwrote every slot the drafter wrote


class DraftModelDrafter(_ModelDrafter):
    """``draft``: an :class:`~kvbatch.engine.runtime.llm.LLM` of the smaller model; only its runner and
    block manager are used, with one shadow sequence per target request."""

    def __init__(self, draft, target_vocab: int, threshold: float | None):
        super().__init__(threshold)
        self.draft = draft
        self.target_vocab = target_vocab
        self.shadows: dict[int, Sequence] = {}

    def _shadow(self, seq: Sequence) -> Sequence:
        sh = self.shadows.get(seq.seq_id)
        if sh is None:
            sh = Sequence(seq.seq_id, seq.request_id, list(seq.prompt_token_ids), seq.sampling)
            self.shadows[seq.seq_id] = sh
        sh.token_ids = list(seq.token_ids)
        return sh

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        bm = self.draft.block_manager
        ready: list[DraftRequest] = []
        first: list[WorkItem] = []
        for r in requests:
            sh = self._shadow(r.seq)
            # Slots for what the shadow has not computed yet plus the drafts it feeds back.
            if not sh.block_table:
                cached = bm.cached_prefix(sh)
                need = sh.num_tokens - len(cached) * bm.block_size + r.max_len - 1
                if not bm.can_allocate(sh, need, cached):
                    continue  # the draft cache is full: this request decodes without drafts
                bm.allocate(sh, need, cached)
            else:
                need = sh.num_tokens - sh.num_computed_tokens + r.max_len - 1
                if not bm.can_append(sh, need):
                    continue
                bm.append_slots(sh, need)
            start = sh.num_computed_tokens
            first.append(WorkItem(sh.token_ids[start:], start, sh.block_table, 1, sh.window_table or None))
            ready.append(r)
        drafts = self._draft_loop(ready, first, self.draft.runner, None, self.target_vocab) if ready else []
        by_seq = {r.seq.seq_id: d for r, d in zip(ready, drafts)}
        for r in ready:
            sh = self.shadows[r.seq.seq_id]
            # Everything but the last draft went through the draft model.
            sh.num_computed_tokens = sh.num_tokens + max(0, len(by_seq[r.seq.seq_id].tokens) - 1)
        return [by_seq.get(r.seq.seq_id, Draft([])) for r in requests]

    def _tables(self, seq: Sequence) -> tuple[list[int], list[int] | None]:
        sh = self.shadows[seq.seq_id]
        return sh.block_table, sh.window_table or None

    def after_verify(self, seq: Sequence, num_tokens_before: int, accepted: int) -> None:
        """Cut the shadow back to what the target kept: positions below ``num_tokens_before +
        accepted`` hold tokens the target accepted, anything later is a rejected draft."""
        sh = self.shadows.get(seq.seq_id)
        if sh is None:
            return
        sh.token_ids = list(seq.token_ids)
        sh.num_computed_tokens = min(sh.num_computed_tokens, num_tokens_before + accepted, sh.num_tokens - 1)
        bm = self.draft.block_manager
        bm.commit(sh)
        bm.trim(sh)

    def release(self, seq: Sequence) -> None:
        super().release(seq)
        sh = self.shadows.pop(seq.seq_id, None)
        if sh is not None:
            self.draft.block_manager.free(sh)


def build_drafter(config, target, draft_engine=None) -> Drafter:
    """The drafter a :class:`~kvbatch.engine.speculative.controller.SpecConfig` asks for, bound to the
    target ``LLM``. Method ``draft`` needs ``draft_engine``, the draft model's own ``LLM``: the
    target builds it (this module never builds engines, so it does not import the runtime that
    imports it); it must speak the target's tokenizer."""
    threshold = config.accept_threshold if config.adaptive else None
    if config.method == "ngram":
        return NgramDrafter(config.ngram_min, config.ngram_max)
    if config.method == "early-exit":
        return EarlyExitDrafter(target.runner, config.exit_layer, threshold)
    if config.method == "suffix":
        if config.corpus == LAST_NIGHT:
            raise ValueError(f"--spec suffix:{LAST_NIGHT} names a pipeline's own previous night, which its decode "
                             f"step resolves; elsewhere give the earlier answers: suffix:FILE_GLOB_OR_URL")
        index = read_corpus(config.corpus, target.tokenizer, config.corpus_options)
        return SuffixDrafter(index, NgramDrafter(config.ngram_min, config.ngram_max))
    if draft_engine is None:
        raise ValueError("speculative method 'draft' needs the draft model's engine")
    check_same_tokenizer(target, draft_engine)
    return DraftModelDrafter(draft_engine, target.model_config.vocab_size, threshold)


def check_same_tokenizer(target, draft) -> None:
    """Draft tokens are target tokens: refuse a draft model whose vocabulary differs."""
    t, d = target.tokenizer, draft.tokenizer
    if t is not None and d is not None:
        same = t.vocab_size == d.vocab_size and all(
            t.decode([i], skip_special_tokens=False) == d.decode([i], skip_special_tokens=False)
            for i in range(0, t.vocab_size, max(1, t.vocab_size // 512)))
    else:
        same = target.model_config.vocab_size == draft.model_config.vocab_size
    if not same:
        raise ValueError("the draft model's tokenizer differs from the target's: speculative decoding "
                         "needs the same vocabulary")
