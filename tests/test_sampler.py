"""Sampling filters and per-request generators."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kvbatch.engine.runtime.sampler import filter_logits, sample, top_logprobs
from kvbatch.engine.runtime.sampling_params import SamplingParams


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


def test_sampling_follows_the_distribution():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    p = SamplingParams(temperature=1.0)
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(4)
    n = 20_000
    for _ in range(n):
        counts[sample(logits[None], [p], [g])[0]] += 1
    expected = logits.softmax(-1) * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 16.3  # p = 0.001 for 3 degrees of freedom


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
