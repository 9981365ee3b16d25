"""Pearson's chi-square goodness-of-fit test, for the tests that check a sampler against the
distribution it should draw from (tests/test_sampler.py, tests/test_speculative.py)."""

from __future__ import annotations

import torch


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of Pearson's chi-square test of ``counts`` against ``probs`` (cells with
    expected count < 5 are pooled, as the test requires). A draw in a cell of probability 0
    (a token the filters removed) is impossible under ``probs``: the p-value is then 0."""
    if float(counts[probs <= 0].sum()) > 0:
        return 0.0
    n = float(counts.sum())
    expected = probs.double() * n
    small = expected < 5
    obs = torch.cat([counts[~small].double(), counts[small].double().sum().view(1)])
    exp = torch.cat([expected[~small], expected[small].sum().view(1)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = float(((obs - exp) ** 2 / exp).sum())
    df = obs.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))
