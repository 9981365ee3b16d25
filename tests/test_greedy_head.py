"""The greedy LM head (engine/models/greedy_head.py): the int8 screen's error stays within its
bound, the token the fp32 head would pick is always kept, and an engine decoding greedily gives
the same tokens with the screen as without it, while any step with another kind of row gets the
full head."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbatch.engine.models import greedy_head as G
from kvbatch.engine.models.llama import greedy_head_enabled
from kvbatch.engine.runtime.engine_config import EngineConfig
from kvbatch.engine.runtime.llm import LLM, GenerationRequest
from kvbatch.engine.runtime.sampling_params import SamplingParams
from kvbatch.engine.speculative.controller import SpecConfig
from kvbatch.kernels import cpu_native
from tests.tiny_models import VOCAB, build_tiny

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason="the native CPU kernels do not build here")


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
        cpu_native.greedy_head(torch.randn(2, 16), gh.screen, gh.error[:49], gh.rows)
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
