"""The engine's batched speculative verifier and its one host read per step.

- :func:`verify_batch` (every request of a step at once, through the batched accept/recover
  kernels) decides exactly what the per-request specification :func:`verify` decides, greedy and
  sampled, with and without draft distributions, and draws the same random numbers from each
  request's generator (its state afterwards is the same);
- the engine with it emits the same tokens (and logprobs) as the engine with the per-request
  verifier put back, on the reference kernels and through the Triton kernels in the interpreter;
  a seeded request draws the same tokens alone and in a batch;
- a step reads the device once: ``LLM.readback.syncs`` grows by one per step that samples
  (plain decode, logprobs, speculative verification), and on the CUDA code path (the Triton
  kernels, here in the interpreter) no other ``item``/``tolist``/``cpu``/``numpy``/``int``/``float``/
  ``bool`` is called on a tensor from the engine's or the kernels' code during a step; under
  expert parallelism each all-to-all round reads the device once (``ExchangeStats.host_reads``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

# First: it sets TRITON_INTERPRET before triton builds the kernels.
from tests.triton_interpreter import INTERPRETED, interpreter_settings  # isort: skip
from kvbatch.engine.runtime import llm as llm_module
from kvbatch.engine.runtime.engine_config import EngineConfig
from kvbatch.engine.runtime.llm import LLM, GenerationRequest
from kvbatch.engine.runtime.sampler import filter_logits, top_logprobs
from kvbatch.engine.runtime.sampling_params import SamplingParams
from kvbatch.engine.speculative.controller import SpecConfig
from kvbatch.engine.speculative.verifier import BatchVerdict, VerifyRow, verify, verify_batch
from tests.logit_capture import capture_logits
from tests.tiny_models import VOCAB, build_tiny

needs_interpreter = pytest.mark.skipif(not INTERPRETED, reason="needs the Triton kernels built for the interpreter "
                                       "(tests/test_engine_triton.py's note)")
REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------
# verify_batch against verify


@st.composite
def verify_rows(draw):
    V = draw(st.integers(2, 30), label="V")
    with_q = draw(st.booleans(), label="drafter with distributions")
    rows = []
    for _ in range(draw(st.integers(1, 4))):
        k = draw(st.integers(0, 4))
        greedy = draw(st.booleans())
        params = SamplingParams(temperature=0.0) if greedy else SamplingParams(
            temperature=draw(st.sampled_from([0.6, 1.0, 1.5])), top_k=draw(st.sampled_from([0, 2])),
            top_p=draw(st.sampled_from([1.0, 0.8])))
        seed = draw(st.integers(0, 2**16))
        g = torch.Generator().manual_seed(seed + 1)
        logits = torch.randn(k + 1, V, generator=g) * draw(st.sampled_from([1.0, 4.0]))
        p = filter_logits(logits, SamplingParams(temperature=1.0)).softmax(-1)
        q = torch.softmax(torch.randn(k, V, generator=g) * 2, -1) if with_q and k else None
        # Drafts near the target's choices, so some are kept and some rejected.
        source = p[:k] if q is None or draw(st.booleans()) else q
        drafts = torch.multinomial(source, 1, generator=g)[:, 0].tolist() if k else []
        if with_q and not k:
            q = torch.zeros(0, V)
        rows.append((logits, drafts, q, params, None if greedy else seed))
    return rows


def _gen(seed: int | None) -> torch.Generator | None:
    return None if seed is None else torch.Generator().manual_seed(seed)


def _check_against_verify(rows) -> None:
    gens_batch = [_gen(seed) for *_, seed in rows]
    gens_one = [_gen(seed) for *_, seed in rows]
    verdict = verify_batch([VerifyRow(lg, d, q, p, g) for (lg, d, q, p, _), g in zip(rows, gens_batch)])
    for n, ((lg, d, q, p, _), g) in enumerate(zip(rows, gens_one)):
        want = verify(lg, d, q, p, g)
        got_acc = int(verdict.num_accepted[n])
        assert got_acc == want.num_accepted, n
        assert verdict.tokens[n, :got_acc + 1].tolist() == want.tokens, n
    for a, b in zip(gens_batch, gens_one):  # the same draws were taken from each generator
        assert (a is None) == (b is None)
        if a is not None:
            assert torch.equal(a.get_state(), b.get_state())


@interpreter_settings(30)
@given(rows=verify_rows())
def test_verify_batch_equals_verify_on_the_reference_kernels(rows):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVBATCH_KERNELS", "reference")
        _check_against_verify(rows)


@needs_interpreter
@interpreter_settings(10)
@given(rows=verify_rows())
def test_verify_batch_equals_verify_on_the_triton_kernels(rows):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVBATCH_KERNELS", "triton")
        mp.setenv("TRITON_INTERPRET", "1")
        _check_against_verify(rows)


def test_verify_batch_goes_through_the_dispatch_kernels(monkeypatch):
    """The batched kernels decide (not a host loop): a spec_accept that keeps nothing makes every
    request emit exactly one token."""
    from kvbatch.kernels import dispatch

    monkeypatch.setattr(dispatch, "spec_accept", lambda p, q, u, nd: torch.zeros(p.shape[0], dtype=torch.long))
    logits = torch.zeros(3, 5)
    logits[:, 2] = 5.0
    verdict = verify_batch([VerifyRow(logits, [2, 2], None, SamplingParams(temperature=0.0), None)])
    assert verdict.num_accepted.tolist() == [0] and verdict.tokens[0, :1].tolist() == [2]


# ---------------------------------------------------------------------------------------------
# the engine with the batched verifier


def per_request_verify_batch(rows: list[VerifyRow]) -> BatchVerdict:
    """The engine's verifier as it was: :func:`verify` per request on the host."""
    verdicts = [verify(r.logits.cpu(), r.drafts, None if r.draft_probs is None else r.draft_probs.cpu(), r.params,
                       r.generator) for r in rows]
    k_max = max(len(r.drafts) for r in rows)
    tokens = torch.zeros(len(rows), k_max + 1, dtype=torch.long)
    for n, v in enumerate(verdicts):
        tokens[n, :len(v.tokens)] = torch.tensor(v.tokens)
    return BatchVerdict(torch.tensor([v.num_accepted for v in verdicts]), tokens)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("batched_verifier")
    build_tiny("llama", folder, seed=0)
    return folder


@pytest.fixture(scope="module")
def draft_tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("batched_verifier_draft")
    build_tiny("llama", folder, seed=3)
    return folder


def _requests(n: int, tokens: int, logprobs: int | None = None) -> list[GenerationRequest]:
    """Repetitive prompts (the n-gram drafter finds matches); greedy, seeded and unseeded sampling."""
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        base = torch.randint(3, VOCAB, (4,), generator=g).tolist()
        kind = i % 3
        params = SamplingParams(max_tokens=tokens, ignore_eos=True, logprobs=logprobs,
                                temperature=0.0 if kind == 0 else 0.9, top_p=1.0 if kind < 2 else 0.9,
                                seed=None if kind == 0 else 11 + i)
        out.append(GenerationRequest(f"r{i}", params, prompt_token_ids=base * 3))
    return out


def _repeating_requests(tokens: int, logprobs: int | None = None) -> list[GenerationRequest]:
    """Prompts on which this tiny model repeats itself, so the n-gram drafter proposes (as in
    tests/test_engine_triton.py); greedy and seeded sampling."""
    return [GenerationRequest(rid, SamplingParams(max_tokens=tokens, ignore_eos=True, logprobs=logprobs, **kw),
                              prompt_token_ids=p)
            for rid, p, kw in (("rep", [5, 6, 7, 8] * 3, {"temperature": 0.0}),
                               ("rep-seeded", [5, 6, 7, 8] * 3, {"temperature": 0.7, "seed": 3}),
                               ("other", [9, 10, 11, 12, 9, 10], {"temperature": 0.0}))]


def _run(folder, spec: SpecConfig, reqs, kernels: str, monkeypatch, per_request: bool = False,
         drafts: bool = True, **ec):
    monkeypatch.setenv("KVBATCH_KERNELS", kernels)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.MonkeyPatch.context() as mp:
        if per_request:
            mp.setattr(llm_module, "verify_batch", per_request_verify_batch)
        llm = LLM(str(folder), speculative=spec, engine_config=EngineConfig(device="cpu", **ec))
        out = llm.generate(reqs)
    assert llm.stats["spec_draft_tokens"] > 0 or not drafts  # it speculated
    return [(r.output_token_ids, r.logprobs) for r in out], llm.stats


@pytest.mark.parametrize("method", ["ngram", "draft:other", "draft:self"])
def test_engine_batched_verifier_equals_per_request(tiny, draft_tiny, method, monkeypatch):
    """Greedy, seeded and unseeded sampled requests in one batch, logprobs asked for: the same
    tokens and logprobs with the batched verifier as with verify() per request (the unseeded
    requests take their seeds from the engine's seed, the same in both runs). The n-gram drafter
    has one-hot q; another model's drafts are mostly rejected (residual draws from real q); the
    target as its own draft has its drafts kept."""
    spec = SpecConfig("ngram", max_len=3, adaptive=False) if method == "ngram" else SpecConfig(
        "draft", max_len=2, adaptive=False, draft_model=str(draft_tiny if method == "draft:other" else tiny))
    reqs = _requests(6, 8, logprobs=2)
    got, stats = _run(tiny, spec, reqs, "reference", monkeypatch)
    want, _ = _run(tiny, spec, reqs, "reference", monkeypatch, per_request=True)
    assert got == want
    if method == "draft:self":
        assert stats["spec_accepted_tokens"] > 0
    if method == "draft:other":
        assert stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]


def test_seeded_request_draws_the_same_tokens_whatever_its_batch(tiny, monkeypatch):
    spec = SpecConfig("ngram", max_len=3, adaptive=False)
    reqs = _requests(6, 8)
    batch, _ = _run(tiny, spec, reqs, "reference", monkeypatch, max_num_seqs=6)
    for i in (1, 2, 4):  # the seeded ones
        alone, _ = _run(tiny, spec, reqs[i:i + 1], "reference", monkeypatch, drafts=False)
        assert alone[0][0] == batch[i][0]


# ---------------------------------------------------------------------------------------------
# one host read per step


def test_plain_logprobs_equal_the_per_token_specification(tiny, monkeypatch):
    """Logprobs now come from one batched computation read with the ids: each entry equals
    top_logprobs() on that step's logits row, exactly."""
    monkeypatch.setenv("KVBATCH_KERNELS", "reference")
    llm = LLM(str(tiny), engine_config=EngineConfig(device="cpu"))
    seen = capture_logits(llm)
    reqs = _requests(3, 4, logprobs=3)
    out = {r.request_id: r for r in llm.generate(reqs)}
    for rid, r in out.items():
        rows = [lg for s, lg in seen if s == rid]
        assert r.logprobs == [top_logprobs(row, tok, 3) for row, tok in zip(rows, r.output_token_ids)]


class StrayReads:
    """Counts tensor reads (``item``, ``tolist``, ...) made from the engine's and the kernels'
    own code, outside ``HostReadback.read``: on CUDA each would be a device-to-host sync."""

    METHODS = ("item", "tolist", "cpu", "numpy", "__int__", "__float__", "__bool__")

    def __init__(self, monkeypatch) -> None:
        self.calls: list[str] = []
        roots = tuple(str(REPO / d) for d in ("engine", "kernels"))
        for name in self.METHODS:
            original = getattr(torch.Tensor, name)

            def spy(t, *args, _name=name, _original=original, **kwargs):
                caller = sys._getframe(1)
                where = caller.f_code.co_filename
                if where.startswith(roots) and caller.f_code.co_name != "read":
                    self.calls.append(f"{_name} at {Path(where).name}:{caller.f_lineno}")
                return _original(t, *args, **kwargs)

            monkeypatch.setattr(torch.Tensor, name, spy)


def _syncs_per_step(llm: LLM, reqs, monkeypatch, stray: bool) -> tuple[list[int], list[str], dict]:
    """Run ``reqs`` step by step: host reads per step, stray reads seen, and the results by id."""
    for r in reqs:
        llm.add_request(r)
    per_step, calls, results = [], [], {}
    while llm.scheduler.has_work():
        before = llm.readback.syncs
        with pytest.MonkeyPatch.context() as mp:
            spy = StrayReads(mp) if stray else None
            done = llm.step()
        per_step.append(llm.readback.syncs - before)
        calls += spy.calls if spy else []
        results.update({r.request_id: (r.output_token_ids, r.logprobs) for r in done})
    return per_step, calls, results


@pytest.mark.parametrize("logprobs", [None, 2])
def test_one_host_read_per_step(tiny, monkeypatch, logprobs):
    """Greedy and sampled rows, with and without logprobs, and with the n-gram verifier: every
    step that samples reads the device exactly once."""
    monkeypatch.setenv("KVBATCH_KERNELS", "reference")
    plain = LLM(str(tiny), engine_config=EngineConfig(device="cpu", max_num_batched_tokens=16))
    steps, _, _ = _syncs_per_step(plain, _requests(3, 5, logprobs), monkeypatch, stray=False)
    assert steps and set(steps) == {1}, steps
    spec = LLM(str(tiny), engine_config=EngineConfig(device="cpu"), speculative=SpecConfig("ngram", 3, adaptive=False))
    steps, _, _ = _syncs_per_step(spec, _repeating_requests(5, logprobs), monkeypatch, stray=False)
    assert set(steps) == {1} and spec.stats["spec_draft_tokens"] > 0, steps


@pytest.mark.slow
@needs_interpreter
def test_cuda_code_path_reads_once_per_step_and_verifies_like_verify(tiny, monkeypatch):
    """The Triton kernels (interpreted) and the cuBLAS weight layout, the CUDA code path:

    - no tensor is read from the engine's or the kernels' code in a step except through
      HostReadback.read, once per step, for plain decode steps and speculative ones alike (the
      spy itself is shown to see reads);
    - the batched verifier on the Triton kernels emits the tokens and logprobs of the
      per-request verify() on the same kernels (greedy and seeded sampling)."""
    monkeypatch.setenv("KVBATCH_KERNELS", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("KVBATCH_LINEAR", "cublas")
    ec = {"device": "cpu", "block_size": 4, "num_blocks": 32}
    spec = SpecConfig("ngram", 2, adaptive=False)
    runs = {}
    for name, cfg, tokens in (("plain", None, 2), ("batched", spec, 4), ("per-request", spec, 4)):
        with pytest.MonkeyPatch.context() as mp:
            if name == "per-request":
                mp.setattr(llm_module, "verify_batch", per_request_verify_batch)
            llm = LLM(str(tiny), engine_config=EngineConfig(**ec), speculative=cfg)
            steps, calls, runs[name] = _syncs_per_step(llm, _repeating_requests(tokens, logprobs=1), monkeypatch,
                                                       stray=name != "per-request")
        assert set(steps) == {1}, (name, steps)
        assert calls == [], (name, calls)
        assert cfg is None or llm.stats["spec_draft_tokens"] > 0
    assert runs["batched"] == runs["per-request"]
    with pytest.MonkeyPatch.context() as mp:
        spy = StrayReads(mp)
        from kvbatch.kernels import reference

        reference.plan_decode(torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), 4)
    assert spy.calls, "the spy sees a read made in kernels/"


def test_expert_parallel_reads_the_host_once_per_exchange_round(tmp_path):
    """Under expert parallelism each all-to-all round reads the device once (its split sizes:
    what this rank sends and what it receives, in one copy; they were two), counted in
    ExchangeStats.host_reads; a step of L MoE layers makes L active rounds and one closing idle
    round (a gloo group of one)."""
    import torch.distributed as dist

    from kvbatch.engine.models.moe import MoELayerWeights
    from kvbatch.engine.parallel.expert_parallel import ExpertParallelCompute
    from kvbatch.kernels import dispatch

    E, H, I, layers = 4, 8, 6, (1, 3)
    g = torch.Generator().manual_seed(0)
    moe = {li: MoELayerWeights(router=torch.randn(E, H, generator=g), w_gate_up=torch.randn(E, 2 * I, H, generator=g),
                               w_down=torch.randn(E, H, I, generator=g)) for li in layers}
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        ep = ExpertParallelCompute(moe, 4)
        x = torch.randn(5, H, generator=g)
        ids = torch.randint(0, E, (5, 2), generator=g)
        weights = torch.rand(5, 2, generator=g)
        with pytest.MonkeyPatch.context() as mp:
            reads: list[int] = []
            original = torch.Tensor.cpu

            def cpu(t, *a, **kw):  # device-to-host copies made by the exchange itself
                if sys._getframe(1).f_code.co_filename.endswith("expert_parallel.py"):
                    reads.append(1)
                return original(t, *a, **kw)

            mp.setattr(torch.Tensor, "cpu", cpu)
            outs = [ep(li, x, ids, weights) for li in layers]
            ep.finish_step()
        for li, out in zip(layers, outs):  # one rank: the exchange equals the local experts
            assert torch.allclose(out, dispatch.fused_moe(x, moe[li].w_gate_up, moe[li].w_down, ids, weights),
                                  atol=1e-5)
        assert ep.stats.rounds == len(layers) + 1
        assert ep.stats.host_reads == ep.stats.rounds == len(reads)
    finally:
        dist.destroy_process_group()
