"""The greedy LM head (kernels/cpu/greedy_head.py): the int8 screen's error stays within its
bound, the token the fp32 head would pick is always kept, and an engine decoding greedily gives
the same tokens with the screen as without it, while any step with another kind of row gets the
full head."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbatch.engine.models.llama import greedy_head_enabled
from kvbatch.engine.runtime.engine_config import EngineConfig
from kvbatch.engine.runtime.llm import LLM, GenerationRequest
from kvbatch.engine.runtime.sampling_params import SamplingParams
from kvbatch.engine.speculative.controller import SpecConfig
from kvbatch.kernels.cpu import greedy_head as G
from kvbatch.kernels.cpu import native as native_kernels
from tests.tiny_models import VOCAB, build_tiny

pytestmark = pytest.mark.skipif(not native_kernels.available(), reason="the native CPU kernels do not build here")


def _head_and_rows(vocab: int, dim: int, rows: int, scale: float, ties: int, seed: int,
                   zero_row: bool = False) -> tuple[torch.Tensor, ...]:
    """A random head [vocab, dim] whose first ``ties`` rows are near-copies of row 0 (logits a
    rounding apart: the screen must keep them all and let fp32 decide), its last row zero where
    ``zero_row`` (a scale of 0), and ``rows`` inputs."""
    g = torch.Generator().manual_seed(seed)
    head = torch.randn(vocab, dim, generator=g) * scale
    for k in range(1, min(ties, vocab)):
        head[k] = head[0] * (1 + 1e-3 * k * torch.randn(dim, generator=g))
    if zero_row:
        head[-1] = 0.0
    x = torch.randn(rows, dim, generator=g) * 3
    return head, x


@settings(max_examples=60, deadline=None)
@given(vocab=st.integers(1, 300), dim=st.integers(1, 96), rows=st.integers(1, G.SCREEN_MAX_ROWS),
       scale=st.sampled_from([1e-3, 0.05, 1.0, 30.0]), ties=st.integers(0, 4), seed=st.integers(0, 2**16),
       zero_row=st.booleans())
def test_the_screen_stays_within_its_bound_and_keeps_the_fp32_argmax(vocab, dim, rows, scale, ties, seed, zero_row):
    head, x = _head_and_rows(vocab, dim, rows, scale, ties, seed, zero_row)
    gh = G.make_greedy_head(head)
    approx, bound = G.screen(gh, x)
    exact = x.double() @ head.double().T
    # the bound covers the screen's error against the exact logits
    assert bool(((exact - approx.double()).abs() <= bound.double()).all())
    logits = G.screened_logits(gh, x)
    fp32 = x @ head.T
    kept = torch.isfinite(logits)
    # every kept logit is the fp32 one; the fp32 argmax and the exact argmax are always kept
    torch.testing.assert_close(logits[kept], fp32[kept], rtol=1e-5, atol=1e-5 * float(x.abs().max() * head.abs().max()))
    for r in range(rows):
        assert kept[r, int(fp32[r].argmax())] and kept[r, int(exact[r].argmax())]
        picked = int(logits[r].argmax())
        # the pick is the fp32 argmax, or ties with it at fp32 precision
        gap = float(fp32[r].max() - fp32[r, picked])
        assert gap <= 2 * (dim + 2) * 2.0 ** -24 * float((x[r].abs() @ head.abs().T).max())


def test_the_screen_keeps_few_tokens_when_logits_are_spread():
    # A head whose logits spread like a trained model's (the first few tokens far ahead): the
    # screen's point is that it keeps a handful, not the vocabulary.
    head, x = _head_and_rows(4096, 64, 4, 0.05, 0, 3)
    head[:4] = x / x.norm(dim=1, keepdim=True) * 2  # token r is row r's clear favourite
    logits = G.screened_logits(G.make_greedy_head(head), x)
    kept = torch.isfinite(logits).sum(dim=1)
    assert bool((kept >= 1).all()) and int(kept.max()) <= 8
    assert logits.argmax(dim=1).tolist() == [0, 1, 2, 3]


def test_the_screen_refuses_what_it_cannot_take(monkeypatch):
    head = torch.randn(50, 16)
    assert G.make_greedy_head(head.bfloat16()) is None
    for bad in (float("nan"), float("inf")):  # no bound holds over a weight that is not finite
        poisoned = head.clone()
        poisoned[7, 3] = bad
        assert G.make_greedy_head(poisoned) is None
    with pytest.raises(ValueError, match="fp32 rows of 16"):
        G.screened_logits(G.make_greedy_head(head), torch.randn(2, 8))
    gh = G.make_greedy_head(head)
    with pytest.raises(ValueError, match=r"error \[50\].*got x \(2, 16\), error \(49,\)"):
        native_kernels.greedy_head(torch.randn(2, 16), gh.screen, gh.error[:49], gh.rows)
    assert greedy_head_enabled()
    monkeypatch.setenv("KVBATCH_GREEDY_HEAD", "0")
    assert not greedy_head_enabled()
    monkeypatch.setenv("KVBATCH_GREEDY_HEAD", "maybe")
    with pytest.raises(ValueError, match="KVBATCH_GREEDY_HEAD must be 0 or 1"):
        greedy_head_enabled()


# ------------------------------------------------------------------------- in the engine

def _run(folder, monkeypatch, screen: str, requests: list[GenerationRequest], **llm_kw):
    """Tokens of ``requests`` and, per step, (greedy_only, whether every logit was finite,
    rows) as the runner handed them out."""
    monkeypatch.setenv("KVBATCH_GREEDY_HEAD", screen)
    llm = LLM(str(folder), engine_config=EngineConfig(block_size=4, num_blocks=256), **llm_kw)
    steps = []
    prepare, execute = llm.runner.prepare, llm.runner.execute

    def spy_prepare(step):
        ids, batch, sampled = prepare(step)
        steps.append([batch.greedy_only])
        return ids, batch, sampled

    def spy_execute(step):
        logits, sampled = execute(step)
        steps[-1] += [bool(torch.isfinite(logits).all()), logits.shape[0]]
        return logits, sampled

    llm.runner.prepare, llm.runner.execute = spy_prepare, spy_execute
    results = llm.generate(requests)
    return [r.output_token_ids for r in results], steps, llm


def _prompts(n: int) -> list[list[int]]:
    return [torch.randint(3, VOCAB, (6 + 5 * i,), generator=torch.Generator().manual_seed(i)).tolist()
            for i in range(n)]


def _greedy(i: int, p: list[int], **kw) -> GenerationRequest:
    return GenerationRequest(f"r{i}", SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, **kw),
                             prompt_token_ids=p)


@pytest.mark.parametrize("arch", ["llama", "llama3"])  # an untied head, a tied one (the embedding's rows)
def test_greedy_decoding_gives_the_same_tokens_with_the_screen(tmp_path, monkeypatch, arch):
    build_tiny(arch, tmp_path)
    reqs = [_greedy(i, p) for i, p in enumerate(_prompts(3))]
    full, full_steps, _ = _run(tmp_path, monkeypatch, "0", reqs)
    screened, steps, llm = _run(tmp_path, monkeypatch, "1", reqs)
    assert screened == full
    assert llm.runner.model.greedy_head is not None
    assert all(s[0] for s in steps) and all(s[1] for s in full_steps)
    # the screen ran: some step's logits were -inf where it ruled tokens out
    assert not all(s[1] for s in steps)


def test_a_step_with_other_rows_gets_the_full_head(tmp_path, monkeypatch):
    build_tiny("llama", tmp_path)
    prompts = _prompts(3)
    reqs = [_greedy(0, prompts[0]), _greedy(1, prompts[1], logprobs=2),
            GenerationRequest("r2", SamplingParams(max_tokens=8, temperature=0.8, seed=5, ignore_eos=True),
                              prompt_token_ids=prompts[2])]
    tokens, steps, _ = _run(tmp_path, monkeypatch, "1", reqs)
    full, _, _ = _run(tmp_path, monkeypatch, "0", reqs)
    assert tokens == full
    # while the logprobs or the sampled request is in the step, every row gets finite logits
    mixed = [s for s in steps if not s[0]]
    assert mixed and all(finite for _, finite, _ in mixed)


def test_greedy_speculative_decoding_gives_the_same_tokens_with_the_screen(tmp_path, monkeypatch):
    build_tiny("llama", tmp_path)
    # repetitive prompts, so n-gram drafts are offered and verified rows reach the screen
    reqs = [_greedy(i, (p * 4)[:30]) for i, p in enumerate(_prompts(2))]
    spec = SpecConfig("ngram", max_len=4, adaptive=False)
    full, _, _ = _run(tmp_path, monkeypatch, "0", reqs, speculative=spec)
    screened, steps, _ = _run(tmp_path, monkeypatch, "1", reqs, speculative=spec)
    assert screened == full
    assert any(rows > 2 and not finite for greedy, finite, rows in steps if greedy)  # verified rows screened


# ------------------------------------------------------------------------- batched rows

# oneDNN's int8 linear multiplies exactly only where its int8 code has VNNI or AMX; an AVX2-only
# CPU (AMD Zen 1-3), or oneDNN capped to AVX2 (``bench_engine.py --isa avx2``), sums uint8 x int8
# pairs into int16 and saturates, and there the engine takes the fp32 head for batched rows
# (greedy_head.int8_linear_available). The batched screen's arithmetic (the activations' rounding,
# the outlier columns, the bound, the selection) is the project's on every CPU, so its tests run over
# an exact int8 linear (the integer product in float64, scaled in fp32) everywhere, and over
# oneDNN's too where it is exact here; test_batched_rows_take_onednn_int8_only_where_it_is_exact_here
# holds the probe and the fallback on every CPU.
ONEDNN_INT8 = G.int8_linear_available()
ROUTES = ["exact", *(["onednn"] if ONEDNN_INT8 else [])]


def _exact_int8_linear(q: torch.Tensor, x_scale: float, w: torch.Tensor, w_scale: torch.Tensor,
                       zero_points: torch.Tensor) -> torch.Tensor:
    """What ``G._int8_linear`` computes where it is exact: the integer product (exact in float64
    for these sizes), then the two fp32 scales."""
    assert not bool(zero_points.any())
    return (q.double() @ w.double().t()).float() * x_scale * w_scale


def _use_exact_int8_linear(monkeypatch) -> None:
    monkeypatch.setattr(G, "_prepack", lambda w, rows: w.clone())  # the "packed" head: its int8 rows
    monkeypatch.setattr(G, "_int8_linear", _exact_int8_linear)


def _batched_head(head: torch.Tensor, monkeypatch, route: str) -> G.GreedyHead:
    """``head``'s screen with its batched part over ``route``'s int8 linear, kept whatever the
    load-time measurement says (the tests hold its numbers, not its speed on a tiny head)."""
    if route == "exact":
        _use_exact_int8_linear(monkeypatch)
    monkeypatch.setattr(G, "batched_screen_wins", lambda h: (True, (1.0, 2.0)))
    gh = G.make_greedy_head(head)
    assert gh is not None and gh.batched is not None
    return gh


def _saturating_int8() -> tuple[torch.Tensor, torch.Tensor]:
    """Activations and head rows at the ends of the int8 range: every pair of their uint8 x int8
    products lies past int16's range."""
    full = torch.full((64,), 127, dtype=torch.int8)
    return torch.stack([full, -full, full]), torch.stack([full, -full])


def test_the_int8_linear_probe_refuses_a_saturating_or_missing_int8_linear(monkeypatch):
    _use_exact_int8_linear(monkeypatch)
    assert G.int8_linear_available()

    def saturating(q, x_scale, w, w_scale, zero_points):  # pairs of u8 x s8 products summed in int16
        u8 = q.to(torch.int32) + 128
        prods = (u8[:, None, :] * w.to(torch.int32)[None, :, :]).reshape(len(q), len(w), -1, 2).sum(-1)
        acc = prods.clamp(-32768, 32767).sum(-1) - 128 * w.to(torch.int32).sum(1)
        return acc.double().float() * x_scale * w_scale

    monkeypatch.setattr(G, "_int8_linear", saturating)
    assert not G.int8_linear_available()
    x, w = _saturating_int8()
    assert not torch.equal(saturating(x, 1.0, w, torch.ones(2), None), _exact_int8_linear(x, 1.0, w, torch.ones(2),
                                                                                            torch.zeros(2)))

    def missing(*args):
        raise RuntimeError("no such op")

    monkeypatch.setattr(G, "_int8_linear", missing)
    assert not G.int8_linear_available()


def test_batched_rows_take_onednn_int8_only_where_it_is_exact_here(monkeypatch):
    # on every CPU: the probe's answer is what oneDNN's int8 linear gives at the ends of the int8
    # range here, and a head gets a batched screen (its measurement made to win) exactly where it is
    x, w = _saturating_int8()
    ones = torch.ones(len(w))
    try:
        got = G._int8_linear(x, 1.0, G._prepack(w, len(x)), ones, torch.zeros(len(w), dtype=torch.int64))
        exact = torch.equal(got, _exact_int8_linear(x, 1.0, w, ones, torch.zeros(len(w))))
    except (RuntimeError, AttributeError, NotImplementedError):  # no oneDNN int8 ops in this torch
        exact = False
    assert ONEDNN_INT8 == exact
    monkeypatch.setattr(G, "batched_screen_wins", lambda h: (True, (1.0, 2.0)))
    gh = G.make_greedy_head(torch.randn(50, 16, generator=torch.Generator().manual_seed(0)))
    assert (gh.batched is not None) == exact
    assert G.takes(gh, G.SCREEN_MAX_ROWS) and G.takes(gh, G.SCREEN_MAX_ROWS + 1) == exact


@pytest.mark.parametrize("route", ROUTES)
@settings(max_examples=40, deadline=None)
@given(vocab=st.integers(1, 300), dim=st.integers(1, 96), rows=st.integers(G.SCREEN_MAX_ROWS + 1, 40),
       scale=st.sampled_from([1e-3, 0.05, 1.0, 30.0]), ties=st.integers(0, 4), seed=st.integers(0, 2**16),
       outliers=st.integers(0, 3), zero_row=st.booleans())
def test_the_batched_screen_stays_within_its_bound_and_keeps_the_fp32_argmax(route, vocab, dim, rows, scale, ties,
                                                                            seed, outliers, zero_row):
    with pytest.MonkeyPatch.context() as mp:
        head, x = _head_and_rows(vocab, dim, rows, scale, ties, seed, zero_row)
        for c in range(min(outliers, dim)):  # channels far larger than the rest, as in LLM hidden states
            x[:, (c * 7) % dim] *= 60
        gh = _batched_head(head, mp, route)
        approx, bound = G.batched_screen(gh, x)
        exact = x.double() @ head.double().T
        assert bool(((exact - approx).abs() <= bound).all())
        logits = G.screened_logits(gh, x)
        fp32 = x @ head.T
        kept = torch.isfinite(logits)
        torch.testing.assert_close(logits[kept], fp32[kept], rtol=1e-5,
                                   atol=1e-5 * float(x.abs().max() * head.abs().max()))
        for r in range(rows):
            assert kept[r, int(fp32[r].argmax())] and kept[r, int(exact[r].argmax())]


@pytest.mark.parametrize("route", ROUTES)
def test_the_batched_screen_keeps_few_tokens_and_its_outlier_columns_are_what_keeps_them_few(monkeypatch, route):
    # two channels carry 60x the others' magnitude; token r's row leans towards row r (a near race)
    head, x = _head_and_rows(4096, 64, 16, 0.05, 0, 3)
    x[:, 5] *= 60
    x[:, 40] *= 60
    head[:16] = x / x.norm(dim=1, keepdim=True) * 0.2
    gh = _batched_head(head, monkeypatch, route)
    fp32 = x @ head.T
    logits = G.screened_logits(gh, x)
    assert torch.equal(logits.argmax(dim=1), fp32.argmax(dim=1))
    kept = int(torch.isfinite(logits).sum())
    monkeypatch.setattr(G, "OUTLIER_COLUMNS", 0)  # the outliers rounded with the rest
    loose = G.screened_logits(gh, x)
    assert torch.equal(loose.argmax(dim=1), fp32.argmax(dim=1))
    assert kept <= 2 * 16 and 5 * kept < int(torch.isfinite(loose).sum())  # 23 against 457 when written


@pytest.mark.parametrize("route", ROUTES)
def test_a_non_finite_batched_row_gets_the_full_heads_logits(monkeypatch, route):
    head, x = _head_and_rows(300, 32, 12, 1.0, 0, 9)
    x[3, 4] = float("nan")
    x[7, 0] = float("inf")
    gh = _batched_head(head, monkeypatch, route)
    logits = G.screened_logits(gh, x)
    fp32 = x @ head.T
    for r in (3, 7):
        assert torch.equal(logits[r].isnan(), fp32[r].isnan())
        assert int(logits[r].argmax()) == int(fp32[r].argmax())
    fine = [r for r in range(12) if r not in (3, 7)]
    assert torch.equal(logits[fine].argmax(dim=1), fp32[fine].argmax(dim=1))


def test_batched_rows_get_the_full_head_where_the_screen_lost_its_measurement(monkeypatch):
    _use_exact_int8_linear(monkeypatch)  # the ops exact, so the measurement is what decides
    monkeypatch.setattr(G, "batched_screen_wins", lambda h: (False, (3.0, 2.0)))
    gh = G.make_greedy_head(torch.randn(50, 16))
    assert gh.batched is None
    assert G.takes(gh, G.SCREEN_MAX_ROWS) and not G.takes(gh, G.SCREEN_MAX_ROWS + 1)
    assert not G.takes(gh, 0) and not G.takes(None, 1)
    monkeypatch.setattr(G, "int8_linear_available", lambda: False)  # no ops: nothing measured
    monkeypatch.setattr(G, "batched_screen_wins", lambda h: pytest.fail("measured without the ops"))
    assert G.make_greedy_head(torch.randn(50, 16)).batched is None


# "onednn": the engine as it runs on this CPU: the batched screen over oneDNN's int8 linear where
# that is exact here, else the fp32 head for every batched row; the same tokens either way.
@pytest.mark.parametrize("route", ["exact", "onednn"])
def test_batched_greedy_decoding_gives_the_same_tokens_with_the_screen(tmp_path, monkeypatch, route):
    build_tiny("llama3", tmp_path)
    reqs = [_greedy(i, p) for i, p in enumerate(_prompts(12))]
    full, _, _ = _run(tmp_path, monkeypatch, "0", reqs)
    if route == "exact":
        _use_exact_int8_linear(monkeypatch)
    monkeypatch.setattr(G, "batched_screen_wins", lambda h: (True, (1.0, 2.0)))
    screened, steps, llm = _run(tmp_path, monkeypatch, "1", reqs)
    screens = route == "exact" or ONEDNN_INT8
    assert (llm.runner.model.greedy_head.batched is not None) == screens
    assert screened == full
    batched = [finite for greedy, finite, rows in steps if greedy and rows > G.SCREEN_MAX_ROWS]
    assert batched  # decode steps of 12 rows ran
    # where the batched screen runs, -inf where it ruled tokens out; else the full head's logits
    assert (not all(batched)) == screens


@pytest.mark.parametrize("route", ROUTES)
def test_the_batched_bound_covers_an_activation_rounding_aligned_with_a_head_row(monkeypatch, route):
    # Cauchy-Schwarz is tight here: 16 outlier columns (kept fp32), one column setting the int8 scale
    # to 1, 31 columns of 3.4 (each rounded to 3: an error of 0.4), and a head row of ones on exactly
    # those columns (int8-exact): the screened logit errs by ||x_r - x'|| ||w'|| = 0.4 x 31 = 12.4.
    x = torch.zeros(9, 48)
    x[:, :16] = 1000.0
    x[:, 16] = 127.0
    x[:, 17:] = 3.4
    head = torch.randn(20, 48, generator=torch.Generator().manual_seed(1))
    head[0] = 0.0
    head[0, 17:] = 1.0
    gh = _batched_head(head, monkeypatch, route)
    approx, bound = G.batched_screen(gh, x)
    exact = x.double() @ head.double().T
    err = (exact - approx).abs()
    assert float(err[:, 0].min()) == pytest.approx(12.4, rel=1e-5)
    assert bool((err <= bound).all())
    assert float((bound[:, 0] - err[:, 0]).max()) < 0.3  # and it is close: the rounding term carries it
