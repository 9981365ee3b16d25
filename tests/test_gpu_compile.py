"""``benchmarks/gpu_compile.py``: every Triton kernel compiled for sm_90 on this CPU machine (Triton's
bundled ptxas, no GPU), within an SM's 227 KiB of shared memory, in every configuration the
launchers choose.

Compiling needs the kernels built by the JIT, not the interpreter, so everything that imports them
runs in a subprocess whose environment has no ``TRITON_INTERPRET`` (the kernel tests set it in
this process, see ``tests/triton_interpreter.py``)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "gpu_compile.py"
LIMIT = 232448  # 227 KiB


def _clean_env() -> dict[str, str]:
    env = dict(os.environ)
    for name in ("TRITON_INTERPRET", "KVBATCH_KERNELS"):
        env.pop(name, None)
    return env


def _python(code: str, timeout: int = 300) -> subprocess.CompletedProcess[str]:
    """``code`` in a fresh interpreter with benchmarks/ and tests/ importable, without TRITON_INTERPRET."""
    prelude = f"import sys; sys.path[:0] = [{str(REPO / 'benchmarks')!r}, {str(REPO / 'tests')!r}]\n"
    return subprocess.run([sys.executable, "-c", prelude + code], capture_output=True, text=True, timeout=timeout,
                          check=False, env=_clean_env(), cwd=REPO)


def _jit_functions() -> tuple[set[str], set[str]]:
    """(kernels launched with ``name[grid]``, helpers only called from kernels) of kernels/triton_*.py."""
    launched, helpers = set(), set()
    for path in (REPO / "kernels").glob("triton_*.py"):
        text = path.read_text()
        for name in re.findall(r"@triton\.jit\s*\ndef\s+(\w+)", text):
            (launched if re.search(rf"\b{name}\[", text) else helpers).add(name)
    return launched, helpers


@pytest.mark.slow
def test_subset_compiles_every_kernel_for_sm90_within_shared_memory(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--arch", "90", "--out", str(tmp_path), "--subset",
                           "--jobs", "2"], capture_output=True, text=True, timeout=900, check=False,
                          env=_clean_env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [json.loads(line) for line in (tmp_path / "compile.jsonl").read_text().splitlines()]
    launched, helpers = _jit_functions()
    assert len(launched) >= 13 and {r["kernel"] for r in rows} == launched
    kernel_sources = "".join(p.read_text() for p in (REPO / "kernels").glob("triton_*.py"))
    assert all(len(re.findall(rf"\b{h}\(", kernel_sources)) >= 2 for h in helpers)  # compiled inside a kernel
    for r in rows:
        assert "error" not in r, r
        assert 0 <= r["shared_bytes"] <= LIMIT and r["registers"] > 0 and r["spills"] >= 0, r
        assert r["config"]["num_warps"] > 0 and r["seconds"] > 0 and r["models"], r
    # MLA prefill (the 576-wide cache row as one key head) is the kernel the issue feared for.
    mla = [r for r in rows if r["kernel"] == "_prefill_kernel"]
    assert mla and mla[0]["config"]["HEAD_DIM"] == 576
    assert len(proc.stdout.strip().splitlines()) == len(launched) + 1  # a line per kernel, then the total


@pytest.mark.slow
def test_a_configuration_over_227_kib_is_reported_as_an_error():
    """A GEMM tile far too large for an SM (64 x 1024 and 1024 x 64 bf16 operands, 256 KiB) compiles,
    and its line says so."""
    proc = _python(
        "import json, gpu_compile as g\n"
        "g._worker_init(__import__('tempfile').mkdtemp())\n"
        "cfg = g.Config('_moe_down_kernel', dict(TOP_K=2, BLOCK_M=64, BLOCK_N=64, BLOCK_K=1024, COMPUTE_F32=False,"
        " DOT_PRECISION='tf32', HAS_BIAS=False, FP8_W=False, GROUP_N=1, GROUP_K=1, SCALE_PER_COLUMN=False,"
        " MXFP4_W=False),"
        " 'bf16', 4, 1, ['huge'])\n"
        "print(json.dumps(g.compile_config(cfg, 90)))\n", timeout=600)
    assert proc.returncode == 0, proc.stderr
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    assert row["shared_bytes"] > LIMIT
    assert row["error"].startswith("over 227 KiB"), row


# The launches the engine makes for the supported shapes, recorded by replacing each kernel with a
# stand-in that notes its constexprs and launch options: run in the subprocess below.
RECORD = r"""
import json, torch, gpu_compile as g
from kvbatch.kernels import (triton_activation, triton_attention, triton_fp8_gemm, triton_mla, triton_moe,
                             triton_rms_norm, triton_rotary, triton_store_kv, triton_verify)
assert not triton_attention.INTERPRETED
NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
launches = []

class Recorder:
    def __init__(self, name):
        self.name = name
    def __getitem__(self, grid):
        def launch(*args, num_warps=None, num_stages=None, **constexprs):
            launches.append((self.name, constexprs, num_warps, num_stages, dtype))
        return launch

for module in (triton_activation, triton_attention, triton_fp8_gemm, triton_mla, triton_moe, triton_rms_norm,
               triton_rotary, triton_store_kv, triton_verify):
    for name in dir(module):
        if name.endswith("_kernel") and name.startswith("_"):
            setattr(module, name, Recorder(name))

e = torch.empty
for dt in (torch.bfloat16, torch.float32):
    dtype = NAMES[dt]
    # (head dim, query heads, KV heads, the longest context of a model with them)
    for D, Hq, Hkv, longest in ((64, 9, 3, 8192), (96, 32, 32, 4096), (128, 32, 8, 131072), (128, 28, 4, 32768),
                                (256, 16, 8, 32768)):
        cache = e(4, 16, Hkv, D, dtype=dt)
        bt, lens = torch.zeros(2, 256, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
        for ctx in (16, 4096, longest):  # one partition, a few, as many as the model's longest context needs
            triton_attention.paged_decode_attention(e(2, Hq, D, dtype=dt), cache, cache, bt, lens, 0.1,
                                                    max_context_len=ctx)
        triton_attention.prefill_attention(e(5, Hq, D, dtype=dt), cache, cache, bt, torch.tensor([0, 2, 5],
                                           dtype=torch.int32), lens, 0.1, max_query_len=3)
        triton_rotary.apply_rotary(e(3, Hq, D, dtype=dt), e(3, Hkv, D, dtype=dt), torch.zeros(3, dtype=torch.long),
                                   e(8, D))
        triton_store_kv.store_kv(e(3, Hkv, D, dtype=dt), e(3, Hkv, D, dtype=dt), cache, cache,
                                 torch.zeros(3, dtype=torch.long))
    # gpt-oss (64 query heads, 8 KV heads, D 64): every attention launch carries its sinks
    cache, sinks = e(4, 16, 8, 64, dtype=dt), e(64)
    bt, lens = torch.zeros(2, 256, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    for ctx in (16, 4096, 131072):
        triton_attention.paged_decode_attention(e(2, 64, 64, dtype=dt), cache, cache, bt, lens, 0.1,
                                                max_context_len=ctx, window=128, sinks=sinks)
    triton_attention.prefill_attention(e(5, 64, 64, dtype=dt), cache, cache, bt, torch.tensor([0, 2, 5],
                                       dtype=torch.int32), lens, 0.1, max_query_len=3, window=128, sinks=sinks)
    row = e(1, 16, 1, 576, dtype=dt)  # DeepSeek-V3's latent cache row: 512 + 64
    bt, lens = torch.zeros(2, 64, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    for ctx in (16, 8192):
        triton_mla.mla_decode_attention(e(2, 128, 512, dtype=dt), e(2, 128, 64, dtype=dt), row, bt, lens, 0.1,
                                        max_context_len=ctx)
    triton_attention.prefill_attention(e(5, 128, 576, dtype=dt), row, row, bt, torch.tensor([0, 2, 5],
                                       dtype=torch.int32), lens, 0.1, max_query_len=3)  # MLA prefill's launch
    for H, I, E, k in ((4096, 14336, 8, 2), (2048, 768, 128, 8), (7168, 2048, 256, 8)):
        w_gate_up, w_down = e(1, 1, 1, dtype=dt).expand(E, 2 * I, H), e(1, 1, 1, dtype=dt).expand(E, H, I)
        for T in (1, 64, 4096):
            triton_moe.fused_moe(e(T, H, dtype=dt), w_gate_up, w_down, torch.zeros(T, k, dtype=torch.long),
                                 e(T, k))
    # gpt-oss-20b's experts: biases and the clamped SwiGLU (HAS_BIAS, SWIGLU)
    H, I, E, k = 2880, 2880, 32, 4
    w_gate_up, w_down = e(1, 1, 1, dtype=dt).expand(E, 2 * I, H), e(1, 1, 1, dtype=dt).expand(E, H, I)
    for T in (1, 64, 4096):
        triton_moe.fused_moe(e(T, H, dtype=dt), w_gate_up, w_down, torch.zeros(T, k, dtype=torch.long), e(T, k),
                             e(E, 2 * I, dtype=dt), e(E, H, dtype=dt), (1.702, 7.0))
    # the same experts as published, kept MXFP4 (MXFP4_W): uint8 blocks, E8M0 scales per 32 along K
    u8 = torch.uint8
    w_gate_up = e(1, 1, H // 32, 16, dtype=u8).expand(E, 2 * I, H // 32, 16)
    w_down = e(1, 1, I // 32, 16, dtype=u8).expand(E, H, I // 32, 16)
    scales = (e(E, 2 * I, H // 32, dtype=u8), e(E, H, I // 32, dtype=u8))
    for T in (1, 64, 4096):
        triton_moe.fused_moe(e(T, H, dtype=dt), w_gate_up, w_down, torch.zeros(T, k, dtype=torch.long), e(T, k),
                             e(E, 2 * I, dtype=dt), e(E, H, dtype=dt), (1.702, 7.0), mxfp4_scales=scales)
    # DeepSeek-V3's experts kept FP8 (FP8_W): float8 weights, 128 x 128 block scales
    H, I, E, k = 7168, 2048, 256, 8
    f8 = torch.float8_e4m3fn
    w_gate_up, w_down = e(1, 1, 1, dtype=f8).expand(E, 2 * I, H), e(1, 1, 1, dtype=f8).expand(E, H, I)
    scales = (e(E, 2 * I // 128, H // 128), e(E, H // 128, I // 128))
    for T in (1, 64, 4096):
        triton_moe.fused_moe(e(T, H, dtype=dt), w_gate_up, w_down, torch.zeros(T, k, dtype=torch.long), e(T, k),
                             fp8_scales=scales, fp8_block=(128, 128))
    for hidden in (576, 4096, 7168):  # the residual joins of SmolLM2, Llama-3.1-8B, DeepSeek-V3
        for residual in (None, e(2, hidden, dtype=dt)):
            triton_rms_norm.rms_norm(e(2, hidden, dtype=dt), e(hidden, dtype=dt), 1e-6, residual)
    for width in (128, 512, 1536):  # Qwen3's q/k heads, DeepSeek-V3's latent and query-latent norms
        triton_rms_norm.rms_norm(e(2, width, dtype=dt), e(width, dtype=dt), 1e-6)
    triton_activation.silu_and_mul(e(2, 2 * 14336, dtype=dt))
    for T in (1, 64, 4096):  # Qwen3-8B-FP8's and DeepSeek-V3's 128 x 128 blocks (tests/test_fp8_gemm.py: more)
        triton_fp8_gemm.fp8_block_linear(e(T, 4096, dtype=dt), e(6144, 4096, dtype=torch.float8_e4m3fn),
                                         e(48, 32), (128, 128))
dtype = "fp32"
for K in (1, 3, 8):
    triton_verify.spec_accept(e(2, K), e(2, K), e(2, K), torch.ones(2, dtype=torch.long))
    for q in (None, e(2, K, 32000)):
        triton_verify.spec_recover(e(2, K + 1, 32000), q, torch.zeros(2, K, dtype=torch.long),
                                   torch.zeros(2, dtype=torch.long), torch.ones(2, dtype=torch.long), e(2, 32000))

warps, stages = g._triton_defaults()
enumerated = {c.key() for c in g.configurations()}
missing = []
for name, constexprs, num_warps, num_stages, dtype in launches:
    cfg = g.Config(name, constexprs, dtype, num_warps or warps, num_stages or stages)
    if cfg.key() not in enumerated:
        missing.append(cfg.as_dict() | {"kernel": name})
print(json.dumps({"launches": len(launches), "kernels": sorted({l[0] for l in launches}), "missing": missing}))
"""


def test_the_enumerated_configurations_hold_every_launch_the_launchers_choose():
    """For each supported head dim (64, 96, 128, 256; GQA groups 3, 1, 4, 7, 2), gpt-oss's attention with
    sinks (64, group 8) and biased experts (also kept MXFP4), DeepSeek-V3's experts kept FP8, MLA (128 heads, 512 + 64), bf16 and
    fp32, one and many partitions,
    decode/prefill/MoE tiers/norms/verify: the constexprs and launch options each launcher picks are
    among gpu_compile's configurations."""
    proc = _python(RECORD)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["missing"] == [], result["missing"]
    assert result["launches"] > 100
    assert set(result["kernels"]) == _jit_functions()[0]


def test_bad_arguments_are_refused_with_their_name(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path), "--jobs", "0"], capture_output=True,
                          text=True, timeout=60, check=False, env=_clean_env())
    assert proc.returncode == 2 and "--jobs must be >= 1, got 0" in proc.stderr
    assert not (tmp_path / "compile.jsonl").exists()
