"""Fused MoE, MLA decode attention and the speculative accept/reject step: Triton against twins.

Like tests/test_kernels.py: the Triton kernels run on the CPU in the interpreter
(``TRITON_INTERPRET=1``, set before triton is imported; if the kernels were already compiled
for a GPU in this process the in-process tests skip and one test reruns the file in a fresh
process), hypothesis draws small shapes (derandomized, no shrinking), and the edge cases are
spelled out. 16-bit inputs are loaded as such and computed in fp32 (the interpreter's bf16
arithmetic is wrong), so they are compared with the twin run on the same values upcast to
fp32, within one or two units in the last place of the output dtype.

The batched verifier twins are also pinned to the engine's per-request
:func:`kvbatch.engine.speculative.verifier.verify`: fed the same random stream they accept the same
drafts and emit the same token, exactly.

Tolerances (max |triton - reference| <= atol + rtol * |reference|):
- fused MoE: fp32 1e-4 / 1e-4; 16-bit 2e-2 / 2e-2 (the kernel also rounds the intermediate
  activation to the input dtype; the interpreter truncates instead of rounding).
- MLA decode: as attention in tests/test_kernels.py (fp32 1e-4; fp16 3e-3; bf16 3e-2).
- verifier: exact.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

# First: it sets TRITON_INTERPRET before triton builds the kernels.
from tests.triton_interpreter import (ATTN_TOL, DTYPES, INTERPRETED, KERNELS, REPO,  # isort: skip
                                      assert_close, fresh_process_only, interpreter_only, interpreter_settings,
                                      rerun_in_fresh_interpreter, randn, use_triton)  # noqa: F401 (fixture)
from kvbatch.engine.runtime.sampler import filter_logits
from kvbatch.engine.runtime.sampling_params import SamplingParams
from kvbatch.engine.speculative.verifier import verify
from kvbatch.kernels import dispatch
from kvbatch.kernels import reference as R
from kvbatch.kernels import reference_mla as RM
from kvbatch.kernels import reference_verify as RV

needs_interpreter = interpreter_only("test_moe_mla_verify_in_a_fresh_process")

SETTINGS = interpreter_settings(25)

MOE_TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (2e-2, 2e-2), torch.bfloat16: (2e-2, 2e-2)}


# ---------------------------------------------------------------------------------------------
# fused MoE


def moe_inputs(gen, T, H, I, E, k, dtype, id_low=0, id_high=None):
    """Weights scaled so outputs are O(1); ids drawn from ``id_low .. id_high - 1``."""
    x = randn(gen, T, H, dtype=dtype)
    w_gate_up = (randn(gen, E, 2 * I, H) * H**-0.5).to(dtype)
    w_down = (randn(gen, E, H, I) * I**-0.5).to(dtype)
    ids = torch.randint(id_low, E if id_high is None else id_high, (T, k), generator=gen)
    weights = torch.rand(T, k, generator=gen)
    return x, w_gate_up, w_down, ids, weights


def moe_expected(x, w_gate_up, w_down, ids, weights):
    """The twin; 16-bit inputs are upcast first (the kernel computes in fp32 in the interpreter)."""
    if x.dtype == torch.float32:
        return R.fused_moe(x, w_gate_up, w_down, ids, weights)
    return R.fused_moe(x.float(), w_gate_up.float(), w_down.float(), ids, weights).to(x.dtype)


def check_moe(x, w_gate_up, w_down, ids, weights, **kwargs):
    """Triton (through the dispatch point, or directly with tuning ``kwargs``) against the twin."""
    expected = moe_expected(x, w_gate_up, w_down, ids, weights)
    with pytest.MonkeyPatch.context() as mp:  # hypothesis tests cannot take the fixture
        mp.setenv("TRITON_INTERPRET", "1")
        mp.setenv("KVBATCH_KERNELS", "triton")
        if kwargs:
            actual = KERNELS.fused_moe(x, w_gate_up, w_down, ids, weights, **kwargs)
        else:
            actual = dispatch.fused_moe(x, w_gate_up, w_down, ids, weights)
    assert_close(actual, expected, MOE_TOL[x.dtype])
    return actual


@needs_interpreter
@SETTINGS
@given(
    T=st.integers(1, 6),
    H=st.sampled_from([16, 24, 40]),
    I=st.sampled_from([8, 16, 20]),
    E=st.integers(1, 5),
    k=st.integers(1, 3),
    dtype=st.sampled_from(DTYPES),
    out_of_range=st.booleans(),
    block_m=st.sampled_from([16, 32]),
    seed=st.integers(0, 2**16),
)
def test_fused_moe_matches_reference(T, H, I, E, k, dtype, out_of_range, block_m, seed):
    gen = torch.Generator().manual_seed(seed)
    lo, hi = (-2, E + 2) if out_of_range else (0, E)
    check_moe(*moe_inputs(gen, T, H, I, E, k, dtype, lo, hi), block_m=block_m)


@needs_interpreter
def test_fused_moe_edges(use_triton):
    gen = torch.Generator().manual_seed(1)
    # One token, one expert.
    check_moe(*moe_inputs(gen, 1, 16, 8, 1, 1, torch.float32))
    # Experts with no tokens: 8 experts, only 0 and 5 chosen.
    x, wgu, wd, _, w = moe_inputs(gen, 5, 24, 16, 8, 2, torch.float32)
    ids = torch.tensor([[0, 5], [5, 0], [0, 5], [5, 5], [0, 0]])
    check_moe(x, wgu, wd, ids, w)
    # Every id out of range (all experts live elsewhere): zeros.
    out = check_moe(x, wgu, wd, torch.tensor([[-1, 8]] * 5), w)
    assert torch.all(out == 0)
    # Several row blocks per expert and several K steps in both GEMMs (rows not a multiple of
    # the block: 21 tokens x 2 choices over 2 experts).
    check_moe(*moe_inputs(gen, 21, 80, 40, 2, 2, torch.float32))


@needs_interpreter
def test_fused_moe_empty_and_strided(use_triton):
    gen = torch.Generator().manual_seed(2)
    x, wgu, wd, ids, w = moe_inputs(gen, 4, 16, 8, 3, 2, torch.float32)
    assert dispatch.fused_moe(x[:0], wgu, wd, ids[:0], w[:0]).shape == (0, 16)
    out = dispatch.fused_moe(x, wgu, wd, ids[:, :0], w[:, :0])  # no choices: zeros, like the twin
    assert_close(out, R.fused_moe(x, wgu, wd, ids[:, :0], w[:, :0]), MOE_TOL[torch.float32])
    # x as a slice of a wider activation; ids and weights transposed views.
    wide = randn(gen, 4, 40)
    ids_t = ids.t().contiguous().t()
    w_t = w.t().contiguous().t()
    check_moe(wide[:, 8:24], wgu, wd, ids_t, w_t)


@needs_interpreter
def test_fused_moe_bf16_against_bf16_twin(use_triton):
    """The twin run in bf16 itself (its GEMMs round to bf16) stays within bf16 noise."""
    gen = torch.Generator().manual_seed(3)
    x, wgu, wd, ids, w = moe_inputs(gen, 6, 32, 16, 4, 2, torch.bfloat16)
    actual = dispatch.fused_moe(x, wgu, wd, ids, w)
    assert_close(actual, R.fused_moe(x, wgu, wd, ids, w), (5e-2, 5e-2))


def test_moe_align_blocks():
    """Every valid pair appears once, in a block of its own expert; dropped pairs nowhere."""
    from kvbatch.kernels.triton_moe import moe_align

    gen = torch.Generator().manual_seed(4)
    for T, k, E, bm in ((7, 2, 5, 4), (1, 1, 3, 16), (30, 3, 4, 8)):
        ids = torch.randint(-1, E + 1, (T, k), generator=gen)
        pairs, experts = moe_align(ids, E, bm)
        flat = ids.reshape(-1)
        got = pairs.view(-1, bm)
        for b, e in enumerate(experts.tolist()):
            row = [p for p in got[b].tolist() if p < T * k]
            if e < 0:
                assert not row
            else:
                assert all(int(flat[p]) == e for p in row)
        valid = sorted(p for p in range(T * k) if 0 <= int(flat[p]) < E)
        assert sorted(p for p in pairs.tolist() if p < T * k) == valid


# ---------------------------------------------------------------------------------------------
# MLA decode attention


def make_latent_cache(gen, context_lens, block_size, width, dtype, spare_blocks=2):
    need = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(need) + spare_blocks
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.randint(0, num_blocks, (len(context_lens), max(max(need, default=1), 1)), generator=gen)
    used = 0
    for b, n in enumerate(need):
        tables[b, :n] = perm[used:used + n]
        used += n
    return randn(gen, num_blocks, block_size, 1, width, dtype=dtype), tables.to(torch.int32)


def check_mla(context_lens, Hq, C, Rd, block_size, dtype, seed=0, via_dispatch=False, **kwargs):
    gen = torch.Generator().manual_seed(seed)
    cache, tables = make_latent_cache(gen, context_lens, block_size, C + Rd, dtype)
    q_latent = randn(gen, len(context_lens), Hq, C, dtype=dtype)
    q_pe = randn(gen, len(context_lens), Hq, Rd, dtype=dtype)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    scale = (C + Rd) ** -0.5
    expected = RM.mla_decode_attention(q_latent, q_pe, cache, tables, lens, scale)
    if via_dispatch:
        actual = dispatch.mla_decode_attention(q_latent, q_pe, cache, tables, lens, scale)
    else:
        actual = KERNELS.mla_decode_attention(q_latent, q_pe, cache, tables, lens, scale, **kwargs)
    assert_close(actual, expected, ATTN_TOL[dtype])
    return actual


@needs_interpreter
@SETTINGS
@given(
    data=st.data(),
    batch=st.integers(1, 3),
    Hq=st.sampled_from([1, 3, 16, 20]),
    C=st.sampled_from([16, 24, 64]),
    Rd=st.sampled_from([8, 16]),
    block_size=st.sampled_from([1, 4, 5, 16]),
    dtype=st.sampled_from(DTYPES),
    partition_size=st.sampled_from([16, 32, 1024]),
)
def test_mla_decode_matches_reference(data, batch, Hq, C, Rd, block_size, dtype, partition_size):
    lens = data.draw(st.lists(st.integers(1, 60), min_size=batch, max_size=batch), label="context_lens")
    seed = data.draw(st.integers(0, 2**16), label="seed")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        check_mla(lens, Hq, C, Rd, block_size, dtype, seed, partition_size=partition_size)


@needs_interpreter
@pytest.mark.parametrize(
    "context_lens, block_size, extra",
    [
        ([1], 16, {}),  # one token
        ([17, 3, 16], 16, {}),  # not a multiple of the block size, and exactly one block
        ([48, 1, 33], 16, {"partition_size": 16}),  # split: the longest context fills its table
        ([40, 7], 8, {"max_context_len": 40, "partition_size": 16, "block_h": 2}),  # grid from the longest context
    ],
)
def test_mla_decode_edges(use_triton, context_lens, block_size, extra):
    check_mla(context_lens, 4, 32, 16, block_size, torch.float32, **extra)


@needs_interpreter
def test_mla_decode_dispatch_dtypes_and_no_rope(use_triton):
    check_mla([9, 30], 6, 32, 8, 4, torch.bfloat16, via_dispatch=True)
    check_mla([9, 30], 6, 32, 0, 4, torch.float32, via_dispatch=True)  # no rope part


@needs_interpreter
def test_mla_decode_empty_batch_and_empty_context(use_triton):
    gen = torch.Generator().manual_seed(5)
    cache, tables = make_latent_cache(gen, [5, 9], 4, 24, torch.float32)
    ql, qp = randn(gen, 2, 3, 16), randn(gen, 2, 3, 8)
    out = dispatch.mla_decode_attention(ql[:0], qp[:0], cache, tables[:0], torch.zeros(0, dtype=torch.int32), 0.3)
    assert out.shape == (0, 3, 16)
    lens = torch.tensor([0, 9], dtype=torch.int32)
    for kwargs in ({}, {"partition_size": 16}):
        out = KERNELS.mla_decode_attention(ql, qp, cache, tables, lens, 0.3, **kwargs)
        assert torch.all(out[0] == 0)
        assert_close(out[1:], RM.mla_decode_attention(ql[1:], qp[1:], cache, tables[1:], lens[1:], 0.3),
                     ATTN_TOL[torch.float32])


@needs_interpreter
def test_mla_decode_strided_queries(use_triton):
    """q_latent and q_pe as slices of one projection output, as a model produces them."""
    gen = torch.Generator().manual_seed(6)
    cache, tables = make_latent_cache(gen, [21, 5], 4, 40, torch.float32)
    q = randn(gen, 2, 3, 40)
    lens = torch.tensor([21, 5])
    expected = RM.mla_decode_attention(q[..., :32], q[..., 32:], cache, tables, lens, 0.2)
    assert_close(dispatch.mla_decode_attention(q[..., :32], q[..., 32:], cache, tables.long(), lens, 0.2),
                 expected, ATTN_TOL[torch.float32])


# ---------------------------------------------------------------------------------------------
# the speculative verifier's accept/reject step


def batched_verdicts(requests, V, use_triton_kernels: bool):
    """The batched twins fed the random stream verify() would use: per request, ``k`` uniforms,
    then one row of exponential noise. Returns [(num_accepted, next_token)]."""
    N = len(requests)
    kmax = max((len(r["drafts"]) for r in requests), default=0)
    target = torch.zeros(N, kmax + 1, V)
    draft_probs = torch.zeros(N, kmax, V)
    tokens = torch.zeros(N, kmax, dtype=torch.long)
    uniforms = torch.full((N, kmax), 0.5)
    num_drafts = torch.tensor([len(r["drafts"]) for r in requests], dtype=torch.long)
    gens = []
    for n, r in enumerate(requests):
        k = len(r["drafts"])
        p = filter_logits(r["logits"], r["params"]).softmax(-1)
        target[n, : k + 1] = p
        if k:
            tokens[n, :k] = torch.tensor(r["drafts"])
            draft_probs[n, :k] = r["q"] if r["q"] is not None else torch.nn.functional.one_hot(
                torch.tensor(r["drafts"]), V).float()
        g = torch.Generator().manual_seed(r["seed"])
        if k:
            uniforms[n, :k] = torch.rand(k, generator=g)
        gens.append(g)
    p_tok = target[:, :kmax].gather(2, tokens[..., None])[..., 0]
    q_tok = draft_probs.gather(2, tokens[..., None])[..., 0]
    impl = KERNELS if use_triton_kernels else RV
    accepted = impl.spec_accept(p_tok, q_tok, uniforms, num_drafts)
    noise = torch.stack([torch.empty(V).exponential_(generator=g) for g in gens]) if N else torch.zeros(0, V)
    all_one_hot = all(r["q"] is None for r in requests)
    nxt = impl.spec_recover(target, None if all_one_hot else draft_probs, tokens, accepted, num_drafts, noise)
    return list(zip(accepted.tolist(), nxt.tolist()))


@st.composite
def verify_requests(draw):
    V = draw(st.integers(2, 40), label="V")
    n = draw(st.integers(1, 4))
    deterministic = draw(st.booleans(), label="deterministic drafter")
    requests = []
    for _ in range(n):
        k = draw(st.integers(0, 4))
        params = SamplingParams(
            temperature=draw(st.sampled_from([0.5, 1.0, 1.7])),
            top_k=draw(st.sampled_from([0, 1, 3])),
            top_p=draw(st.sampled_from([1.0, 0.8])),
        )
        seed = draw(st.integers(0, 2**16))
        g = torch.Generator().manual_seed(seed + 1)
        logits = torch.randn(k + 1, V, generator=g) * draw(st.sampled_from([1.0, 4.0]))
        mode = draw(st.sampled_from(["q", "q=p", "draft from p"]))
        p = filter_logits(logits, params).softmax(-1)
        if deterministic:
            q = None
            drafts = torch.multinomial(p[:k] if k else torch.ones(1, V), 1, generator=g)[:k, 0].tolist()
        else:
            q = torch.softmax(torch.randn(k, V, generator=g) * 2, -1) if mode != "q=p" else p[:k].clone()
            source = p[:k] if mode == "draft from p" else q
            drafts = torch.multinomial(source, 1, generator=g)[:, 0].tolist() if k else []
        requests.append(dict(logits=logits, drafts=drafts, q=q, params=params, seed=seed))
    return V, requests


def engine_verdicts(requests):
    out = []
    for r in requests:
        v = verify(r["logits"], r["drafts"], r["q"], r["params"], torch.Generator().manual_seed(r["seed"]))
        out.append((v.num_accepted, v.tokens[-1]))
    return out


@settings(SETTINGS, max_examples=80)
@given(case=verify_requests())
def test_spec_twin_agrees_with_engine_verify(case):
    """Same seeds -> same accepted counts and the same next token as the per-request verifier."""
    V, requests = case
    assert batched_verdicts(requests, V, use_triton_kernels=False) == engine_verdicts(requests)


@needs_interpreter
@settings(SETTINGS, max_examples=40)
@given(case=verify_requests())
def test_spec_triton_agrees_with_engine_verify(case):
    V, requests = case
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        assert batched_verdicts(requests, V, use_triton_kernels=True) == engine_verdicts(requests)


def test_spec_twin_greedy_mapping():
    """Greedy requests through the twin: p = (draft == argmax), q = 1 keeps exactly verify()'s drafts."""
    gen = torch.Generator().manual_seed(7)
    params = SamplingParams(temperature=0)
    for _ in range(20):
        k = int(torch.randint(0, 5, (1,), generator=gen))
        logits = torch.randn(k + 1, 6, generator=gen)
        best = logits.argmax(-1)
        drafts = torch.where(torch.rand(k, generator=gen) < 0.7, best[:k], torch.randint(0, 6, (k,), generator=gen))
        v = verify(logits, drafts.tolist(), None, params, None)
        p_tok = (drafts == best[:k]).float()[None]
        accepted = RV.spec_accept(p_tok, torch.ones(1, k), torch.rand(1, k, generator=gen), torch.tensor([k]))
        assert int(accepted) == v.num_accepted
        assert int(best[int(accepted)]) == v.tokens[-1]


@pytest.mark.parametrize("twin", ["reference", "triton"])
def test_spec_accept_decision_rule_exact(twin):
    """``q > 0 and u * q < p`` exactly as Python floats decide it, at the rounding boundary too:
    p is the fp32 rounding of u * q, so it sits just above or below the exact product."""
    if twin == "triton" and not INTERPRETED:
        pytest.skip("needs the interpreted Triton kernels")
    gen = torch.Generator().manual_seed(8)
    N, k = 64, 8
    u = torch.rand(N, k, generator=gen)
    q = torch.rand(N, k, generator=gen)
    p = (u.double() * q.double()).float()  # ties, and products one rounding away
    p[::4] = torch.rand(N, k, generator=gen)[::4]
    q[1::7] = 0.0  # q == 0: rejected even when p > 0
    nd = torch.randint(0, k + 1, (N,), generator=gen)
    if twin == "triton":
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("TRITON_INTERPRET", "1")
            mp.setenv("KVBATCH_KERNELS", "triton")
            got = dispatch.spec_accept(p, q, u, nd)
    else:
        got = dispatch.spec_accept(p, q, u, nd)
    for n in range(N):
        want = 0
        while want < int(nd[n]):
            qi, ui, pi = float(q[n, want]), float(u[n, want]), float(p[n, want])
            if not (qi > 0 and ui * qi < pi):
                break
            want += 1
        assert int(got[n]) == want, n


@needs_interpreter
def test_spec_edges(use_triton):
    """Empty batch; no drafts at all (the bonus token); padded entries past num_drafts ignored;
    strided inputs; a row whose residual is all zeros falls back to p."""
    empty = torch.zeros(0, 3)
    assert dispatch.spec_accept(empty, empty, empty, torch.zeros(0, dtype=torch.long)).shape == (0,)
    gen = torch.Generator().manual_seed(9)
    V = 7
    target = torch.softmax(torch.randn(3, 1, V, generator=gen), -1)
    noise = torch.empty(3, V).exponential_(generator=gen)
    none = torch.zeros(3, 0)
    nd0 = torch.zeros(3, dtype=torch.long)
    acc = dispatch.spec_accept(none, none, none, nd0)
    assert acc.tolist() == [0, 0, 0]
    got = dispatch.spec_recover(target, None, torch.zeros(3, 0, dtype=torch.long), acc, nd0, noise)
    assert got.tolist() == torch.argmax(target[:, 0] / noise, -1).tolist()

    wide = torch.rand(4, 2, 8, generator=gen)  # [p | q] interleaved: strided views
    p_tok, q_tok = wide[:, 0], wide[:, 1]
    u = torch.rand(4, 8, generator=gen)
    nd = torch.tensor([8, 3, 0, 5])
    want = RV.spec_accept(p_tok, q_tok, u, nd)
    assert torch.equal(dispatch.spec_accept(p_tok, q_tok, u, nd), want)
    garbage = p_tok.clone()
    garbage[1, 3:] = 2.0  # past num_drafts: must not matter
    assert torch.equal(dispatch.spec_accept(garbage, q_tok, u, nd), want)

    target = torch.softmax(torch.randn(2, 3, V, generator=gen), -1)
    draft = target[:, :2].clone()  # q == p: every residual is zero
    tokens = torch.randint(0, V, (2, 2), generator=gen)
    acc = torch.tensor([0, 1])
    nd = torch.tensor([2, 2])
    noise = torch.empty(2, V).exponential_(generator=gen)
    got = dispatch.spec_recover(target, draft, tokens, acc, nd, noise)
    assert torch.equal(got, RV.spec_recover(target, draft, tokens, acc, nd, noise))
    assert got.tolist() == [int(torch.argmax(target[0, 0] / noise[0])), int(torch.argmax(target[1, 1] / noise[1]))]


@needs_interpreter
def test_spec_recover_long_vocab_blocks(use_triton):
    """A vocabulary spanning several blocks, with a tie across blocks: the first index wins."""
    from kvbatch.kernels.triton_verify import spec_recover

    gen = torch.Generator().manual_seed(10)
    V = 100
    target = torch.rand(2, 2, V, generator=gen)
    target[:, :, 90] = target[:, :, 10] = 5.0  # same value in two blocks of 16
    noise = torch.ones(2, V)
    tokens = torch.tensor([[10], [3]])
    args = (target, None, tokens, torch.tensor([0, 1]), torch.tensor([1, 1]), noise)
    got = spec_recover(*args, block_v=16)
    assert torch.equal(got, RV.spec_recover(*args))
    assert got.tolist() == [90, 10]  # row 0: draft 10 rejected and zeroed; row 1: bonus row, tie -> 10


# ---------------------------------------------------------------------------------------------
# the benchmark script's new cases, on the CPU


@needs_interpreter
def test_benchmark_cases_run_on_cpu(use_triton, monkeypatch):
    """The GPU benchmark's MoE / MLA / verifier cases build and check on tiny CPU shapes (the
    script itself needs CUDA; this keeps its code from rotting on CPU-only CI)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import gpu_kernels as G
    finally:
        sys.path.pop(0)
    monkeypatch.setattr(G.gpu_cases, "DEVICE", "cpu")
    K = G.import_kernels()
    for case in (G.moe_case(K, 5, 32, 16, 4, 2, torch.float32),
                 G.mla_case(K, [9, 20], 4, 32, 16, torch.float32, block_size=4),
                 G.verify_case(K, 6, 3, 50)):
        ok, err = case[2]()
        assert ok, err


def test_benchmark_without_cuda_exits_cleanly():
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here")
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "KVBATCH_KERNELS")}
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_kernels.py")], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "no CUDA device" in proc.stdout, proc.stdout + proc.stderr


@fresh_process_only
def test_moe_mla_verify_in_a_fresh_process():
    rerun_in_fresh_interpreter(__file__)
