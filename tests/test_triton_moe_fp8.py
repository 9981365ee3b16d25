"""FP8 block-scaled experts in the Triton fused MoE kernel (``kernels/triton_moe.py``, ``FP8_W``): the
expert weights float8_e4m3fn with an fp32 ``scale_inv`` per ``[bn, bk]`` block of each expert's matrix,
dequantized tile by tile in registers with the FP8 GEMM's own ``_fp8_tile``.

The kernel runs in the Triton interpreter against its twin ``dispatch.fused_moe_fp8_reference`` (the
experts dequantized, rounded to the activation dtype, then ``reference.fused_moe``): fp32 within
1e-4 / 1e-4 (the plain MoE tests'), fp16 2e-2 and bf16 3e-2 against the twin on the same rounded
weights upcast to fp32, the absolute part scaled by the largest output (outputs O(1)). Scales shifted
by one block, transposed or of another expert miss by over 10% of the largest output.
Then the loader's keep_fp8 path (the hub's per-expert FP8 matrices stacked with their scales), the
layer and dispatch wiring, and a tiny FP8 Qwen3-MoE on the emulated GPU (tests/test_device_placement.py)
whose experts stay float8 there and whose tokens equal the CPU's dequantized model's. The sm_90
compilation of the FP8 variants runs in a subprocess without ``TRITON_INTERPRET``.
"""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

# First: it sets TRITON_INTERPRET before triton builds the kernels.
from tests.triton_interpreter import (DTYPES, KERNELS, assert_close, check_moe_variant_pairs,  # isort: skip
                                      compiled_pairs, fresh_process_only, gpu_kernels_on_cpu, interpreter_only,
                                      interpreter_settings, rerun_in_fresh_interpreter,
                                      use_triton)  # noqa: F401 (fixture)
from kvbatch.engine.models.weights import load_checkpoint
from kvbatch.kernels import dispatch
from kvbatch.kernels import reference as R
from tests.test_device_placement import on_cuda  # noqa: F401 (fixture)

needs_interpreter = interpreter_only("test_moe_fp8_in_a_fresh_process")

MOE_TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (2e-2, 2e-2), torch.bfloat16: (3e-2, 3e-2)}


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Within MOE_TOL, the absolute part scaled by the largest |expected| (as tests/test_fp8_gemm.py):
    the interpreter truncates the dequantized tile to 16 bits where the twin rounds it, a bias that
    grows with the outputs (up to k times an expert's, k choices of one expert)."""
    atol, rtol = MOE_TOL[expected.dtype]
    assert_close(actual, expected, (atol * max(1.0, expected.float().abs().max().item()), rtol))


def fp8_experts(gen: torch.Generator, E: int, N: int, K: int, block: tuple[int, int]) -> tuple[torch.Tensor,
                                                                                                 torch.Tensor]:
    """FP8 values over the e4m3 range and block scales making each dequantized row ~N(0, 1/K)."""
    w = (torch.randn(E, N, K, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    s = (torch.rand(E, -(-N // block[0]), -(-K // block[1]), generator=gen) + 0.5) / 100 * K**-0.5
    return w, s


def inputs(gen, T, H, I, E, k, dtype, block, id_low=0, id_high=None):
    x = torch.randn(T, H, generator=gen).to(dtype)
    wgu, sgu = fp8_experts(gen, E, 2 * I, H, block)
    wd, sd = fp8_experts(gen, E, H, I, block)
    ids = torch.randint(id_low, E if id_high is None else id_high, (T, k), generator=gen)
    return x, wgu, wd, ids, torch.rand(T, k, generator=gen), (sgu, sd)


def expected(x, wgu, wd, ids, weights, scales, block, *extra):
    """The twin; 16-bit: the same rounded weights upcast with x (the interpreter computes in fp32)."""
    if x.dtype == torch.float32:
        return dispatch.fused_moe_fp8_reference(x, wgu, wd, ids, weights, *(extra or (None,) * 3), scales, block)
    gu = dispatch.dequantize_fp8_experts(wgu, scales[0], block).to(x.dtype).float()
    dn = dispatch.dequantize_fp8_experts(wd, scales[1], block).to(x.dtype).float()
    return R.fused_moe(x.float(), gu, dn, ids, weights, *extra).to(x.dtype)


def kernel(x, wgu, wd, ids, weights, scales, block, *extra, **tiles):
    """The interpreted kernel's FP8 variant (TRITON_INTERPRET set around it: hypothesis tests take no fixture)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        return KERNELS.fused_moe(x, wgu, wd, ids, weights, *extra, fp8_scales=scales, fp8_block=block, **tiles)


# (bn, bk): 128 x 128 as published (one block per expert matrix here), blocks dividing every dim, and
# blocks that divide none (partial blocks at the edges; bk 40 or 24 is no multiple of a K tile: the
# per-element scale gather, SCALE_PER_COLUMN off)
BLOCKS = [(128, 128), (8, 8), (16, 16), (16, 40), (32, 24), (24, 32)]


@needs_interpreter
@interpreter_settings(30)
@given(
    T=st.integers(1, 40),
    H=st.sampled_from([16, 40, 64]),
    I=st.sampled_from([8, 20, 32]),
    E=st.integers(1, 5),
    k=st.integers(1, 3),
    dtype=st.sampled_from(DTYPES),
    block=st.sampled_from(BLOCKS),
    block_k=st.sampled_from([8, 16, 32]),
    out_of_range=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_fp8_experts_match_the_dequantized_reference(T, H, I, E, k, dtype, block, block_k, out_of_range, seed):
    gen = torch.Generator().manual_seed(seed)
    lo, hi = (-2, E + 2) if out_of_range else (0, E)
    x, wgu, wd, ids, w, scales = inputs(gen, T, H, I, E, k, dtype, block, lo, hi)
    want = expected(x, wgu, wd, ids, w, scales, block)
    close(kernel(x, wgu, wd, ids, w, scales, block, block_k=block_k, block_m=16), want)


@needs_interpreter
@pytest.mark.usefixtures("use_triton")
@pytest.mark.parametrize("block", [(32, 40), (16, 64)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_several_blocks_per_expert_through_the_dispatch_point(dtype, block):
    """40 tokens x 2 choices over 3 experts (several row blocks each), H 96 and I 48, through
    ``dispatch.fused_moe`` (the interpreter's 32-deep K tiles); outputs O(1). 32 x 40 blocks: K tiles
    straddle scale columns (a scale per element); 16 x 64: a scale per tile column, partial blocks
    along I."""
    gen = torch.Generator().manual_seed(21)
    x, wgu, wd, ids, w, scales = inputs(gen, 40, 96, 48, 3, 2, dtype, block)
    want = expected(x, wgu, wd, ids, w, scales, block)
    assert 0.3 < want.float().abs().max() < 30
    got = dispatch.fused_moe(x, wgu, wd, ids, w, fp8_scales=scales, fp8_block=block)
    close(got, want)


@needs_interpreter
@pytest.mark.usefixtures("use_triton")
def test_fp8_experts_with_gpt_oss_biases_and_clamp():
    """FP8_W composes with HAS_BIAS and SWIGLU (one launch with all three)."""
    gen = torch.Generator().manual_seed(22)
    x, wgu, wd, ids, w, scales = inputs(gen, 9, 48, 20, 4, 2, torch.float32, (16, 40))
    extra = (torch.randn(4, 40, generator=gen) * 2, torch.randn(4, 48, generator=gen), (1.702, 1.0))
    want = expected(x, wgu, wd, ids, w, scales, (16, 40), *extra)
    assert_close(kernel(x, wgu, wd, ids, w, scales, (16, 40), *extra), want, MOE_TOL[torch.float32])


@needs_interpreter
@pytest.mark.parametrize("wrong", ["gate/up scales shifted one block", "down scales shifted one block",
                                   "scales transposed", "scales of another expert"])
def test_a_wrong_scale_fails_the_comparison(wrong):
    """The check above can fail: the kernel given scales off by one block, transposed (gate/up's square
    grid of 4 x 4 blocks, so the shapes still fit) or of another expert is far outside the tolerance."""
    gen = torch.Generator().manual_seed(23)
    x, wgu, wd, ids, w, (sgu, sd) = inputs(gen, 12, 32, 16, 3, 2, torch.float32, (8, 8))
    want = expected(x, wgu, wd, ids, w, (sgu, sd), (8, 8))
    assert_close(kernel(x, wgu, wd, ids, w, (sgu, sd), (8, 8)), want, MOE_TOL[torch.float32])
    bad = {"gate/up scales shifted one block": (sgu.roll(1, 1), sd),
           "down scales shifted one block": (sgu, sd.roll(1, 2)),
           "scales transposed": (sgu.transpose(1, 2), sd),
           "scales of another expert": (sgu.roll(1, 0), sd)}[wrong]
    got = kernel(x, wgu, wd, ids, w, bad, (8, 8))
    with pytest.raises(AssertionError):
        assert_close(got, want, MOE_TOL[torch.float32])
    assert (got - want).abs().max() > 0.1 * want.abs().max()  # beyond the 16-bit tolerances too


@needs_interpreter
def test_fp8_arguments_are_checked():
    gen = torch.Generator().manual_seed(24)
    x, wgu, wd, ids, w, (sgu, sd) = inputs(gen, 3, 32, 16, 2, 1, torch.float32, (16, 16))
    with pytest.raises(ValueError, match=r"gate_up scales \(2, 1, 2\) torch.float32 .*expected fp32 \(2, 2, 2\)"):
        kernel(x, wgu, wd, ids, w, (sgu[:, :1], sd), (16, 16))
    with pytest.raises(ValueError, match=r"down scales \(2, 2, 1\) torch.float64 .*expected fp32 \(2, 2, 1\)"):
        kernel(x, wgu, wd, ids, w, (sgu, sd.double()), (16, 16))
    with pytest.raises(ValueError, match="need fp8_scales"):
        KERNELS.fused_moe(x, wgu, wd, ids, w)
    with pytest.raises(ValueError, match="need float8_e4m3fn weights"):
        kernel(x, wgu.float(), wd, ids, w, (sgu, sd), (16, 16))


@needs_interpreter
def test_dispatch_sends_fp8_experts_to_triton_and_the_cpu_to_the_reference(monkeypatch):
    """``KVBATCH_KERNELS=triton`` (the CUDA route) runs the kernel with the scales passed on; the CPU's
    default route is the twin, bit for bit ``reference.fused_moe`` on the weights the CPU loader holds
    (dequantized in fp32, cast to the model dtype)."""
    gen = torch.Generator().manual_seed(25)
    x, wgu, wd, ids, w, scales = inputs(gen, 5, 32, 16, 3, 2, torch.bfloat16, (16, 16))
    real, seen = KERNELS.fused_moe, []

    def spy(*args, **kwargs):
        seen.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(KERNELS, "fused_moe", spy)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("KVBATCH_KERNELS", "triton")
    got = dispatch.fused_moe(x, wgu, wd, ids, w, fp8_scales=scales, fp8_block=(16, 16))
    assert len(seen) == 1 and seen[0]["fp8_scales"] is scales and seen[0]["fp8_block"] == (16, 16)
    close(got, expected(x, wgu, wd, ids, w, scales, (16, 16)))
    monkeypatch.setenv("KVBATCH_KERNELS", "auto")
    loader = [dispatch.dequantize_fp8_experts(t, s, (16, 16)).to(torch.bfloat16) for t, s in zip((wgu, wd), scales)]
    cpu = dispatch.fused_moe(x, wgu, wd, ids, w, fp8_scales=scales, fp8_block=(16, 16))
    assert torch.equal(cpu, R.fused_moe(x, *loader, ids, w)) and len(seen) == 1


# ---------------------------------------------------------------------------------------------
# the loader and the model


def build_fp8_moe(folder, block=None, arch="qwen3_moe"):
    """A tiny Qwen3-MoE (8 experts of I 32, H 64; layer 1 dense) or DeepSeek-V3 (the same experts; layer
    0 dense) with every projection stored FP8 in the hub's per-expert layout, ``block`` (default
    32 x 40: partial blocks along H)."""
    from safetensors.torch import load_file, save_file

    from tests.test_model_families import FP8_BLOCK, _quantize_state
    from tests.tiny_deepseek import build_tiny_deepseek
    from tests.tiny_models import build_tiny_moe

    block = block or FP8_BLOCK
    if arch == "deepseek_v3":
        build_tiny_deepseek(folder)
    else:
        build_tiny_moe(arch, folder)
    stored, _ = _quantize_state(load_file(folder / "model.safetensors"), block)
    save_file(stored, folder / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": block}
    (folder / "config.json").write_text(json.dumps(cfg))


EXPERTS = [f"model.layers.{i}.mlp.experts.{p}" for i in (0, 2) for p in ("gate_up_proj", "down_proj")]


def test_the_checkpoint_keeps_the_experts_fp8_stacked(tmp_path):
    """keep_fp8: each MoE layer's experts as one FP8 stack (gate rows then up rows, per expert) whose
    dequantization is the CPU's tensor bit for bit; without keep_fp8 the CPU checkpoint is unchanged
    (same tensors, same fingerprint). A cut of the experts (an expert-parallel share) cuts both alike."""
    from kvbatch.engine.models.expert_loading import keep_experts

    build_fp8_moe(tmp_path)
    ckpt, plain = load_checkpoint(str(tmp_path), keep_fp8=True), load_checkpoint(str(tmp_path))
    assert plain.fingerprint == ckpt.fingerprint and plain.tensors.keys() == ckpt.tensors.keys()
    assert all(torch.equal(plain.tensors[n], ckpt.tensors[n]) for n in plain.tensors)
    assert not any(".experts." in n for n in plain.fp8_weights)
    for name in EXPERTS:
        w = ckpt.fp8_weights[name]
        assert w.weight.dtype == torch.float8_e4m3fn and w.block == (32, 40)
        assert w.weight.shape == ckpt.tensors[name].shape and w.scale_inv.shape[0] == 8
        assert torch.equal(w.dequantize(), ckpt.tensors[name])
    assert not any(".experts." in n and not n.endswith("_proj") for n in ckpt.fp8_weights)  # no per-expert leftovers
    share = keep_experts(ckpt, {0: [1, 6], 2: [3]})
    for name in EXPERTS:
        assert share.fp8_weights[name].weight.shape[0] == (2 if ".0." in name else 1)
        assert torch.equal(share.fp8_weights[name].dequantize(), share.tensors[name])


def test_experts_whose_gate_up_join_cuts_a_block_stay_dequantized(tmp_path):
    """Blocks of 24 rows: gate (32 rows) and up cannot join on a block boundary, so no layer keeps FP8
    experts (the dequantized ones serve everywhere)."""
    build_fp8_moe(tmp_path, block=[24, 32])
    ckpt = load_checkpoint(str(tmp_path), keep_fp8=True)
    assert not any(".experts." in n for n in ckpt.fp8_weights) and EXPERTS[0] in ckpt.tensors


def test_a_layer_keeps_fp8_experts_only_when_asked(tmp_path):
    """load_moe_layer: the dequantized experts by default (the CPU, unchanged); with the checkpoint's
    FP8 weights (passed, or installed by use_fp8_experts as build_model does on CUDA) float8 experts
    with their scales, computing what the dequantized layer computes; select_experts keeps the scales
    with their experts; expert parallelism refuses such a layer."""
    from kvbatch.engine.models.config import ModelConfig
    from kvbatch.engine.models.moe import load_moe_layer, run_experts, use_fp8_experts
    from kvbatch.engine.parallel.expert_parallel import ExpertParallelCompute

    build_fp8_moe(tmp_path)
    ckpt = load_checkpoint(str(tmp_path), keep_fp8=True)
    cfg = ModelConfig.from_hf(ckpt.config).moe
    plain = load_moe_layer(ckpt.tensors, "model.layers.0.mlp.", cfg, torch.float32)
    assert plain.w_gate_up.dtype == torch.float32 and plain.fp8_scales is None
    with use_fp8_experts(ckpt.fp8_weights):
        fp8 = load_moe_layer(ckpt.tensors, "model.layers.0.mlp.", cfg, torch.float32)
    assert fp8.w_gate_up.dtype == fp8.w_down.dtype == torch.float8_e4m3fn and fp8.fp8_block == (32, 40)
    assert load_moe_layer(ckpt.tensors, "model.layers.0.mlp.", cfg, torch.float32,
                          fp8_weights=ckpt.fp8_weights).fp8_scales is not None
    gen = torch.Generator().manual_seed(26)
    x, ids, w = torch.randn(6, 64, generator=gen), torch.randint(0, 8, (6, 2), generator=gen), torch.rand(6, 2)
    assert torch.equal(run_experts(x, fp8, ids, w), run_experts(x, plain, ids, w))  # the CPU's route: the twin
    rows = torch.tensor([5, 2])
    picked, want = fp8.select_experts(rows), plain.select_experts(rows)
    assert torch.equal(picked.fp8_scales[0], fp8.fp8_scales[0][rows])
    ids = torch.randint(0, 2, (6, 2), generator=gen)
    assert torch.equal(run_experts(x, picked, ids, w), run_experts(x, want, ids, w))
    with pytest.raises(ValueError, match="expert parallelism over FP8 experts"):
        ExpertParallelCompute({0: fp8}, 3)


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_an_fp8_moe_model_on_the_device_keeps_its_experts_fp8(tmp_path, monkeypatch, arch):
    """On the emulated GPU a tiny FP8 Qwen3-MoE's (and DeepSeek-V3's) experts stay float8 on the device
    with their fp32 scales, while a CPU model of the same folder holds them dequantized (DeepSeek's MLA
    projections stay FP8 too, their rope rows reordered within blocks, where no block is cut). Through the
    reference twin (the emulated GPU runs no Triton) the tokens equal the CPU's and the logprobs equal,
    bit for bit, those of the same device model built with dequantized experts (Qwen3-MoE: the CPU's
    too; DeepSeek's MLA differs from the CPU's in the last bit on that device either way). With the
    experts computed by the Triton kernel (the interpreter, on the device tensors' values) the tokens
    still equal the CPU's and the logprobs agree to 1e-4."""
    import tests.test_device_placement as P
    from kvbatch.engine.runtime.engine_config import EngineConfig
    from kvbatch.engine.runtime.llm import LLM, GenerationRequest
    from kvbatch.engine.runtime.sampling_params import SamplingParams
    from tests.test_model_families import _prompts

    monkeypatch.setenv("KVBATCH_KERNELS", "reference")
    build_fp8_moe(tmp_path, arch=arch)
    greedy = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=2)
    reqs = [GenerationRequest(rid, greedy, prompt_token_ids=p) for rid, p in _prompts().items()]
    config = {"block_size": 4, "num_blocks": 64}
    cpu_llm = LLM(str(tmp_path), engine_config=EngineConfig(**config))
    assert all(lw.fp8_scales is None and lw.w_gate_up.dtype == torch.float32
               for lw in cpu_llm.model.moe_layers.values())
    cpu = cpu_llm.generate(reqs)

    tokens, logprobs = P.tokens_of, P.logprobs_of

    calls = []

    def through_the_kernel(x, wgu, wd, ids, weights, gub, db, swiglu, scales, block):
        calls.append(block)
        out = KERNELS.fused_moe(*(P.host(t) for t in (x, wgu, wd, ids, weights)), gub, db, swiglu,
                                fp8_scales=tuple(P.host(s) for s in scales), fp8_block=block)
        return P.cuda(out)

    P.emulate_cuda(monkeypatch)
    with P.CudaPlacement():
        on_device = EngineConfig(**config, device="cuda:0")
        dequantized = LLM(load_checkpoint(str(tmp_path)), engine_config=on_device, dtype="fp32").generate(reqs)
        llm = LLM(str(tmp_path), engine_config=on_device, dtype="fp32")  # loads with keep_fp8 there
        assert sorted(llm.model.moe_layers) == ([0, 2] if arch == "qwen3_moe" else [1, 2])
        for layer in llm.model.moe_layers.values():
            assert isinstance(layer.w_gate_up, P.OnCuda) and layer.w_gate_up.dtype == torch.float8_e4m3fn
            assert layer.w_down.dtype == torch.float8_e4m3fn and layer.fp8_block == (32, 40)
            assert all(isinstance(s, P.OnCuda) and s.dtype == torch.float32 for s in layer.fp8_scales)
        if arch == "deepseek_v3":  # MLA's GEMMs stay FP8 too, but a_proj: q_a (24 rows) + kv_a would cut a 32-row block
            from kvbatch.engine.models.fp8 import Fp8BlockWeight

            first = llm.model.layers[0]
            assert all(isinstance(w, Fp8BlockWeight) for w in (first.q_b, first.o_proj, first.gate_up, first.down))
            assert not isinstance(first.a_proj, Fp8BlockWeight)
        got = llm.generate(reqs)
        assert tokens(got) == tokens(cpu) and logprobs(got) == logprobs(dequantized)
        if arch == "qwen3_moe":
            assert logprobs(got) == logprobs(cpu)
        if KERNELS is not None and KERNELS.interpreted:
            monkeypatch.setenv("TRITON_INTERPRET", "1")
            monkeypatch.setattr(dispatch, "fused_moe_fp8_reference", through_the_kernel)
            got = llm.generate(reqs)
    if KERNELS is not None and KERNELS.interpreted:
        assert calls and all(block == (32, 40) for block in calls)  # every MoE layer of every step
        assert tokens(got) == tokens(cpu)
        P.assert_logprobs_close(got, dequantized, atol=1e-4)



def test_deepseek_mla_projections_stay_fp8_with_their_rope_rows_reordered(tmp_path, monkeypatch):
    """In 8 x 8 blocks every MLA GEMM of a tiny FP8 DeepSeek-V3 stays FP8 on the emulated GPU: a_proj
    (q_a joined with kv_a, whose rope key rows are de-interleaved by a reorder inside their block),
    q_b (each head's rope rows likewise), o_proj and the dense MLP; the absorbed kv_b is dequantized.
    Tokens and logprobs equal, bit for bit, those of the same device model with every weight
    dequantized: a wrong reorder would move them."""
    import tests.test_device_placement as P
    from kvbatch.engine.models.fp8 import Fp8BlockWeight
    from kvbatch.engine.runtime.engine_config import EngineConfig
    from kvbatch.engine.runtime.llm import LLM, GenerationRequest
    from kvbatch.engine.runtime.sampling_params import SamplingParams
    from tests.test_model_families import _prompts

    monkeypatch.setenv("KVBATCH_KERNELS", "reference")
    build_fp8_moe(tmp_path, block=[8, 8], arch="deepseek_v3")
    greedy = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=2)
    reqs = [GenerationRequest(rid, greedy, prompt_token_ids=p) for rid, p in _prompts().items()]
    P.emulate_cuda(monkeypatch)
    with P.CudaPlacement():
        on_device = EngineConfig(block_size=4, num_blocks=64, device="cuda:0")
        want = LLM(load_checkpoint(str(tmp_path)), engine_config=on_device, dtype="fp32").generate(reqs)
        llm = LLM(str(tmp_path), engine_config=on_device, dtype="fp32")  # loads with keep_fp8 there
        for i, lw in enumerate(llm.model.layers):
            gemms = [lw.a_proj, lw.q_b, lw.o_proj] + ([] if lw.is_moe else [lw.gate_up, lw.down])
            assert all(isinstance(w, Fp8BlockWeight) and w.block == (8, 8) for w in gemms), i
            assert lw.w_uk.dtype == torch.float32
        got = llm.generate(reqs)
    assert [(r.output_token_ids, r.logprobs) for r in got] == [(r.output_token_ids, r.logprobs) for r in want]


# ---------------------------------------------------------------------------------------------
# sm_90 (benchmarks/gpu_compile.py's enumeration), in a process without TRITON_INTERPRET

# DeepSeek-V3's FP8 expert variants (128 x 128 blocks) in gpu_compile's enumeration: every bf16 tile of
# its top-8 launches (decode, mid, prefill) and fp32's first, each kernel, compiled for sm_90 beside the
# same tile's plain variant.
COMPILE = r"""
import dataclasses, json, tempfile, gpu_compile as g
g._worker_init(tempfile.mkdtemp())
configs = g.configurations({"DeepSeek-V3": g.MODELS["DeepSeek-V3"]}, ("bf16", "fp32"))
moe = [c for c in configs if c.kernel in ("_moe_gate_up_kernel", "_moe_down_kernel")]
fp8 = [c for c in moe if c.constexprs["FP8_W"]]
assert fp8 and all(c.constexprs["GROUP_N"] == c.constexprs["GROUP_K"] == 128 for c in fp8), fp8
assert all(c.constexprs["SCALE_PER_COLUMN"] for c in fp8), fp8
plain = [c for c in g.configurations({"Qwen3-30B-A3B": g.MODELS["Qwen3-30B-A3B"]}, ("bf16",))
         if c.kernel in ("_moe_gate_up_kernel", "_moe_down_kernel")]
assert plain and not any(c.constexprs["FP8_W"] for c in plain), plain
picked = {}
for c in fp8:
    if c.constexprs["TOP_K"] == 8:
        picked.setdefault((c.kernel, c.dtype, json.dumps(c.as_dict() if c.dtype == "bf16" else None)), c)
for c in picked.values():
    off = dict(c.constexprs, FP8_W=False, GROUP_N=1, GROUP_K=1, SCALE_PER_COLUMN=False)
    print(json.dumps([g.compile_config(c, 90), g.compile_config(dataclasses.replace(c, constexprs=off), 90)]),
          flush=True)
"""


@pytest.mark.slow
def test_the_fp8_moe_variants_compile_for_sm90():
    """The enumeration holds DeepSeek-V3's FP8 expert variants (plain models only plain ones); each
    compiles for sm_90 with fp8 weight pointers, within an SM's shared memory, and spills no register
    where the same tile's plain variant spills none."""
    check_moe_variant_pairs(compiled_pairs(COMPILE), "FP8_W")


@pytest.mark.usefixtures("use_triton")
def test_the_benchmark_case_with_fp8_experts_runs_on_cpu(monkeypatch):
    """``gpu_cases.moe_case(fp8=True)`` (the GPU check's FP8 expert case) builds and checks on the CPU."""
    if not (KERNELS is not None and KERNELS.interpreted):
        pytest.skip("the kernels were compiled for a GPU (test_moe_fp8_in_a_fresh_process covers this)")
    G = gpu_kernels_on_cpu(monkeypatch)
    ok, err = G.moe_case(G.import_kernels(), 6, 80, 48, 4, 2, torch.float32, fp8=True, block=(32, 40))[2]()
    assert ok, err


@fresh_process_only
def test_moe_fp8_in_a_fresh_process():
    rerun_in_fresh_interpreter(__file__)

