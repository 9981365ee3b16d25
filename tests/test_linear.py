"""The projection multiply: oneDNN packed weights, MKL packed weights and the BLAS fallback give
the model the same numbers, and batch-invariant mode really makes a row's bits independent of its
batch."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbatch.engine.runtime.engine_config import EngineConfig
from kvbatch.engine.runtime.llm import LLM, GenerationRequest
from kvbatch.engine.runtime.sampling_params import SamplingParams
from kvbatch.kernels.cpu import mkl_packed
from kvbatch.kernels.cpu.linear import (
    BLAS,
    MKL,
    ONEDNN,
    LinearFormat,
    choose_linear_format,
    onednn_available,
)
from tests.logit_capture import assert_logits_match, capture_logits
from tests.tiny_models import VOCAB, build_tiny

needs_onednn = pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN packed linear")
needs_mkl = pytest.mark.skipif(not mkl_packed.available(), reason="this torch build exports no MKL packed sgemm")
INVARIANT_FORMATS = [BLAS, pytest.param(ONEDNN, marks=needs_onednn)]  # the kernels with a measured padding rule
FORMATS = [*INVARIANT_FORMATS, pytest.param(MKL, marks=needs_mkl)]
# every (kernel, dtype) a format is made of: MKL's packed sgemm multiplies fp32 only
# (test_mkl_refuses_what_is_not_fp32)
FORMAT_DTYPES = [pytest.param(BLAS, torch.float32, id="blas-fp32"), pytest.param(BLAS, torch.bfloat16, id="blas-bf16"),
                 pytest.param(ONEDNN, torch.float32, id="onednn-fp32", marks=needs_onednn),
                 pytest.param(ONEDNN, torch.bfloat16, id="onednn-bf16", marks=needs_onednn),
                 pytest.param(MKL, torch.float32, id="mkl-fp32", marks=needs_mkl)]


def _format(kind: str, dtype: torch.dtype) -> LinearFormat:
    """The format under test, or where this CPU cannot run it, the one the engine runs instead.
    oneDNN packs bf16 only with AVX512-BW/VL/DQ or AVX-NE-CONVERT: on an AVX2-only CPU (or oneDNN
    capped to AVX2) the engine's choice falls back to BLAS, forcing oneDNN is refused, and the test
    holds the BLAS format that runs there to the same numbers."""
    if kind == ONEDNN and not onednn_available(dtype):
        with pytest.MonkeyPatch.context() as mp:
            mp.delenv("KVBATCH_LINEAR", raising=False)
            assert choose_linear_format(dtype).kind == BLAS
            mp.setenv("KVBATCH_LINEAR", ONEDNN)
            with pytest.raises(ValueError, match=f"cannot pack {dtype} weights with oneDNN"):
                choose_linear_format(dtype)
        kind = BLAS
    return LinearFormat(kind, dtype)


def _weights(out_f: int, in_f: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(out_f, in_f, generator=g).to(dtype), torch.randn(out_f, generator=g).to(dtype)


@pytest.mark.parametrize(("kind", "dtype"), FORMAT_DTYPES)
def test_multiply_matches_f_linear(kind, dtype):
    fmt = _format(kind, dtype)
    w, b = _weights(96, 64, dtype, 0)
    x = torch.randn(7, 64).to(dtype)
    tol = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 0.1, "rtol": 0.02}
    want = torch.nn.functional.linear(x.float(), w.float(), b.float())
    torch.testing.assert_close(fmt(x, fmt.prepare(w), b).float(), want, **tol)
    torch.testing.assert_close(fmt(x, fmt.prepare(w)).float(), want - b.float(), **tol)


# (1536, 576) is SmolLM2's down projection, where a single fp32 row takes a different oneDNN
# kernel than two or more (measured), so the padding rule is exercised for real.
@pytest.mark.parametrize("kind", INVARIANT_FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(576, 1536), (960, 576), (64, 96)])
def test_batch_invariant_rows_do_not_depend_on_the_batch(kind, dtype, shape):
    out_f, in_f = shape
    fmt = _format(kind, dtype)
    w, b = _weights(out_f, in_f, dtype, 1)
    packed = fmt.prepare(w)
    x = torch.randn(40, in_f).to(dtype)
    full = fmt(x, packed, b, batch_invariant=True)
    for rows in range(1, 40):
        assert torch.equal(fmt(x[:rows], packed, b, batch_invariant=True), full[:rows]), f"{rows} rows"


def test_mkl_refuses_what_is_not_fp32():
    for dtype in (torch.bfloat16, torch.float16):
        with pytest.raises(ValueError, match=f"the mkl kernel multiplies fp32 on the CPU, not {dtype}"):
            LinearFormat(MKL, dtype)


def test_batch_invariant_padding_floors_are_the_documented_ones():
    # docs/correctness.md (deterministic mode): small batches pad to 24 rows in fp32, 48 in bf16
    assert [LinearFormat("blas", torch.float32).invariant_rows(r) for r in (0, 1, 23, 24, 100)] == [0, 24, 24, 24, 100]
    assert LinearFormat("blas", torch.bfloat16).invariant_rows(5) == 48
    assert LinearFormat("onednn", torch.float32).invariant_rows(1) == 2
    assert LinearFormat("onednn", torch.bfloat16).invariant_rows(47) == 48
    with pytest.raises(ValueError, match="the mkl kernel has no measured batch-invariant padding"):
        LinearFormat(MKL, torch.float32).invariant_rows(1)


@needs_onednn
@settings(max_examples=25, deadline=None)
@given(in_f=st.integers(1, 300), out_f=st.integers(1, 300), rows=st.integers(1, 33), seed=st.integers(0, 99))
def test_onednn_invariance_holds_for_any_shape(in_f, out_f, rows, seed):
    fmt = LinearFormat(ONEDNN, torch.float32)
    w, _ = _weights(out_f, in_f, torch.float32, seed)
    packed = fmt.prepare(w)
    x = torch.randn(rows + 17, in_f, generator=torch.Generator().manual_seed(seed))
    assert torch.equal(fmt(x[:rows], packed, batch_invariant=True), fmt(x, packed, batch_invariant=True)[:rows])


def test_format_choice_and_override(monkeypatch):
    monkeypatch.delenv("KVBATCH_LINEAR", raising=False)
    assert choose_linear_format(torch.float16).kind == BLAS  # oneDNN fp16 is not used on the CPU
    if onednn_available():
        assert choose_linear_format(torch.float32).kind == ONEDNN
    # bf16 is packed exactly where this CPU can pack it, and BLAS elsewhere (AVX2-only CPUs)
    assert choose_linear_format(torch.bfloat16).kind == (ONEDNN if onednn_available(torch.bfloat16) else BLAS)
    monkeypatch.setenv("KVBATCH_LINEAR", "blas")
    assert choose_linear_format(torch.float32).kind == BLAS
    monkeypatch.setenv("KVBATCH_LINEAR", "fastest")
    with pytest.raises(ValueError, match="KVBATCH_LINEAR must be 'onednn', 'blas' or 'mkl', not 'fastest'"):
        choose_linear_format(torch.float32)
    monkeypatch.setenv("KVBATCH_LINEAR", "mkl")
    with pytest.raises(ValueError, match="KVBATCH_LINEAR=mkl multiplies fp32 weights, not torch.bfloat16"):
        choose_linear_format(torch.bfloat16)
    if mkl_packed.available():
        assert choose_linear_format(torch.float32).kind == MKL
    monkeypatch.setenv("KVBATCH_LINEAR", "onednn")
    with pytest.raises(ValueError, match="cannot pack torch.float16"):
        choose_linear_format(torch.float16)


@pytest.mark.parametrize("kind", FORMATS)
def test_both_formats_match_transformers_through_the_engine(tmp_path, monkeypatch, kind):
    monkeypatch.setenv("KVBATCH_LINEAR", kind)
    ref = build_tiny("qwen2", tmp_path)  # q/k/v biases: the biased multiply too
    llm = LLM(str(tmp_path), engine_config=EngineConfig(block_size=4, num_blocks=64))
    assert llm.runner.model.linear.kind == kind
    seen = capture_logits(llm)
    prompt = torch.randint(3, VOCAB, (11,), generator=torch.Generator().manual_seed(5)).tolist()
    out = llm.generate([GenerationRequest("r", SamplingParams(max_tokens=5, temperature=0, ignore_eos=True),
                                          prompt_token_ids=prompt)])[0]
    assert len(out.output_token_ids) == 5
    assert_logits_match(ref, seen, "r", prompt, out.output_token_ids, kind)
