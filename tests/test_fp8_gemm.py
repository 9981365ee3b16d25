"""The FP8 block-scaled GEMM (``kernels/triton_fp8_gemm.py``) against its twin
(``dispatch.fp8_block_linear_reference``: the weight dequantized by ``dequantize_fp8_block``, rounded
to the activation dtype, ``F.linear``), the FP8 weights a checkpoint keeps for CUDA
(``fp8.Fp8BlockWeight``, ``Checkpoint.fp8_weights``), their multiply on the emulated GPU, and the
kernel's sm_90 configurations in ``benchmarks/gpu_compile.py``.

Like tests/test_kernels.py: the kernel runs in the Triton interpreter (``TRITON_INTERPRET=1`` set
before triton is imported; if the kernels were compiled for a GPU first, the in-process tests skip
and one test reruns this file in a fresh interpreter). Tolerances (|triton - reference| <= atol +
rtol |reference|): fp32 1e-5 / 1e-5 (fp32 sums in another order); fp16 3e-3 and bf16 3e-2 relative
(the interpreter's 16-bit casts truncate instead of rounding)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

# First: it sets TRITON_INTERPRET before triton builds the kernels.
from tests.triton_interpreter import (KERNELS, REPO,  # isort: skip
                                      fresh_process_only, interpreter_only, rerun_in_fresh_interpreter,
                                      use_triton)  # noqa: F401 (fixture)
from kvbatch.engine.models.errors import ModelLoadError
from kvbatch.engine.models.fp8 import Fp8BlockWeight, fp8_block_weights
from kvbatch.engine.models.weights import load_checkpoint
from kvbatch.kernels import dispatch
from tests.test_device_placement import CUDA, OnCuda, cuda, host, on_cuda  # noqa: F401 (fixture)

needs_interpreter = interpreter_only("test_fp8_gemm_in_a_fresh_process")
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (3e-3, 3e-3), torch.bfloat16: (3e-2, 3e-2)}


def fp8_weight(gen: torch.Generator, n: int, k: int, block: tuple[int, int]) -> Fp8BlockWeight:
    """Random FP8 values (the whole e4m3 range) and block scales around 1e-2."""
    w = (torch.randn(n, k, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    s = torch.rand(-(-n // block[0]), -(-k // block[1]), generator=gen) * 2e-2 + 1e-3
    return Fp8BlockWeight(w, s, block)


def _close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = TOL[dtype]
    assert actual.dtype == expected.dtype == dtype and actual.shape == expected.shape
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol * expected.float().abs().max().item(),
                               rtol=rtol)


# ---------------------------------------------------------------------------------------------
# the kernel in the interpreter


# (M, N, K, block): M=1 decode and M=64 prefill; 70 x 100 in 32 x 40 blocks leaves partial blocks on
# both edges (and 40 is no multiple of a K tile: the per-element scale gather); 96 x 128 in 16 x 32
# blocks has one scale per column of a K tile.
SHAPES = [(1, 70, 100, (32, 40)), (64, 70, 100, (32, 40)), (1, 96, 128, (16, 32)), (64, 96, 128, (16, 32)),
          (5, 33, 17, (128, 128))]


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("M,N,K,block", SHAPES)
def test_kernel_matches_the_dequantized_matmul(use_triton, M, N, K, block, dtype):
    gen = torch.Generator().manual_seed(M * 1000 + N)
    w = fp8_weight(gen, N, K, block)
    x = torch.randn(M, K, generator=gen).to(dtype)
    bias = torch.randn(N, generator=gen).to(dtype)
    for b in (None, bias):
        got = KERNELS.fp8_block_linear(x, w.weight, w.scale_inv, block, b)
        _close(got, dispatch.fp8_block_linear_reference(x, w.weight, w.scale_inv, block, b), dtype)
    if dtype == torch.float32:  # the twin is the loader's dequantization times x, nothing else
        want = x @ dispatch.dequantize_fp8_block(w.weight, w.scale_inv, block).T
        torch.testing.assert_close(got, want + bias, atol=1e-5 * want.abs().max().item(), rtol=1e-5)


@needs_interpreter
@pytest.mark.parametrize("tile", [dict(block_m=16, block_n=64, block_k=128), dict(block_m=64, block_n=64, block_k=128),
                                  dict(block_m=128, block_n=128, block_k=32)])
def test_the_gpu_tiles_compute_the_same(use_triton, tile):
    """The tiles the launcher picks on a GPU, run in the interpreter: a 128-deep K tile inside one
    column of 128 x 128 blocks, and N not a multiple of the tile."""
    gen = torch.Generator().manual_seed(5)
    w = fp8_weight(gen, 200, 384, (128, 128))
    x = torch.randn(70, 384, generator=gen)
    got = KERNELS.fp8_block_linear(x, w.weight, w.scale_inv, (128, 128), None, **tile)
    _close(got, dispatch.fp8_block_linear_reference(x, w.weight, w.scale_inv, (128, 128)), torch.float32)


@needs_interpreter
def test_strided_activations_and_the_dispatch_point(use_triton):
    """A column slice of a wider activation (row stride > K), through ``dispatch.fp8_block_linear``
    routed to Triton; an empty batch gives an empty result."""
    gen = torch.Generator().manual_seed(9)
    w = fp8_weight(gen, 48, 64, (16, 32))
    wide = torch.randn(7, 100, generator=gen)
    x = wide[:, 10:74]
    assert dispatch.backend(x) == "triton"
    _close(dispatch.fp8_block_linear(x, w.weight, w.scale_inv, (16, 32)),
           dispatch.fp8_block_linear_reference(x.contiguous(), w.weight, w.scale_inv, (16, 32)), torch.float32)
    assert w.linear(torch.empty(0, 64)).shape == (0, 48)


@needs_interpreter
def test_bad_arguments_are_named(use_triton):
    gen = torch.Generator().manual_seed(1)
    w = fp8_weight(gen, 40, 64, (16, 32))
    x = torch.randn(3, 64)
    with pytest.raises(ValueError, match="expected x \\[M, K\\] and weight \\[N, K\\]"):
        KERNELS.fp8_block_linear(x[:, :60], w.weight, w.scale_inv, (16, 32))
    with pytest.raises(ValueError, match="not float8_e4m3fn"):
        KERNELS.fp8_block_linear(x, w.weight.float(), w.scale_inv, (16, 32))
    with pytest.raises(ValueError, match="expected fp32 \\(3, 2\\)"):
        KERNELS.fp8_block_linear(x, w.weight, w.scale_inv[:2], (16, 32))
    with pytest.raises(ValueError, match="bias \\(39,\\) for 40 outputs"):
        KERNELS.fp8_block_linear(x, w.weight, w.scale_inv, (16, 32), torch.zeros(39))


@needs_interpreter
def test_the_gpu_check_case_runs_on_cpu(use_triton, monkeypatch):
    """``benchmarks/gpu_cases.fp8_gemm_case`` (what the GPU check checks and times) builds and
    passes its check on tiny CPU shapes, both scale paths, with a bias."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import gpu_kernels as G
    finally:
        sys.path.pop(0)
    monkeypatch.setattr(G.gpu_cases, "DEVICE", "cpu")
    K = G.import_kernels()
    for kw in (dict(), dict(block=(32, 40), bias=True)):
        ok, err = G.fp8_gemm_case(K, 3, 70, 100, torch.float32, **kw)[2]()
        assert ok, err


@fresh_process_only
def test_fp8_gemm_in_a_fresh_process():
    rerun_in_fresh_interpreter(__file__)


# ---------------------------------------------------------------------------------------------
# the weights a checkpoint keeps, their row operations


def test_split_cat_and_reorder_keep_each_block_its_scale():
    gen = torch.Generator().manual_seed(2)
    w = fp8_weight(gen, 96, 50, (32, 16))
    whole = w.dequantize()
    q, k, v = w.split([32, 32, 32])
    assert all(torch.equal(p.dequantize(), whole[i * 32:(i + 1) * 32]) for i, p in enumerate((q, k, v)))
    assert torch.equal(Fp8BlockWeight.cat([q, k, v]).dequantize(), whole)
    tail = w.split([64, 32])[1]
    assert torch.equal(tail.dequantize(), whole[64:])
    order = torch.cat([torch.arange(31, -1, -1), torch.arange(32, 96)])  # reversed within the first block
    assert torch.equal(w.reorder_rows(order).dequantize(), whole[order])
    with pytest.raises(ValueError, match="cannot split 96 FP8 rows in 32-row blocks into \\[40, 56\\]"):
        w.split([40, 56])
    with pytest.raises(ValueError, match="every part but the last must fill whole 32-row blocks"):
        Fp8BlockWeight.cat([w.split([64, 32])[1], fp8_weight(gen, 20, 50, (32, 16)), q])
    with pytest.raises(ValueError, match="moves FP8 rows across 32-row blocks"):
        w.reorder_rows(torch.arange(95, -1, -1))
    with pytest.raises(ValueError, match="expected \\(3, 4\\)"):
        Fp8BlockWeight(w.weight, w.scale_inv[:, :3], w.block)


def test_a_weight_without_scales_is_refused_by_name():
    gen = torch.Generator().manual_seed(4)
    w = fp8_weight(gen, 8, 8, (4, 4))
    with pytest.raises(ModelLoadError, match="src: a.weight: .*a.weight_scale_inv"):
        fp8_block_weights({"a.weight": w.weight}, (4, 4), "src")


@pytest.mark.parametrize("arch", ["qwen3", "phi3"])
def test_the_checkpoint_keeps_its_fp8_weights_for_cuda(tmp_path, arch):
    """``Checkpoint.fp8_weights``: every projection as published, under the decoder's names (Phi-3's
    fused qkv and gate/up split at block boundaries); each dequantizes to exactly the tensor the CPU
    loads, and multiplies to exactly what the CPU's F.linear gives."""
    from tests.test_model_families import FP8_BLOCK, build_fp8

    build_fp8(arch, tmp_path)
    ckpt = load_checkpoint(str(tmp_path), keep_fp8=True)
    fp8 = ckpt.fp8_weights
    assert len(fp8) == 2 * 7 and all(n.endswith("proj.weight") for n in fp8)
    assert "model.layers.1.self_attn.k_proj.weight" in fp8 and not any("qkv" in n for n in fp8)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    for name, w in fp8.items():
        assert w.weight.dtype == torch.float8_e4m3fn and w.block == tuple(FP8_BLOCK)
        assert torch.equal(w.dequantize(), ckpt.tensors[name]), name
        if w.shape[1] == 64:
            assert torch.equal(w.linear(x), torch.nn.functional.linear(x, ckpt.tensors[name])), name
    plain = load_checkpoint(str(tmp_path))  # the CPU's load: nothing kept
    assert plain.fp8_weights == {} and plain.fingerprint == ckpt.fingerprint
    from tests.test_model_families import build_tiny_family

    build_tiny_family("qwen3", tmp_path / "plain")
    assert load_checkpoint(str(tmp_path / "plain"), keep_fp8=True).fp8_weights == {}


def test_phi3_cut_inside_a_block_keeps_only_the_dequantized_weights(tmp_path):
    """Blocks of 48 rows: the fused qkv (64 + 32 + 32 rows) cannot be cut on block boundaries, so
    no FP8 weights are kept and the dequantized tensors serve everywhere."""
    from tests.test_model_families import build_fp8

    build_fp8("phi3", tmp_path, block=[48, 32])
    ckpt = load_checkpoint(str(tmp_path), keep_fp8=True)
    assert ckpt.fp8_weights == {} and "model.layers.0.self_attn.q_proj.weight" in ckpt.tensors


# ---------------------------------------------------------------------------------------------
# on the emulated GPU (tests/test_device_placement.py's CudaPlacement)


def test_fp8_weights_multiply_on_the_device(on_cuda, monkeypatch):
    """Uploaded, an FP8 weight stays float8 on the device (a byte per value) with fp32 scales, and
    its multiply (the reference path: the emulated GPU runs no Triton) stays there and equals the CPU's."""
    monkeypatch.setenv("KVBATCH_KERNELS", "reference")
    gen = torch.Generator().manual_seed(6)
    w = fp8_weight(gen, 70, 100, (32, 40))
    x, bias = torch.randn(3, 100, generator=gen), torch.randn(70, generator=gen)
    want = w.linear(x, bias)
    on = w.to(CUDA)
    assert isinstance(on.weight, OnCuda) and on.weight.dtype == torch.float8_e4m3fn
    assert isinstance(on.scale_inv, OnCuda) and on.scale_inv.dtype == torch.float32
    assert torch.equal(host(on.linear(cuda(x), cuda(bias))), want)


# ---------------------------------------------------------------------------------------------
# sm_90 configurations (benchmarks/gpu_compile.py), in a process without TRITON_INTERPRET

RECORD = r"""
import json, torch, gpu_compile as g
from kvbatch.kernels import triton_fp8_gemm as F
assert not F.INTERPRETED
launches = []
class Recorder:
    def __getitem__(self, grid):
        def launch(*args, num_warps=None, num_stages=None, **constexprs):
            launches.append((constexprs, num_warps, num_stages, dtype))
        return launch
F._fp8_block_gemm_kernel = Recorder()
NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
# Qwen3-8B-FP8's q/k/v, gate/up and down projections; DeepSeek-V3's q_a and kv_a projections
for N, K in ((6144, 4096), (24576, 4096), (4096, 12288), (1536, 7168), (576, 7168)):
    w = torch.empty(N, K, dtype=torch.float8_e4m3fn)
    s = torch.empty(-(-N // 128), -(-K // 128))
    for dt in NAMES:
        dtype = NAMES[dt]
        for M in (1, 7, 16, 17, 64, 65, 4096, 16384):
            for b in (None, torch.empty(N, dtype=dt)):
                F.fp8_block_linear(torch.empty(M, K, dtype=dt), w, s, (128, 128), b)
warps, stages = g._triton_defaults()
enumerated = {c.key() for c in g.configurations()}
missing = [c for c, nw, ns, dtype in launches
           if g.Config("_fp8_block_gemm_kernel", c, dtype, nw or warps, ns or stages).key() not in enumerated]
picked = [c for c in g.subset(g.configurations()) if c.kernel == "_fp8_block_gemm_kernel"]
print(json.dumps({"launches": len(launches), "missing": missing, "subset": [p.as_dict() | {"models": p.models}
                                                                            for p in picked]}))
"""


def test_every_launch_is_enumerated_for_sm90_and_the_subset_holds_one():
    """The launcher's choices for the published FP8 shapes (decode to 16k-token prefill, three
    activation dtypes, with and without a bias) are all among gpu_compile's configurations, which
    name the FP8 models, and the CI subset holds one of them."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "KVBATCH_KERNELS")}
    prelude = f"import sys; sys.path[:0] = [{str(REPO / 'benchmarks')!r}]\n"
    proc = subprocess.run([sys.executable, "-c", prelude + RECORD], capture_output=True, text=True, timeout=300,
                          check=False, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["missing"] == [] and result["launches"] == 5 * 3 * 8 * 2
    (picked,) = result["subset"]
    assert picked["GROUP_K"] == 128 and set(picked["models"]) == {"Qwen3-8B-FP8", "DeepSeek-V3"}


@pytest.mark.slow
def test_the_fp8_configurations_compile_for_sm90_without_spills(tmp_path):
    """Every FP8 GEMM configuration compiled with Triton's bundled ptxas: within shared memory, no
    register spills (the tile rule was chosen so)."""
    code = (f"import sys, json, tempfile; sys.path[:0] = [{str(REPO / 'benchmarks')!r}]\n"
            "import gpu_compile as g\n"
            "g._worker_init(tempfile.mkdtemp())\n"
            "rows = [g.compile_config(c, 90) for c in g.configurations() if c.kernel == '_fp8_block_gemm_kernel']\n"
            "print(json.dumps([{k: r.get(k) for k in ('config', 'shared_bytes', 'spills', 'error')} for r in rows]))\n")
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "KVBATCH_KERNELS")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900, check=False,
                          env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(rows) == 16
    for r in rows:
        assert r["error"] is None and 0 < r["shared_bytes"] <= 232448 and r["spills"] == 0, r


@pytest.mark.parametrize("arch", ["qwen3", "phi3"])
def test_an_fp8_model_on_the_device_keeps_fp8_and_generates_what_the_cpu_does(tmp_path, arch, monkeypatch):
    """On the emulated GPU a tiny FP8 model's projections stay float8 (each joined projection whose
    parts fill whole blocks: qwen3's k/v of 48 rows in 32-row blocks cannot join, its qkv serves
    dequantized), multiplied through dispatch.fp8_block_linear (the reference: no Triton there), and
    its tokens and logprobs equal the CPU's bit for bit."""
    import tests.test_device_placement as P
    from kvbatch.engine.runtime.engine_config import EngineConfig
    from kvbatch.engine.runtime.llm import LLM, GenerationRequest
    from kvbatch.engine.runtime.sampling_params import SamplingParams
    from tests.test_model_families import _prompts, build_fp8

    monkeypatch.setenv("KVBATCH_KERNELS", "reference")
    build_fp8(arch, tmp_path)
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=3)
    reqs = [GenerationRequest(rid, greedy, prompt_token_ids=p) for rid, p in _prompts().items()]
    want = LLM(str(tmp_path), engine_config=EngineConfig(block_size=4, num_blocks=64)).generate(reqs)
    P.emulate_cuda(monkeypatch)
    with P.CudaPlacement():
        llm = LLM(str(tmp_path), engine_config=EngineConfig(block_size=4, num_blocks=64, device="cuda:0"), dtype="fp32")
        lw = llm.model.layers[0]
        kept = [w for w in (lw.qkv, lw.o_proj, lw.gate_up, lw.down) if isinstance(w, Fp8BlockWeight)]
        assert len(kept) == (3 if arch == "qwen3" else 4)
        assert all(isinstance(w.weight, P.OnCuda) and w.weight.dtype == torch.float8_e4m3fn for w in kept)
        got = llm.generate(reqs)
    assert P.tokens_of(got) == P.tokens_of(want)
    assert P.logprobs_of(got) == P.logprobs_of(want)
