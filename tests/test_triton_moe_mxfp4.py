"""MXFP4 experts in the Triton fused MoE kernel (``kernels/triton_moe.py``, ``MXFP4_W``): gpt-oss's
experts as published, uint8 blocks ``[E, N, K / 32, 16]`` (two FP4 E2M1 codes a byte, low nibble
first) and E8M0 scales ``[E, N, K / 32]``, the groups along K, dequantized tile by tile in registers.

The kernel runs in the Triton interpreter against its twin ``dispatch.fused_moe_mxfp4_reference``
(the experts dequantized by the loader's ``mxfp4.dequantize_mxfp4``, rounded to the activation dtype,
then ``reference.fused_moe``), with the FP8 experts' tolerances (tests/test_triton_moe_fp8.py: fp32
1e-4, fp16 2e-2, bf16 3e-2, the absolute part scaled by the largest output); swapped nibbles, scales
shifted by one group or of another expert, and gate/up rows left interleaved miss by over 10% of the
largest output. Then the loader's keep_fp8 path (the published blocks kept in the engine's layout,
dequantizing bit for bit to the CPU's tensors), the layer and dispatch wiring, and a tiny gpt-oss
MXFP4 model on the emulated GPU (tests/test_device_placement.py) whose experts stay uint8 there. The
sm_90 compilation of the MXFP4 variants runs in a subprocess without ``TRITON_INTERPRET``.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

# First: it sets TRITON_INTERPRET before triton builds the kernels.
from tests.triton_interpreter import (DTYPES, KERNELS, assert_close, check_moe_variant_pairs,  # isort: skip
                                      compiled_pairs, fresh_process_only, gpu_kernels_on_cpu, interpreter_only,
                                      interpreter_settings, rerun_in_fresh_interpreter,
                                      use_triton)  # noqa: F401 (fixture)
from kvbatch.engine.models.mxfp4 import dequantize_mxfp4
from kvbatch.engine.models.weights import load_checkpoint
from kvbatch.kernels import dispatch
from kvbatch.kernels import reference as R
from tests.test_gpt_oss import build_mxfp4_gpt_oss, quantize_mxfp4
from tests.test_triton_moe_fp8 import MOE_TOL, close

needs_interpreter = interpreter_only("test_moe_mxfp4_in_a_fresh_process")


def mxfp4_experts(gen: torch.Generator, E: int, N: int, K: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ~N(0, 1/K) with each group of 32 scaled by 2 ** j (j in -2..2, so neighbouring groups'
    scales differ), quantized as a checkpoint is (tests/test_gpt_oss.py's quantize_mxfp4)."""
    w = torch.randn(E, N, K // 32, 32, generator=gen) * K**-0.5
    w = w * torch.exp2(torch.randint(-2, 3, (E, N, K // 32, 1), generator=gen).float())
    return quantize_mxfp4(w.reshape(E, N, K))


def inputs(gen, T, H, I, E, k, dtype, id_low=0, id_high=None):
    x = torch.randn(T, H, generator=gen).to(dtype)
    bgu, sgu = mxfp4_experts(gen, E, 2 * I, H)
    bd, sd = mxfp4_experts(gen, E, H, I)
    ids = torch.randint(id_low, E if id_high is None else id_high, (T, k), generator=gen)
    return x, bgu, bd, ids, torch.rand(T, k, generator=gen), (sgu, sd)


def gpt_oss_extra(gen, E, H, I, dtype):
    """gpt-oss's expert biases (large enough that the clamp bites) and its clamped SwiGLU."""
    return (torch.randn(E, 2 * I, generator=gen).to(dtype), torch.randn(E, H, generator=gen).to(dtype), (1.702, 1.0))


def expected(x, bgu, bd, ids, weights, scales, *extra):
    """The twin; 16-bit: the same rounded weights upcast with x (the interpreter computes in fp32)."""
    if x.dtype == torch.float32:
        return dispatch.fused_moe_mxfp4_reference(x, bgu, bd, ids, weights, *(extra or (None,) * 3), scales)
    gu, dn = (dequantize_mxfp4(b, s).to(x.dtype).float() for b, s in ((bgu, scales[0]), (bd, scales[1])))
    extra = tuple(t.float() if isinstance(t, torch.Tensor) else t for t in extra)
    return R.fused_moe(x.float(), gu, dn, ids, weights, *extra).to(x.dtype)


def kernel(x, bgu, bd, ids, weights, scales, *extra, **tiles):
    """The interpreted kernel's MXFP4 variant (TRITON_INTERPRET set around it: hypothesis tests take no fixture)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        return KERNELS.fused_moe(x, bgu, bd, ids, weights, *extra, mxfp4_scales=scales, **tiles)


@needs_interpreter
@interpreter_settings(40)
@given(
    T=st.integers(1, 40),
    H=st.sampled_from([32, 64, 96]),
    I=st.sampled_from([32, 64]),
    E=st.integers(1, 5),
    k=st.integers(1, 3),
    dtype=st.sampled_from(DTYPES),
    gpt_oss=st.booleans(),
    block_k=st.sampled_from([32, 64]),
    out_of_range=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_mxfp4_experts_match_the_dequantized_reference(T, H, I, E, k, dtype, gpt_oss, block_k, out_of_range, seed):
    """Over shapes (K tiles of one and two groups, partial K tiles for H 96), dtypes, dropped ids, with
    and without gpt-oss's biases and clamped SwiGLU (HAS_BIAS and SWIGLU with MXFP4_W)."""
    gen = torch.Generator().manual_seed(seed)
    lo, hi = (-2, E + 2) if out_of_range else (0, E)
    x, bgu, bd, ids, w, scales = inputs(gen, T, H, I, E, k, dtype, lo, hi)
    extra = gpt_oss_extra(gen, E, H, I, dtype) if gpt_oss else ()
    want = expected(x, bgu, bd, ids, w, scales, *extra)
    close(kernel(x, bgu, bd, ids, w, scales, *extra, block_k=block_k, block_m=16), want)


def _swap_nibbles(b: torch.Tensor) -> torch.Tensor:
    return (b << 4) | (b >> 4)


def _interleave_rows(t: torch.Tensor) -> torch.Tensor:
    """Gate rows then up rows back to gpt-oss's published order (gate, up alternating)."""
    gate, up = t.chunk(2, dim=1)
    return torch.stack((gate, up), dim=2).flatten(1, 2)


@needs_interpreter
@pytest.mark.parametrize("wrong", ["nibbles swapped", "gate/up scales shifted one group",
                                   "down scales shifted one group", "scales of another expert",
                                   "gate/up rows interleaved as published"])
def test_a_wrong_scale_or_nibble_order_fails_the_comparison(wrong):
    """The check above can fail: the kernel given the high nibble first, scales off by one group, another
    expert's scales, or gate/up rows in the published (interleaved) order is far outside the tolerance."""
    gen = torch.Generator().manual_seed(31)
    x, bgu, bd, ids, w, (sgu, sd) = inputs(gen, 12, 64, 64, 3, 2, torch.float32)  # two groups a row, each GEMM
    extra = gpt_oss_extra(gen, 3, 64, 64, torch.float32)
    want = expected(x, bgu, bd, ids, w, (sgu, sd), *extra)
    assert_close(kernel(x, bgu, bd, ids, w, (sgu, sd), *extra), want, MOE_TOL[torch.float32])
    bad = {"nibbles swapped": (_swap_nibbles(bgu), _swap_nibbles(bd), sgu, sd),
           "gate/up scales shifted one group": (bgu, bd, sgu.roll(1, 2), sd),
           "down scales shifted one group": (bgu, bd, sgu, sd.roll(1, 2)),
           "scales of another expert": (bgu, bd, sgu.roll(1, 0), sd),
           "gate/up rows interleaved as published": (_interleave_rows(bgu), bd, _interleave_rows(sgu), sd)}[wrong]
    got = kernel(x, bad[0], bad[1], ids, w, bad[2:], *extra)
    with pytest.raises(AssertionError):
        assert_close(got, want, MOE_TOL[torch.float32])
    assert (got - want).abs().max() > 0.1 * want.abs().max()  # beyond the 16-bit tolerances too


@needs_interpreter
def test_mxfp4_arguments_are_checked():
    gen = torch.Generator().manual_seed(32)
    x, bgu, bd, ids, w, (sgu, sd) = inputs(gen, 3, 64, 32, 2, 1, torch.float32)
    with pytest.raises(ValueError, match=r"gate_up MXFP4 blocks \(2, 64, 2, 16\) torch.uint8 with scales \(2, 64, 1\)"):
        kernel(x, bgu, bd, ids, w, (sgu[..., :1], sd))
    with pytest.raises(ValueError, match=r"down MXFP4 blocks .* scales \(2, 64, 1\) torch.int32"):
        kernel(x, bgu, bd, ids, w, (sgu, sd.int()))
    with pytest.raises(ValueError, match="need mxfp4_scales"):
        KERNELS.fused_moe(x, bgu, bd, ids, w)
    with pytest.raises(ValueError, match="fp8_scales and mxfp4_scales together"):
        kernel(x, bgu, bd, ids, w, (sgu, sd), fp8_scales=(sgu, sd), fp8_block=(32, 32))
    with pytest.raises(ValueError, match="block_k a multiple of 32"):
        kernel(x, bgu, bd, ids, w, (sgu, sd), block_k=16)


@needs_interpreter
def test_dispatch_sends_mxfp4_experts_to_triton_and_the_cpu_to_the_reference(monkeypatch):
    """``KVBATCH_KERNELS=triton`` (the CUDA route) runs the kernel with the scales passed on; the CPU's
    default route is the twin, bit for bit ``reference.fused_moe`` on the weights the CPU loader holds
    (dequantized in fp32, cast to the model dtype)."""
    gen = torch.Generator().manual_seed(33)
    x, bgu, bd, ids, w, scales = inputs(gen, 5, 64, 32, 3, 2, torch.bfloat16)
    extra = gpt_oss_extra(gen, 3, 64, 32, torch.bfloat16)
    real, seen = KERNELS.fused_moe, []

    def spy(*args, **kwargs):
        seen.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(KERNELS, "fused_moe", spy)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("KVBATCH_KERNELS", "triton")
    got = dispatch.fused_moe(x, bgu, bd, ids, w, *extra, mxfp4_scales=scales)
    assert len(seen) == 1 and seen[0]["mxfp4_scales"] is scales
    close(got, expected(x, bgu, bd, ids, w, scales, *extra))
    monkeypatch.setenv("KVBATCH_KERNELS", "auto")
    loader = [dequantize_mxfp4(b, s).to(torch.bfloat16) for b, s in zip((bgu, bd), scales)]
    cpu = dispatch.fused_moe(x, bgu, bd, ids, w, *extra, mxfp4_scales=scales)
    assert torch.equal(cpu, R.fused_moe(x, *loader, ids, w, *extra)) and len(seen) == 1


# ---------------------------------------------------------------------------------------------
# the loader and the model

EXPERTS = [f"model.layers.{i}.mlp.experts.{p}" for i in range(3) for p in ("gate_up_proj", "down_proj")]


@pytest.fixture(scope="module")
def mxfp4_folder(tmp_path_factory):
    """tests/test_gpt_oss.py's tiny gpt-oss (3 layers, 4 experts of I 64, H 64) with MXFP4 experts,
    and what it published: name -> (blocks, scales)."""
    folder = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    _, published = build_mxfp4_gpt_oss(folder)
    return folder, published


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_checkpoint_keeps_the_experts_mxfp4_in_the_engines_layout(mxfp4_folder, dtype):
    """keep_fp8: each layer's experts as uint8 blocks and scales whose dequantization is the CPU's tensor
    bit for bit (in the load dtype); the published groups run along each matrix's input dim (K), so
    the kept down_proj is the published one and the kept gate_up_proj its rows de-interleaved (gate,
    then up). Without keep_fp8 the CPU checkpoint is unchanged: same tensors, same fingerprint, nothing
    kept."""
    folder, published = mxfp4_folder
    ckpt, plain = load_checkpoint(str(folder), dtype, keep_fp8=True), load_checkpoint(str(folder), dtype)
    assert plain.fingerprint == ckpt.fingerprint and plain.tensors.keys() == ckpt.tensors.keys()
    assert all(torch.equal(plain.tensors[n], ckpt.tensors[n]) for n in plain.tensors)
    assert plain.mxfp4_experts == {} and plain.fp8_weights == {} == ckpt.fp8_weights
    assert sorted(ckpt.mxfp4_experts) == sorted(EXPERTS)
    for name in EXPERTS:
        kept, (blocks, scales) = ckpt.mxfp4_experts[name], published[name]
        E, N, K = ckpt.tensors[name].shape
        assert blocks.shape == (E, N, K // 32, 16)  # published [E, out, in / 32, 16]: groups along in = K
        assert kept.blocks.dtype == kept.scales.dtype == torch.uint8 and kept.shape == (E, N, K)
        assert torch.equal(kept.dequantize(dtype), ckpt.tensors[name])
        if name.endswith("down_proj"):
            assert torch.equal(kept.blocks, blocks) and torch.equal(kept.scales, scales)
        else:
            assert torch.equal(_interleave_rows(kept.blocks), blocks)
            assert torch.equal(_interleave_rows(kept.scales), scales)


def test_a_layer_keeps_mxfp4_experts_only_when_asked(mxfp4_folder):
    """load_moe_layer: the dequantized experts by default (the CPU, unchanged); with the checkpoint's MXFP4
    experts (passed, or installed by use_mxfp4_experts as build_model does on CUDA) uint8 blocks with
    their scales, computing what the dequantized layer computes (the CPU's route: the twin, bit for
    bit); select_experts keeps the scales with their experts; expert parallelism refuses such a layer."""
    from kvbatch.engine.models.config import ModelConfig
    from kvbatch.engine.models.moe import load_moe_layer, run_experts, use_mxfp4_experts
    from kvbatch.engine.parallel.expert_parallel import ExpertParallelCompute

    ckpt = load_checkpoint(str(mxfp4_folder[0]), keep_fp8=True)
    cfg = ModelConfig.from_hf(ckpt.config).moe
    plain = load_moe_layer(ckpt.tensors, "model.layers.1.mlp.", cfg, torch.float32)
    assert plain.w_gate_up.dtype == torch.float32 and plain.mxfp4_scales is None
    with use_mxfp4_experts(ckpt.mxfp4_experts):
        mx = load_moe_layer(ckpt.tensors, "model.layers.1.mlp.", cfg, torch.float32)
    assert mx.w_gate_up.dtype == mx.w_down.dtype == torch.uint8 and mx.fp8_scales is None
    assert mx.w_gate_up.shape == (4, 128, 2, 16) and mx.mxfp4_scales[1].shape == (4, 64, 2)
    assert load_moe_layer(ckpt.tensors, "model.layers.1.mlp.", cfg, torch.float32,
                          mxfp4_experts=ckpt.mxfp4_experts).mxfp4_scales is not None
    gen = torch.Generator().manual_seed(34)
    x, ids, w = torch.randn(6, 64, generator=gen), torch.randint(0, 4, (6, 2), generator=gen), torch.rand(6, 2)
    assert torch.equal(run_experts(x, mx, ids, w), run_experts(x, plain, ids, w))
    rows = torch.tensor([3, 0])
    picked, want = mx.select_experts(rows), plain.select_experts(rows)
    assert torch.equal(picked.mxfp4_scales[0], mx.mxfp4_scales[0][rows])
    ids = torch.randint(0, 2, (6, 2), generator=gen)
    assert torch.equal(run_experts(x, picked, ids, w), run_experts(x, want, ids, w))
    with pytest.raises(ValueError, match="expert parallelism over MXFP4 experts"):
        ExpertParallelCompute({1: mx}, 3)


def test_an_mxfp4_gpt_oss_on_the_device_keeps_its_experts_mxfp4(mxfp4_folder, monkeypatch):
    """On the emulated GPU the tiny gpt-oss's experts stay uint8 blocks with uint8 scales on the device,
    while a CPU model of the same folder holds them dequantized. Through the reference twin (the
    emulated GPU runs no Triton) the tokens equal the CPU's and the logprobs equal, bit for bit, those of
    the same device model built with dequantized experts (the CPU's differ from those in the last bits
    either way: the device runs the reference kernels, the CPU its own). With the experts computed by the Triton kernel
    (the interpreter, on the device tensors' values) the tokens still equal the CPU's and the logprobs
    agree to 1e-4."""
    import tests.test_device_placement as P
    from kvbatch.engine.runtime.engine_config import EngineConfig
    from kvbatch.engine.runtime.llm import LLM, GenerationRequest
    from kvbatch.engine.runtime.sampling_params import SamplingParams
    from tests.test_gpt_oss import _prompts

    folder = str(mxfp4_folder[0])
    monkeypatch.setenv("KVBATCH_KERNELS", "reference")
    greedy = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=2)
    reqs = [GenerationRequest(rid, greedy, prompt_token_ids=p) for rid, p in list(_prompts().items())[:4]]
    config = {"block_size": 4, "num_blocks": 64}
    cpu_llm = LLM(folder, engine_config=EngineConfig(**config))
    assert all(lw.mxfp4_scales is None and lw.w_gate_up.dtype == torch.float32
               for lw in cpu_llm.model.moe_layers.values())
    cpu = cpu_llm.generate(reqs)

    tokens, logprobs = P.tokens_of, P.logprobs_of

    calls = []

    def through_the_kernel(x, wgu, wd, ids, weights, gub, db, swiglu, scales):
        calls.append(swiglu)
        host = [P.host(t) for t in (x, wgu, wd, ids, weights, gub, db)]
        out = KERNELS.fused_moe(*host, swiglu, mxfp4_scales=tuple(P.host(s) for s in scales))
        return P.cuda(out)

    P.emulate_cuda(monkeypatch)
    # built in inference mode: the emulator's wrapper tensors cannot take views of gpt-oss's sinks made
    # outside it inside the steps' inference mode (a limit of tests/test_device_placement.py, not of the engine)
    with P.CudaPlacement(), torch.inference_mode():
        on_device = EngineConfig(**config, device="cuda:0")
        dequantized = LLM(load_checkpoint(folder), engine_config=on_device, dtype="fp32").generate(reqs)
        llm = LLM(folder, engine_config=on_device, dtype="fp32")  # loads with keep_fp8 there
        assert sorted(llm.model.moe_layers) == [0, 1, 2]
        for layer in llm.model.moe_layers.values():
            assert isinstance(layer.w_gate_up, P.OnCuda) and layer.w_gate_up.dtype == torch.uint8
            assert layer.w_down.dtype == torch.uint8 and layer.w_down.shape == (4, 64, 2, 16)
            assert all(isinstance(s, P.OnCuda) and s.dtype == torch.uint8 for s in layer.mxfp4_scales)
        got = llm.generate(reqs)
        assert tokens(got) == tokens(cpu)
        assert logprobs(got) == logprobs(dequantized)
        if KERNELS is not None and KERNELS.interpreted:
            monkeypatch.setenv("TRITON_INTERPRET", "1")
            monkeypatch.setattr(dispatch, "fused_moe_mxfp4_reference", through_the_kernel)
            got = llm.generate(reqs)
    if KERNELS is not None and KERNELS.interpreted:
        assert calls and all(s is not None for s in calls)  # every MoE layer of every step, gpt-oss's SwiGLU
        assert tokens(got) == tokens(cpu)
        P.assert_logprobs_close(got, dequantized, atol=1e-4)


# ---------------------------------------------------------------------------------------------
# sm_90 (benchmarks/gpu_compile.py's enumeration), in a process without TRITON_INTERPRET

# gpt-oss-20b's MXFP4 expert variants in gpu_compile's enumeration: every bf16 tile of its top-4 launches
# (decode, mid, prefill) and fp32's first, each kernel (with HAS_BIAS, and SWIGLU for gate/up), compiled
# for sm_90 beside the same tile's plain variant.
COMPILE = r"""
import dataclasses, json, tempfile, gpu_compile as g
g._worker_init(tempfile.mkdtemp())
configs = g.configurations({"gpt-oss-20b": g.MODELS["gpt-oss-20b"]}, ("bf16", "fp32"))
moe = [c for c in configs if c.kernel in ("_moe_gate_up_kernel", "_moe_down_kernel")]
mx = [c for c in moe if c.constexprs["MXFP4_W"]]
assert mx and all(c.constexprs["HAS_BIAS"] and not c.constexprs["FP8_W"] for c in mx), mx
assert all(c.constexprs["SWIGLU"] for c in mx if c.kernel == "_moe_gate_up_kernel"), mx
others = [c for name in ("Qwen3-30B-A3B", "DeepSeek-V3") for c in g.configurations({name: g.MODELS[name]}, ("bf16",))
          if c.kernel in ("_moe_gate_up_kernel", "_moe_down_kernel")]
assert others and not any(c.constexprs["MXFP4_W"] for c in others), others
picked = {}
for c in mx:
    if c.constexprs["TOP_K"] == 4:
        picked.setdefault((c.kernel, c.dtype, json.dumps(c.as_dict() if c.dtype == "bf16" else None)), c)
for c in picked.values():
    off = dict(c.constexprs, MXFP4_W=False)
    print(json.dumps([g.compile_config(c, 90), g.compile_config(dataclasses.replace(c, constexprs=off), 90)]),
          flush=True)
"""


@pytest.mark.slow
def test_the_mxfp4_moe_variants_compile_for_sm90():
    """The enumeration holds gpt-oss-20b's MXFP4 expert variants (other models none); each compiles for
    sm_90 with uint8 weight and scale pointers, within an SM's shared memory, and spills no register
    where the same tile's plain variant spills none."""
    check_moe_variant_pairs(compiled_pairs(COMPILE), "MXFP4_W")


@pytest.mark.usefixtures("use_triton")
def test_the_benchmark_case_with_mxfp4_experts_runs_on_cpu(monkeypatch):
    """``gpu_cases.moe_case(mxfp4=True, gpt_oss=True)`` (the GPU check's MXFP4 expert case) builds and
    checks on the CPU."""
    if not (KERNELS is not None and KERNELS.interpreted):
        pytest.skip("the kernels were compiled for a GPU (test_moe_mxfp4_in_a_fresh_process covers this)")
    G = gpu_kernels_on_cpu(monkeypatch)
    ok, err = G.moe_case(G.import_kernels(), 6, 96, 64, 4, 2, torch.float32, gpt_oss=True, mxfp4=True)[2]()
    assert ok, err


@fresh_process_only
def test_moe_mxfp4_in_a_fresh_process():
    rerun_in_fresh_interpreter(__file__)
