"""MKL's packed-weight sgemm (kernels/cpu/mkl_packed.py): the same product as ``x @ w.T`` for any
shape and row count, clear errors for what it does not take, and a kernel measurement that packs
each copy afresh (a cloned packed buffer crashed MKL with SIGFPE)."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbatch.kernels.cpu import kernel_choice as kc
from kvbatch.kernels.cpu import mkl_packed
from kvbatch.kernels.cpu.linear import BLAS, MKL, LinearFormat

pytestmark = pytest.mark.skipif(not mkl_packed.available(), reason="this torch build exports no MKL packed sgemm")


def _rand(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@settings(max_examples=40, deadline=None)
@given(out_f=st.integers(1, 200), in_f=st.integers(1, 200), rows=st.integers(0, 150), seed=st.integers(0, 99),
       bias=st.booleans())
def test_packed_multiply_matches_plain_matmul(out_f, in_f, rows, seed, bias):
    w, x = _rand(out_f, in_f, seed=seed), _rand(rows, in_f, seed=seed + 1)
    b = _rand(out_f, seed=seed + 2) if bias else None
    want = x @ w.t() + (b if bias else 0)
    got = mkl_packed.linear(x, mkl_packed.pack(w), b)
    assert got.shape == (rows, out_f)
    torch.testing.assert_close(got, want, atol=1e-4 * in_f ** 0.5, rtol=1e-4)


def test_row_views_and_strided_inputs_multiply_like_contiguous_ones():
    w = _rand(96, 64, seed=0)
    packed = mkl_packed.pack(w)
    x = _rand(10, 128, seed=1)
    for view in (x[:, :64], x[:, ::2], x[2:7, 64:], _rand(64, 9, seed=2).t(), _rand(1, 64, seed=3).expand(5, 64)):
        torch.testing.assert_close(mkl_packed.linear(view, packed), view @ w.t(), atol=1e-4, rtol=1e-4)


def test_what_it_does_not_take_is_refused_by_name():
    packed = mkl_packed.pack(_rand(8, 4, seed=0))
    with pytest.raises(ValueError, match=r"x must be fp32 \[rows, 4\], not torch.float32 \(3, 5\)"):
        mkl_packed.linear(_rand(3, 5, seed=1), packed)
    with pytest.raises(ValueError, match="x must be fp32"):
        mkl_packed.linear(_rand(3, 4, seed=1).bfloat16(), packed)
    with pytest.raises(ValueError, match=r"2-D fp32 CPU weight, not torch.bfloat16 \(8, 4\)"):
        mkl_packed.pack(_rand(8, 4, seed=0).bfloat16())
    with pytest.raises(ValueError, match=r"cannot pack an empty weight of shape \(0, 4\)"):
        mkl_packed.pack(torch.empty(0, 4))


def test_the_measurement_packs_every_copy_and_never_clones_one():
    packed = mkl_packed.pack(_rand(8, 4, seed=0))
    with pytest.raises(TypeError, match="cannot copy a prepared weight of type PackedWeight"):
        kc._copy_prepared(packed)
    for how in (copy.copy, copy.deepcopy, pickle.dumps):
        with pytest.raises(TypeError, match="cannot be copied or pickled"):
            how(packed)
    # Several copies of a layer (num_layers 4 at these small shapes): each one multiplied for real.
    ran: list[tuple[str, int]] = []

    def timer(kind: str, rows: int, run) -> float:
        run()
        ran.append((kind, rows))
        return {MKL: 1.0, BLAS: 2.0}[kind] * rows

    timings = kc.measure([MKL, BLAS], torch.float32, [(96, 64), (64, 160)], 4, timer)
    assert [t[0] < t[1] for t in zip(timings[MKL], timings[BLAS])] == [True] * len(kc.BUCKET_ROWS)
    assert {r for k, r in ran if k == MKL} == set(kc.BUCKET_ROWS)


def test_a_model_format_multiplies_through_it_with_bias():
    fmt = LinearFormat(MKL, torch.float32)
    w, b, x = _rand(48, 32, seed=0), _rand(48, seed=1), _rand(7, 32, seed=2)
    prepared = fmt.prepare(w)
    assert isinstance(prepared, mkl_packed.PackedWeight)
    # the fused decode layers take its packed bytes themselves (their batched schedule calls MKL)
    assert fmt.fused_rows(1) and fmt.fused_rows(64) and fmt.fused_gemm(64)
    fused = fmt.fused_weight(prepared, 64)
    assert fused.data is prepared._buffer and (fused.in_features, fused.out_features) == (32, 48)
    torch.testing.assert_close(fmt(x, prepared, b), torch.nn.functional.linear(x, w, b), atol=1e-4, rtol=1e-4)
