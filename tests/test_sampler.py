"""Sampling filters and per-request generators."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbatch.engine.runtime.sampler import filter_logits, sample, top_logprobs
from kvbatch.engine.runtime.sampling_params import SamplingParams
from tests.chi_square import chi_square_p


def _logits(seed: int, v: int = 50) -> torch.Tensor:
    return torch.randn(v, generator=torch.Generator().manual_seed(seed)) * 3


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 10_000))
def test_degenerate_filters_equal_greedy(seed):
    logits = _logits(seed)
    best = int(torch.argmax(logits))
    g = torch.Generator().manual_seed(seed)
    for p in (SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=1.0, top_p=1e-6),
              SamplingParams(temperature=1.0, min_p=1.0)):
        assert sample(logits[None], [p], [g]) == [best]


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 49), st.floats(0.05, 0.99), st.floats(0.0, 0.9))
def test_filters_keep_exactly_the_allowed_tokens(seed, k, top_p, min_p):
    logits = _logits(seed)
    kept = torch.isfinite(filter_logits(logits, SamplingParams(top_k=k))).sum()
    assert kept == k
    probs = logits.softmax(-1)
    out = filter_logits(logits, SamplingParams(top_p=top_p))
    keep = torch.isfinite(out)
    # The kept set is the smallest head of the sorted distribution reaching top_p.
    assert probs[keep].sum() >= top_p - 1e-6
    assert probs[keep].sum() - probs[keep].min() < top_p + 1e-6
    out = filter_logits(logits, SamplingParams(min_p=min_p))
    assert torch.equal(torch.isfinite(out), probs >= min_p * probs.max())


# Spread so that temperature moves the top-p cut: at T=0.5 top_p=0.8 keeps 2 tokens, at T=1 3.
TEMPERED_LOGITS = [2.0, 1.2, 0.8, 0.0, -0.5, -1.5]
DRAWS = 2000


def _target(logits: list[float], temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """What the sampler must draw from, worked out in plain float64 Python (not the engine's
    code): softmax(logits / T), cut to the k most likely, then to the smallest most-likely head
    whose mass reaches top_p, renormalised."""
    scaled = [x / temperature for x in logits]
    weights = [math.exp(v - max(scaled)) for v in scaled]
    probs = [w / sum(weights) for w in weights]
    order = sorted(range(len(probs)), key=lambda i: -probs[i])[: top_k or None]
    kept, mass = [], sum(probs[i] for i in order)
    for i in order:
        if sum(probs[j] for j in kept) / mass >= top_p:
            break
        kept.append(i)
    out = torch.zeros(len(logits), dtype=torch.float64)
    for i in kept:
        out[i] = probs[i] / sum(probs[j] for j in kept)
    return out


def _counts(tokens: list[int], vocab: int) -> torch.Tensor:
    return torch.bincount(torch.tensor(tokens), minlength=vocab).double()


def _engine_draws(temperature: float, top_k: int, top_p: float, seed: int) -> torch.Tensor:
    """DRAWS tokens from the engine's sampler, one seeded request per row (as the engine runs)."""
    logits = torch.tensor(TEMPERED_LOGITS).expand(DRAWS, -1)
    p = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    gens = [torch.Generator().manual_seed(seed * DRAWS + i) for i in range(DRAWS)]
    return _counts(sample(logits, [p] * DRAWS, gens), len(TEMPERED_LOGITS))


FILTERS = [(0, 1.0), (3, 1.0), (0, 0.8), (4, 0.8)]  # (top_k, top_p); at T=1.7 the last keeps 3, either alone 4


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0)] + [(t, k, p) for t in (0.5, 1.7)
                                                                        for k, p in FILTERS])
def test_sampling_follows_softmax_of_logits_over_t(temperature, top_k, top_p):
    want = _target(TEMPERED_LOGITS, temperature, top_k, top_p)
    assert int((want > 0).sum()) >= 2  # a one-token target would pass any sampler
    assert chi_square_p(_engine_draws(temperature, top_k, top_p, seed=1), want) > 1e-3


def test_the_tempered_distribution_test_catches_biased_samplers():
    """The same test on samplers with classic temperature bugs must fail, or it proves nothing."""
    logits = torch.tensor(TEMPERED_LOGITS)
    g = torch.Generator().manual_seed(2)

    def draws(probs: torch.Tensor) -> torch.Tensor:
        return _counts(torch.multinomial(probs, DRAWS, replacement=True, generator=g).tolist(), len(probs))

    for t, top_p in ((0.5, 1.0), (1.7, 1.0), (0.5, 0.8)):
        want = _target(TEMPERED_LOGITS, t, top_p=top_p)
        # Temperature ignored (T=1 whatever was asked).
        ignored = filter_logits(logits, SamplingParams(temperature=1.0, top_p=top_p)).softmax(-1)
        assert chi_square_p(draws(ignored), want) < 1e-6, (t, top_p)
        # Temperature multiplied in instead of divided by.
        inverted = filter_logits(logits, SamplingParams(temperature=1 / t, top_p=top_p)).softmax(-1)
        assert chi_square_p(draws(inverted), want) < 1e-6, (t, top_p)
    # Top-p cut on the untempered distribution, temperature applied after: keeps a third token.
    late = (filter_logits(logits, SamplingParams(temperature=1.0, top_p=0.8)) / 0.5).softmax(-1)
    assert chi_square_p(draws(late), _target(TEMPERED_LOGITS, 0.5, top_p=0.8)) < 1e-6


def test_seeded_rows_ignore_their_neighbours():
    logits = torch.randn(3, 100)
    p = SamplingParams(temperature=0.9, seed=5)
    alone = sample(logits[1:2], [p], [torch.Generator().manual_seed(5)])
    batched = sample(logits, [SamplingParams(temperature=0), p, SamplingParams(temperature=1.3)],
                     [None, torch.Generator().manual_seed(5), torch.Generator().manual_seed(9)])
    assert batched[1] == alone[0]


def test_logprobs_are_the_model_distribution():
    logits = torch.tensor([1.0, 3.0, 0.5])
    entry = top_logprobs(logits, 1, 2)
    lp = logits.log_softmax(-1)
    assert abs(entry["logprob"] - float(lp[1])) < 1e-6
    assert [t for t, _ in entry["top"]] == [1, 0]
