"""The fused MLP activation (``silu_and_mul``) and the last residual join: Triton against twins.

Like tests/test_kernels.py: the Triton kernels run on the CPU in the interpreter
(``TRITON_INTERPRET=1``, set before triton is imported; if the kernels were compiled for a GPU
before this module could set it, the in-process tests skip and one test reruns the file in a
fresh process), hypothesis draws small shapes (derandomized, no shrinking), non-powers of two
included.

Tolerances (max |triton - reference| <= atol + rtol * |reference|): ``silu`` is a
transcendental, computed by numpy's ``exp`` in the interpreter and by PyTorch's vectorized one in
the twin, so not bit-exact: fp32 1e-6 / 1e-6 (one or two units in the last place); 16-bit
inputs are loaded as such and computed in fp32, then rounded twice like the two PyTorch ops
(the interpreter truncates where the GPU rounds): fp16 1e-3 / 2e-3, bf16 1e-2 / 1.6e-2. The
residual join is an add and a norm: its add (``new_residual``) exact in fp32 and fp16 (bf16: the
interpreter's truncation again), the RMSNorm tolerance of tests/test_kernels.py in the normed rows.
"""

from __future__ import annotations

import sys

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

# First: it sets TRITON_INTERPRET before triton builds the kernels.
from tests.triton_interpreter import (DTYPES, REPO,  # isort: skip
                                      assert_close, fresh_process_only, interpreter_only, interpreter_settings,
                                      rerun_in_fresh_interpreter, randn, use_triton)  # noqa: F401 (fixture)
from kvbatch.kernels import dispatch
from kvbatch.kernels import reference as R

needs_interpreter = interpreter_only("test_fused_kernels_in_a_fresh_process")

SETTINGS = interpreter_settings(15)
SILU_TOL = {torch.float32: (1e-6, 1e-6), torch.float16: (1e-3, 2e-3), torch.bfloat16: (1e-2, 1.6e-2)}
NORM_TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (1e-3, 2e-3), torch.bfloat16: (1e-2, 1.6e-2)}


def test_silu_and_mul_twin_is_the_mlp_activation():
    """The twin is what the MLP computed before (``F.silu(gate) * up``), bit for bit, and a
    width that cannot split into gate and up halves is refused with the width named."""
    gen = torch.Generator().manual_seed(0)
    x = randn(gen, 3, 10)
    assert torch.equal(R.silu_and_mul(x), torch.nn.functional.silu(x[:, :5]) * x[:, 5:])
    with pytest.raises(ValueError, match="odd width 7"):
        R.silu_and_mul(randn(gen, 2, 7))


@needs_interpreter
@SETTINGS
@given(
    rows=st.integers(0, 6),
    inter=st.sampled_from([1, 5, 16, 48, 100, 300]),
    dtype=st.sampled_from(DTYPES),
    scale=st.sampled_from([1.0, 8.0]),
    seed=st.integers(0, 2**16),
)
def test_silu_and_mul_matches_reference(rows, inter, dtype, scale, seed):
    gen = torch.Generator().manual_seed(seed)
    x = randn(gen, rows, 2 * inter, dtype=dtype) * scale
    expected = R.silu_and_mul(x)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        mp.setenv("KVBATCH_KERNELS", "triton")
        actual = dispatch.silu_and_mul(x)
    assert_close(actual, expected, SILU_TOL[dtype])


@needs_interpreter
@pytest.mark.usefixtures("use_triton")
def test_silu_and_mul_strided_3d_and_errors():
    """A 3-D input and a row-strided view (the gate/up half of a wider tensor) give the twin's
    values; an odd width is refused by the kernel as by the twin; an empty batch is empty."""
    gen = torch.Generator().manual_seed(1)
    x = randn(gen, 2, 3, 34)
    assert_close(dispatch.silu_and_mul(x), R.silu_and_mul(x), SILU_TOL[torch.float32])
    wide = randn(gen, 5, 50)[:, 8:48]  # rows 50 apart, 40 columns
    assert_close(dispatch.silu_and_mul(wide), R.silu_and_mul(wide), SILU_TOL[torch.float32])
    assert dispatch.silu_and_mul(torch.zeros(0, 8)).shape == (0, 4)
    with pytest.raises(ValueError, match="odd width 9"):
        dispatch.silu_and_mul(torch.zeros(2, 9))


@needs_interpreter
@pytest.mark.usefixtures("use_triton")
def test_silu_and_mul_column_blocks():
    """More columns than one program's block: the grid's second axis covers them all."""
    from kvbatch.kernels.triton_activation import silu_and_mul

    gen = torch.Generator().manual_seed(2)
    x = randn(gen, 3, 2 * 70)
    assert_close(silu_and_mul(x, block=16), R.silu_and_mul(x), SILU_TOL[torch.float32])


@needs_interpreter
@SETTINGS
@given(
    tokens=st.integers(1, 7),
    hidden=st.sampled_from([3, 24, 100]),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_last_residual_join_matches_unfused(tokens, hidden, dtype, seed):
    """The models' last join: gather the logits rows of ``h`` and ``residual``, then one fused
    add + RMSNorm. Equals the unfused ``(h + residual)[rows]`` then RMSNorm of before: exact on
    the reference path, within the RMSNorm tolerance through the Triton kernel (its add exact but
    in bf16, which the interpreter truncates)."""
    gen = torch.Generator().manual_seed(seed)
    h = randn(gen, tokens, hidden, dtype=dtype)
    residual = randn(gen, tokens, hidden, dtype=dtype) * 2
    weight = randn(gen, hidden, dtype=dtype)
    rows = torch.randint(0, tokens, (max(1, tokens // 2),), generator=gen)
    before_sum = (h + residual).index_select(0, rows)
    before = R.rms_norm(before_sum, weight, 1e-5)[0]
    fused_ref = R.rms_norm(h.index_select(0, rows), weight, 1e-5, residual.index_select(0, rows))
    assert torch.equal(fused_ref[0], before) and torch.equal(fused_ref[1], before_sum)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        mp.setenv("KVBATCH_KERNELS", "triton")
        normed, summed = dispatch.rms_norm(h.index_select(0, rows), weight, 1e-5, residual.index_select(0, rows))
    if dtype == torch.bfloat16:  # the interpreter truncates to bf16 where the GPU rounds
        assert_close(summed, before_sum, NORM_TOL[dtype])
    else:
        assert torch.equal(summed, before_sum)
    assert_close(normed, before, NORM_TOL[dtype])


@needs_interpreter
@pytest.mark.usefixtures("use_triton")
def test_benchmark_case_runs_on_cpu(monkeypatch):
    """The GPU benchmark's silu_and_mul case builds and checks on a tiny CPU shape (the script
    itself needs CUDA; this keeps its code from rotting on CPU-only CI)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import gpu_kernels as G
    finally:
        sys.path.pop(0)
    monkeypatch.setattr(G.gpu_cases, "DEVICE", "cpu")
    ok, err = G.silu_and_mul_case(G.import_kernels(), 5, 40, torch.float32)[2]()
    assert ok, err


@fresh_process_only
def test_fused_kernels_in_a_fresh_process():
    rerun_in_fresh_interpreter(__file__)
