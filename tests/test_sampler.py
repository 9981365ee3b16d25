"""Sampling filters and per-request generators."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbatch.engine.runtime.sampler import (
    Penalties,
    SamplingTensors,
    apply_penalties,
    filter_logits,
    filter_logits_batch,
    penalize_logits,
    sample,
    sample_batch,
    sample_on_device,
    top_logprobs,
)
from kvbatch.engine.runtime.sampling_params import SamplingParams
from tests.chi_square import chi_square_p
from tests.test_device_placement import CUDA, assert_same, cuda, host, on_cuda  # noqa: F401 (fixture)


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


# ------------------------------------------------------------------------- the batched path

ROW_PARAMS = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 0.5, 1.0, 1.7]),
    top_k=st.sampled_from([0, 1, 3, 20, 49, 50, 80]),
    top_p=st.sampled_from([1.0, 0.9, 0.5, 1e-6]),
    min_p=st.sampled_from([0.0, 0.05, 0.3]),
)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 10_000), st.lists(ROW_PARAMS, min_size=1, max_size=6))
def test_batched_filters_are_the_row_filters(seed, params):
    """Each row of the batched filter is :func:`filter_logits` of that row with its own
    parameters (greedy rows at temperature 1), whatever the other rows ask for."""
    logits = torch.stack([_logits(seed + i) for i in range(len(params))])
    t = SamplingTensors.build(params, [0.5] * len(params), logits.shape[1], logits.device)
    got = filter_logits_batch(logits, t)
    for i, p in enumerate(params):
        want = filter_logits(logits[i], SamplingParams(temperature=1.0) if p.greedy else p)
        assert torch.equal(torch.isfinite(got[i]), torch.isfinite(want)), (i, p)
        kept = torch.isfinite(want)
        assert torch.allclose(got[i][kept], want[kept], rtol=1e-6, atol=0), (i, p)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000), st.lists(ROW_PARAMS, min_size=2, max_size=6), st.data())
def test_a_seeded_row_ignores_its_batch(seed, params, data):
    """A row's token depends on its logits, parameters and generator only: moved to another
    place in another batch, with other neighbours, it samples the same token."""
    n = len(params)
    logits = torch.stack([_logits(seed + i) for i in range(n)])
    batched = sample(logits, params, [torch.Generator().manual_seed(seed + i) for i in range(n)])
    i = data.draw(st.integers(0, n - 1))
    others = data.draw(st.lists(ROW_PARAMS, min_size=0, max_size=3))
    rows = torch.stack([_logits(seed + 100 + j) for j in range(len(others))] + [logits[i]])
    gens = [torch.Generator().manual_seed(7 + j) for j in range(len(others))]
    gens.append(torch.Generator().manual_seed(seed + i))
    assert sample(rows, others + [params[i]], gens)[-1] == batched[i]


def test_each_sampled_token_draws_one_number_from_its_generator():
    """The stream advances once per sampled token (greedy rows draw nothing), so the verifier's
    later draws from the same generator continue where the sampler stopped."""
    logits = torch.randn(2, 50)
    g_sampled, g_greedy = torch.Generator().manual_seed(3), torch.Generator().manual_seed(4)
    sample(logits, [SamplingParams(temperature=0.9), SamplingParams(temperature=0)], [g_sampled, g_greedy])
    fresh_sampled, fresh_greedy = torch.Generator().manual_seed(3), torch.Generator().manual_seed(4)
    torch.rand((), dtype=torch.float64, generator=fresh_sampled)
    assert torch.equal(torch.rand(4, generator=g_sampled), torch.rand(4, generator=fresh_sampled))
    assert torch.equal(torch.rand(4, generator=g_greedy), torch.rand(4, generator=fresh_greedy))


def test_inverse_transform_picks_the_first_and_last_kept_tokens_at_the_ends():
    """u = 0 picks the first token the filters kept, u just under 1 the last: removed tokens have
    no width in the cumulative distribution, so no uniform reaches them."""
    logits = torch.tensor([[0.0, 5.0, -1.0, 4.0, 3.0, -2.0]] * 2)
    p = SamplingParams(temperature=1.0, top_k=3)  # keeps ids 1, 3, 4
    t = SamplingTensors.build([p, p], [0.0, 1.0 - 1e-12], 6, logits.device)
    assert sample_batch(logits, t).tolist() == [1, 4]


def _mixed_draws(seed: int) -> tuple[torch.Tensor, torch.Tensor, list, list]:
    """DRAWS rows alternating two parameter sets in one batch: each set's counts."""
    a = SamplingParams(temperature=0.5, top_p=0.8)
    b = SamplingParams(temperature=1.7, top_k=4, min_p=0.05)
    params = [a if i % 2 else b for i in range(2 * DRAWS)]
    logits = torch.tensor(TEMPERED_LOGITS).expand(len(params), -1)
    gens = [torch.Generator().manual_seed(seed * 2 * DRAWS + i) for i in range(len(params))]
    toks = sample(logits, params, gens)
    return _counts(toks[1::2], 6), _counts(toks[0::2], 6), toks[1::2], toks[0::2]


def _target_min_p(temperature: float, top_k: int, min_p: float) -> torch.Tensor:
    """softmax(logits / T) cut to the top k, then to tokens of at least min_p times the largest
    probability among those kept, renormalised (float64, not the engine's code)."""
    scaled = torch.tensor(TEMPERED_LOGITS, dtype=torch.float64) / temperature
    kth = scaled.sort(descending=True).values[top_k - 1]
    probs = torch.where(scaled >= kth, scaled.softmax(-1), 0.0)
    probs = probs / probs.sum()
    probs = torch.where(probs >= min_p * probs.max(), probs, 0.0)
    return probs / probs.sum()


def test_rows_with_different_parameters_each_follow_their_own_distribution():
    """One batch, two parameter sets interleaved: each set's draws pass the chi-square test
    against its own target, so no row borrows another's temperature or cuts."""
    counts_a, counts_b, _, _ = _mixed_draws(seed=3)
    want_a = _target(TEMPERED_LOGITS, 0.5, top_p=0.8)
    want_b = _target_min_p(1.7, 4, 0.05)
    assert int((want_b > 0).sum()) >= 3
    assert chi_square_p(counts_a, want_a) > 1e-3
    assert chi_square_p(counts_b, want_b) > 1e-3
    # Swapped targets fail: the test can tell the two sets apart.
    assert chi_square_p(counts_a, want_b) < 1e-6 and chi_square_p(counts_b, want_a) < 1e-6


@pytest.mark.parametrize("bad", ["generators", "logits"])
def test_bad_batches_are_refused_with_the_reason(bad):
    p = SamplingParams(temperature=0.7)
    if bad == "generators":
        with pytest.raises(ValueError, match="generators: expected one per row"):
            sample_on_device(torch.randn(2, 8), [p, p], [None])
    else:
        with pytest.raises(ValueError, match=r"logits: expected \[2, V\]"):
            sample_on_device(torch.randn(3, 8), [p, p], [None, None])


# ------------------------------------------------------------------------- penalties and logit bias

V_PEN = 30
PEN_ROW = st.fixed_dictionaries({
    "prompt": st.lists(st.integers(0, V_PEN - 1), max_size=8),
    "output": st.lists(st.integers(0, V_PEN - 1), max_size=8),
    "repetition": st.sampled_from([1.0, 1.3, 0.8]),
    "presence": st.sampled_from([0.0, 0.5, -1.0]),
    "frequency": st.sampled_from([0.0, 0.3, 2.0]),
    "bias": st.dictionaries(st.integers(0, V_PEN - 1), st.floats(-100, 100), max_size=4),
})


def _penalties(rows: list[dict]) -> Penalties:
    return Penalties.build([r["prompt"] for r in rows], [r["output"] for r in rows], [r["repetition"] for r in rows],
                           [r["presence"] for r in rows], [r["frequency"] for r in rows], [r["bias"] for r in rows],
                           V_PEN, torch.device("cpu"))


@settings(max_examples=80, deadline=None)
@given(st.integers(0, 10_000), st.lists(PEN_ROW, min_size=1, max_size=5))
def test_batched_penalties_are_the_row_specification(seed, rows):
    logits = torch.stack([_logits(seed + i, V_PEN) for i in range(len(rows))])
    got = apply_penalties(logits, _penalties(rows))
    for i, r in enumerate(rows):
        want = penalize_logits(logits[i], r["prompt"], r["output"], r["repetition"], r["presence"], r["frequency"],
                               r["bias"])
        torch.testing.assert_close(got[i], want, rtol=1e-6, atol=1e-5)


def test_penalties_steer_greedy_and_sampled_rows():
    """A logit bias makes a greedy row pick its token, and a large frequency penalty keeps a
    sampled row off the tokens it already emitted."""
    logits = torch.tensor([[3.0, 1.0, 0.0, 0.5]] * 2)
    rows = [dict(prompt=[], output=[], repetition=1.0, presence=0.0, frequency=0.0, bias={2: 10.0}),
            dict(prompt=[], output=[0, 0, 1], repetition=1.0, presence=0.0, frequency=50.0, bias={})]
    pen = Penalties.build([r["prompt"] for r in rows], [r["output"] for r in rows], [1.0, 1.0], [0.0, 0.0],
                          [0.0, 50.0], [r["bias"] for r in rows], 4, torch.device("cpu"))
    for seed in range(20):
        got = sample_on_device(logits, [SamplingParams(temperature=0), SamplingParams(temperature=1.0)],
                               [None, torch.Generator().manual_seed(seed)], pen).tolist()
        assert got[0] == 2 and got[1] in (2, 3)
    assert sample(logits[:1], [SamplingParams(temperature=0)], [None]) == [0]  # no penalties: the plain argmax


def test_bad_penalty_inputs_are_refused_with_the_row():
    with pytest.raises(ValueError, match="token id 9 of row 1 is outside the vocabulary"):
        Penalties.build([[], []], [[1], [9]], [1.0, 1.0], [0.0, 0.0], [0.0, 0.0], [{}, {}], 5, torch.device("cpu"))
    with pytest.raises(ValueError, match="presence has 1 rows, prompt_ids 2"):
        Penalties.build([[], []], [[], []], [1.0, 1.0], [0.0], [0.0, 0.0], [{}, {}], 5, torch.device("cpu"))


def test_penalties_stay_on_the_device_and_upload_from_pinned_memory(on_cuda):
    """Built and applied for a (emulated) GPU, penalties and the batched sampler make no read of
    the device and no upload from pageable memory (either would wait for the stream), and give
    the CPU's tokens."""
    rows = [dict(prompt=[1, 2], output=[2, 2, 3], repetition=1.3, presence=0.5, frequency=0.2, bias={4: 2.0}),
            dict(prompt=[], output=[], repetition=1.0, presence=0.0, frequency=0.0, bias={}),
            dict(prompt=[5], output=[7], repetition=2.0, presence=0.0, frequency=1.0, bias={0: -5.0, 29: 1.0})]
    logits = torch.stack([_logits(40 + i, V_PEN) for i in range(3)])
    params = [SamplingParams(temperature=0.8, top_k=5), SamplingParams(temperature=0), SamplingParams(top_p=0.7)]

    def gens():
        return [torch.Generator().manual_seed(i) for i in range(3)]

    want = sample_on_device(logits, params, gens(), _penalties(rows))
    on_gpu = cuda(logits)
    before = on_cuda.pageable_uploads, on_cuda.downloads
    pen = Penalties.build([r["prompt"] for r in rows], [r["output"] for r in rows], [r["repetition"] for r in rows],
                          [r["presence"] for r in rows], [r["frequency"] for r in rows], [r["bias"] for r in rows],
                          V_PEN, CUDA)
    got = sample_on_device(on_gpu, params, gens(), pen)
    assert (on_cuda.pageable_uploads, on_cuda.downloads) == before
    assert_same(want, host(got))
