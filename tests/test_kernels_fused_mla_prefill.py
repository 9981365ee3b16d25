"""MLA prefill on the Triton path: the paged prefill kernel as multi-query attention over the
latent cache rows (key ``[c_kv ; k_pe]``, value the same row, the first ``kv_lora_rank`` output
columns kept), against :func:`kvbatch.kernels.reference_mla.mla_prefill_attention`.

In the interpreter, like tests/test_kernels.py (``TRITON_INTERPRET=1`` set before triton is
imported; a fresh-process rerun when the kernels were compiled for a GPU first). Shapes drawn by
hypothesis: chunks after cached prefixes and whole prompts, non-power-of-two latent widths, block
sizes 4 and 16, empty chunks. Tolerance: attention's (fp32 1e-4, fp16 3e-3, bf16 3e-2; bf16 is
loaded as such and computed in fp32).
"""

from __future__ import annotations

import sys

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

# First: it sets TRITON_INTERPRET before triton builds the kernels.
from tests.triton_interpreter import (ATTN_TOL, DTYPES, REPO,  # isort: skip
                                      assert_close, fresh_process_only, interpreter_only, interpreter_settings,
                                      rerun_in_fresh_interpreter, use_triton)  # noqa: F401 (fixture)
from kvbatch.kernels import dispatch
from kvbatch.kernels import reference_mla as RM

needs_interpreter = interpreter_only("test_mla_prefill_in_a_fresh_process")


def prefill_inputs(gen, seqs, Hq, C, R, block_size, dtype):
    """``seqs``: (cached, new) token counts per sequence; the cache holds every token's row."""
    need = [-(-(c + n) // block_size) for c, n in seqs]
    num_blocks = sum(need) + 2
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(seqs), max(max(need), 1), dtype=torch.int32)
    used = 0
    for s, n in enumerate(need):
        tables[s, :n] = perm[used:used + n].to(torch.int32)
        used += n
    cache = torch.randn(num_blocks, block_size, 1, C + R, generator=gen).to(dtype)
    T = sum(n for _, n in seqs)
    q_latent = torch.randn(T, Hq, C, generator=gen).to(dtype)
    q_pe = torch.randn(T, Hq, R, generator=gen).to(dtype)
    cu = torch.tensor([0] + [sum(n for _, n in seqs[:i + 1]) for i in range(len(seqs))], dtype=torch.int32)
    lens = torch.tensor([c + n for c, n in seqs], dtype=torch.int32)
    return q_latent, q_pe, cache, tables, cu, lens


@needs_interpreter
@interpreter_settings(10)
@given(
    seqs=st.lists(st.tuples(st.integers(0, 20), st.integers(0, 9)), min_size=1, max_size=3),
    Hq=st.sampled_from([1, 3, 4]),
    C=st.sampled_from([16, 24]),
    R=st.sampled_from([8, 16]),
    block_size=st.sampled_from([4, 16]),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_mla_prefill_matches_reference(seqs, Hq, C, R, block_size, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    q_latent, q_pe, cache, tables, cu, lens = prefill_inputs(gen, seqs, Hq, C, R, block_size, dtype)
    expected = RM.mla_prefill_attention(q_latent, q_pe, cache, tables, cu, lens, 0.3)
    longest = max(n for _, n in seqs)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        mp.setenv("KVBATCH_KERNELS", "triton")
        actual = dispatch.mla_prefill_attention(q_latent, q_pe, cache, tables, cu, lens, 0.3, longest)
    if longest == 0:  # nothing to compute: both leave the (empty or unwritten) rows alone
        assert actual.shape == expected.shape
        return
    assert_close(actual, expected, ATTN_TOL[dtype])


def test_mla_prefill_reference_path_is_the_twin(monkeypatch):
    """Without Triton the dispatch point is the readable twin itself."""
    monkeypatch.setenv("KVBATCH_KERNELS", "reference")
    gen = torch.Generator().manual_seed(3)
    args = prefill_inputs(gen, [(5, 3), (0, 4)], 2, 16, 8, 4, torch.float32)
    assert torch.equal(dispatch.mla_prefill_attention(*args, 0.5, 4), RM.mla_prefill_attention(*args, 0.5))


@needs_interpreter
@pytest.mark.usefixtures("use_triton")
def test_benchmark_case_runs_on_cpu(monkeypatch):
    """The GPU benchmark's MLA prefill case builds and checks on a tiny CPU shape."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import gpu_kernels as G
    finally:
        sys.path.pop(0)
    monkeypatch.setattr(G.gpu_cases, "DEVICE", "cpu")
    ok, err = G.mla_prefill_case(G.import_kernels(), [9, 5], [4, 5], 2, 16, 8, torch.float32, block_size=4)[2]()
    assert ok, err


@fresh_process_only
def test_mla_prefill_in_a_fresh_process():
    rerun_in_fresh_interpreter(__file__)
