"""Weight-only int8 projections: the quantization error is bounded by half a step per weight,
every int8 route computes what the dequantized weight computes, and an int8 engine equals an
fp32 model that holds those dequantized weights."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from kvbatch.engine.models import factory
from kvbatch.engine.runtime.engine_config import EngineConfig
from kvbatch.engine.runtime.llm import LLM, GenerationRequest
from kvbatch.engine.runtime.sampling_params import SamplingParams
from kvbatch.kernels import dispatch
from kvbatch.kernels.cpu import kernel_choice as kc
from kvbatch.kernels.cpu import native as native_kernels
from kvbatch.kernels.cpu.linear import INT8, LinearFormat
from kvbatch.kernels.cpu.quant import DEQUANT, GEMV, INT8PACK, Int8Weight, int8_linear, quantize_int8
from tests.logit_capture import assert_logits_match, capture_logits
from tests.test_kernel_choice import fake_timer
from tests.tiny_models import VOCAB, build_tiny

ROUTES = [pytest.param(INT8PACK, marks=pytest.mark.skipif(not kc.int8pack_available(), reason="no int8pack op")),
          DEQUANT,
          pytest.param(GEMV, marks=pytest.mark.skipif(not native_kernels.available(), reason="no native kernels"))]


def test_quantization_error_is_at_most_half_a_step():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 80, generator=g) * torch.linspace(0.01, 10, 48)[:, None]  # channels of every scale
    w[7] = 0.0
    q = quantize_int8(w)
    assert q.q.dtype == torch.int8 and q.q.shape == (48, 80) and q.scale.shape == (48,)
    assert int(q.q.abs().max()) == 127 and int(q.q[7].abs().max()) == 0 and float(q.scale[7]) == 1.0
    err = (q.dequantize() - w).abs()
    assert bool((err <= q.scale[:, None] / 2 + 1e-7).all())
    # each channel's largest weight is exact: the scale is max|w| / 127
    torch.testing.assert_close(q.dequantize().abs().amax(1)[w.abs().amax(1) > 0], w.abs().amax(1)[w.abs().amax(1) > 0])
    with pytest.raises(ValueError, match=r"2-D float weight, got \(4,\) torch.float32"):
        quantize_int8(torch.ones(4))
    with pytest.raises(ValueError, match="unknown int8 route 'fast'"):
        int8_linear(torch.ones(1, 80), q, None, "fast")


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_route_computes_the_dequantized_product(route, dtype):
    g = torch.Generator().manual_seed(1)
    w, b = torch.randn(96, 64, generator=g), torch.randn(96, generator=g)
    q = quantize_int8(w, (route,))  # gemv: natively at any row count (fp32), bf16 dequantized
    for rows in (1, 7, 70):
        x = torch.randn(rows, 64, generator=g)
        want = torch.nn.functional.linear(x, q.dequantize(), b)
        got = int8_linear(x.to(dtype), q, b.to(dtype), route)
        assert got.dtype == dtype and got.shape == (rows, 96)
        tol = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 0.2, "rtol": 0.02}
        torch.testing.assert_close(got.float(), want, **tol)


def test_an_int8_weight_holds_the_layouts_its_routes_read():
    w = torch.randn(40, 24, generator=torch.Generator().manual_seed(2))
    plain = quantize_int8(w)
    assert plain.blocks is None and plain.q is not None
    native = quantize_int8(w, (GEMV, DEQUANT))  # one copy: the blocks, which dequant reads too
    assert native.q is None and native.shape == (40, 24) and torch.equal(native.values(), plain.q)
    assert torch.equal(native.dequantize(), plain.dequantize())
    both = quantize_int8(w, (GEMV, INT8PACK))  # int8pack needs [out, in]
    assert both.q is not None and both.blocks is not None
    with pytest.raises(ValueError, match="unknown int8 routes \\['fast'\\]"):
        quantize_int8(w, ("fast",))


def test_an_int8_format_takes_its_route_per_bucket(monkeypatch):
    used: list[str] = []
    real = int8_linear
    monkeypatch.setattr("kvbatch.kernels.cpu.linear.int8_linear",
                        lambda x, w, b, route: used.append(route) or real(x, w, b, route))
    fmt = LinearFormat(INT8, torch.float32, bucket_kinds=(DEQUANT, DEQUANT, DEQUANT, DEQUANT))
    held = fmt.prepare(torch.randn(16, 8))
    assert isinstance(held, Int8Weight)
    fmt(torch.randn(3, 8), held)
    assert used == [DEQUANT]
    with pytest.raises(ValueError, match="not batch-invariant"):
        fmt(torch.randn(3, 8), held, batch_invariant=True)


def test_int8_routes_are_chosen_by_measurement(tmp_path):
    if not kc.int8pack_available():
        pytest.skip("one route only")
    timer = fake_timer({INT8PACK: [1.0, 2.0, 9.0, 40.0], DEQUANT: [5.0, 5.0, 5.0, 5.0]})
    choice = kc.choose_kernels(torch.float32, [(32, 16)], weights="int8", cache_dir=tmp_path, timer=timer)
    assert choice.fmt == LinearFormat(INT8, torch.float32, bucket_kinds=(INT8PACK, INT8PACK, DEQUANT, DEQUANT))
    again = kc.choose_kernels(torch.float32, [(32, 16)], weights="int8", cache_dir=tmp_path, timer=timer)
    assert again.source == "cache"
    # the float choice for the same shapes is another key
    float_timer = fake_timer({"onednn": [1.0] * 4, "blas": [2.0] * 4})
    assert kc.choose_kernels(torch.float32, [(32, 16)], cache_dir=tmp_path, timer=float_timer).source != "cache"
    with pytest.raises(ValueError, match="int8 weights run on the CPU only"):
        kc.choose_kernels(torch.float32, [(32, 16)], weights="int8", device="meta", cache_dir=tmp_path)
    with pytest.raises(ValueError, match="batch-invariant mode needs full-precision weights"):
        kc.choose_kernels(torch.float32, [(32, 16)], weights="int8", batch_invariant=True, cache_dir=tmp_path)


def test_the_int8_gemv_is_a_candidate_at_every_row_count(tmp_path):
    if not native_kernels.available():
        pytest.skip("no native kernels")
    calls: list[tuple[str, int]] = []
    timer = fake_timer({INT8PACK: [5.0, 5.0, 2.0, 2.0], DEQUANT: [5.0, 5.0, 3.0, 1.0], GEMV: [1.0, 2.0, 1.0, 3.0]},
                       calls)
    choice = kc.choose_kernels(torch.float32, [(32, 16)], weights="int8", cache_dir=tmp_path, timer=timer)
    # timed at 64 and 128 rows too: it keeps 64, and 128 goes to dequant, measured faster there
    assert {r for k, r in calls if k == GEMV} == {1, 8, 64, 128}
    assert choice.fmt.bucket_kinds == (GEMV, GEMV, GEMV, DEQUANT)
    # the fused decode layers take decode rows only, whatever route wins past them
    assert choice.fmt.fused_rows(1) and choice.fmt.fused_rows(8) and not choice.fmt.fused_rows(64)
    assert GEMV not in kc.candidates_for(torch.bfloat16, "int8")  # bf16 activations: no native int8 GEMV


@pytest.mark.skipif(not native_kernels.available(), reason="no native kernels")
def test_the_gemv_route_runs_the_native_kernel_past_decode_rows(monkeypatch):
    # 70 rows (past the float GEMV's 8) still take the int8 blocks natively, not a dequantized copy
    seen: list[int] = []
    real = native_kernels.gemv
    monkeypatch.setattr(native_kernels, "gemv", lambda x, w, b=None: seen.append(x.shape[0]) or real(x, w, b))
    q = quantize_int8(torch.randn(40, 24, generator=torch.Generator().manual_seed(3)), (GEMV,))
    x = torch.randn(70, 24)
    torch.testing.assert_close(int8_linear(x, q, None, GEMV), x @ q.dequantize().t(), atol=1e-4, rtol=1e-4)
    assert seen == [70]


@pytest.mark.parametrize("gemv", [False, pytest.param(True, marks=pytest.mark.skipif(
    not native_kernels.available(), reason="no native kernels"))])
def test_the_int8_engine_equals_fp32_over_the_dequantized_weights(tmp_path, monkeypatch, gemv):
    # gemv: the native int8 GEMV wins 1-8 rows, so decode runs the fused layers over int8 blocks
    monkeypatch.setenv("KVBATCH_CACHE_DIR", str(tmp_path / "cache"))
    times = {INT8PACK: [1.0, 9.0, 9.0, 9.0], DEQUANT: [9.0, 1.0, 1.0, 1.0]}
    if gemv:
        times[GEMV] = [0.5, 0.5, 9.0, 9.0]
    monkeypatch.setattr(factory, "choose_kernels", partial(kc.choose_kernels, timer=fake_timer(times)))
    fused_rows: list[int] = []
    real = dispatch.decode_layers
    monkeypatch.setattr(dispatch, "decode_layers", lambda *a, **k: fused_rows.append(a[2].shape[0]) or real(*a, **k))
    ref = build_tiny("qwen2", tmp_path / "model")  # tied embeddings: the head is quantized, the embedding not
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith("proj.weight"):
                p.copy_(quantize_int8(p).dequantize())
        ref.lm_head.weight = torch.nn.Parameter(quantize_int8(ref.lm_head.weight).dequantize())
    llm = LLM(str(tmp_path / "model"), engine_config=EngineConfig(block_size=4, num_blocks=64, weights="int8"))
    assert llm.runner.model.linear.kind == INT8
    assert llm.kv_root_key != LLM(str(tmp_path / "model"), engine_config=EngineConfig(
        block_size=4, num_blocks=64, linear="blas")).kv_root_key  # int8 blocks never mix with fp32 ones
    seen = capture_logits(llm)
    prompts = [torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (9, 4)]
    out = llm.generate([GenerationRequest(f"r{i}", SamplingParams(max_tokens=5 - 2 * i, temperature=0, ignore_eos=True),
                                          prompt_token_ids=p) for i, p in enumerate(prompts)])
    for i, p in enumerate(prompts):
        assert_logits_match(ref, seen, f"r{i}", p, out[i].output_token_ids, "int8")
    assert bool(fused_rows) == gemv and set(fused_rows) <= {1, 2}
