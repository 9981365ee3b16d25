"""Compile every Triton kernel for a GPU architecture on this machine, with no GPU: shared memory,
registers and spills of every configuration the engine can launch for the supported models.

    python benchmarks/gpu_compile.py --arch 90 --out DIR [--subset] [--jobs N]

Writes ``DIR/compile.jsonl``, one JSON line per configuration, appended as each compilation
finishes: ``kernel``, ``config`` (the constexprs, ``dtype``, ``num_warps``, ``num_stages``),
``models`` (the shapes that launch it), ``arch``, ``triton`` (its version), ``shared_bytes``,
``registers``, ``spills`` (bytes of spill stores plus loads), ``seconds``, and ``error`` when it
failed or needs more shared memory than an sm_90 SM has (``over 227 KiB``); a failing
configuration is recorded and the run goes on. Then a line per kernel; the exit status is 1
when any configuration has an error. ``--subset`` compiles one configuration per kernel, the one with the
largest estimated shared memory (what CI runs).

How: ``triton.compile(ASTSource(kernel, signature, constexprs), target=GPUTarget("cuda", arch, 32))``
with the ptxas Triton bundles; registers and spills come from the kernel's metadata when it has
them (only with a driver), else from ptxas's ``-v`` log. Every configuration is derived from the
launchers' own choice functions (``decode_tiles``, ``prefill_tiles``, ``moe_tiles``, ...) applied
to the shapes of ``MODELS`` (read by the engine's ``ModelConfig.from_hf``), the engine's dtypes
and KV block sizes: a launcher whose rule changes changes what is compiled here. Compilations run
in fresh worker processes without ``TRITON_INTERPRET``, each with an empty Triton cache, so the
seconds are first compilations. Needs only torch (CPU is enough) and triton >= 3.6.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from multiprocessing import get_context
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SHARED_LIMIT_BYTES = 232448  # 227 KiB: the most shared memory one block may use on sm_90 (H100, H200)
DTYPES = ("bf16", "fp16", "fp32")  # the engine's weight and KV-cache dtypes (EngineConfig's DTYPE_NAMES)
ELEM_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
TORCH_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
KV_BLOCK_SIZES = (16, 32)  # the engine's default block size and one more: BLOCK_SIZE is index arithmetic only
SPEC_MAX_DRAFTS = 16  # speculative drafts per request compiled for (SpecConfig.max_len defaults to 8)
MAX_STEP_TOKENS = 16384  # the largest step token budget the MoE tiles are derived over
BATCHES = tuple(2 ** i for i in range(11))  # decode batch sizes the partition choice is derived over (1..1024)

# The quantization_config of the published FP8 checkpoints (DeepSeek-V3, Qwen3-*-FP8).
FP8_128 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}

# The supported families at the shapes of their published checkpoints (config.json fields the
# engine reads). Their kernels' shapes come from the engine's own config reader.
MODELS: dict[str, dict[str, Any]] = {
    "SmolLM2-135M": dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192),
    "Llama-3.1-8B": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072),
    "Llama-3.1-70B": dict(model_type="llama", hidden_size=8192, intermediate_size=28672, num_attention_heads=64,
                          num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072),
    "Mistral-7B-v0.3": dict(model_type="mistral", hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                            num_key_value_heads=8, vocab_size=32768, max_position_embeddings=32768),
    "Qwen2.5-7B": dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_attention_heads=28,
                       num_key_value_heads=4, vocab_size=152064, max_position_embeddings=32768),
    "Qwen3-8B": dict(model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960),
    # Qwen3-8B-FP8 (and DeepSeek-V3 below, published in FP8): projections multiplied by the FP8 GEMM
    "Qwen3-8B-FP8": dict(model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                         quantization_config=FP8_128),
    "Phi-3-mini": dict(model_type="phi3", hidden_size=3072, intermediate_size=8192, num_attention_heads=32,
                       num_key_value_heads=32, vocab_size=32064, max_position_embeddings=4096),
    "Phi-4-mini": dict(model_type="phi3", hidden_size=3072, intermediate_size=8192, num_attention_heads=24,
                       num_key_value_heads=8, vocab_size=200064, max_position_embeddings=131072,
                       partial_rotary_factor=0.75),
    "Phi-4": dict(model_type="phi3", hidden_size=5120, intermediate_size=17920, num_attention_heads=40,
                  num_key_value_heads=10, vocab_size=100352, max_position_embeddings=16384),
    # No supported checkpoint has 256-wide heads yet; the common decoder accepts them (head_dim).
    "head-dim-256": dict(model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_attention_heads=16,
                         num_key_value_heads=8, head_dim=256, vocab_size=151936, max_position_embeddings=32768),
    "Mixtral-8x7B": dict(model_type="mixtral", hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=32000, max_position_embeddings=32768,
                         num_local_experts=8, num_experts_per_tok=2),
    "Qwen1.5-MoE-A2.7B": dict(model_type="qwen2_moe", hidden_size=2048, intermediate_size=5632,
                              num_attention_heads=16, num_key_value_heads=16, vocab_size=151936,
                              max_position_embeddings=8192, num_experts=60, num_experts_per_tok=4,
                              moe_intermediate_size=1408, shared_expert_intermediate_size=5632),
    "Qwen3-30B-A3B": dict(model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144, num_attention_heads=32,
                          num_key_value_heads=4, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                          num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768),
    "DeepSeek-V3": dict(model_type="deepseek_v3", hidden_size=7168, intermediate_size=18432, num_attention_heads=128,
                        num_key_value_heads=128, vocab_size=129280, max_position_embeddings=163840,
                        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                        v_head_dim=128, n_routed_experts=256, num_experts_per_tok=8, moe_intermediate_size=2048,
                        n_shared_experts=1, n_group=8, topk_group=4, first_k_dense_replace=3,
                        rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                                      "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
                        quantization_config=FP8_128),
    # gpt-oss-20b (-120b: the same attention, more experts and layers): attention sinks, so its decode
    # and prefill compile with HAS_SINKS; its biased, clamped experts with the MoE kernels' HAS_BIAS and SWIGLU,
    # published as MXFP4 (kept so on CUDA: MXFP4_W) and, dequantized (a bf16 re-publication), plain
    "gpt-oss-20b": dict(model_type="gpt_oss", hidden_size=2880, intermediate_size=2880, num_attention_heads=64,
                        num_key_value_heads=8, head_dim=64, vocab_size=201088, max_position_embeddings=131072,
                        sliding_window=128, attention_bias=True, num_local_experts=32, num_experts_per_tok=4,
                        swiglu_limit=7.0, rope_theta=150000.0, quantization_config={"quant_method": "mxfp4"},
                        rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                      "truncate": False, "original_max_position_embeddings": 4096}),
    "Moonlight-16B-A3B": dict(model_type="deepseek_v3", hidden_size=2048, intermediate_size=11264,
                              num_attention_heads=16, num_key_value_heads=16, vocab_size=163840,
                              max_position_embeddings=8192, q_lora_rank=None, kv_lora_rank=512,
                              qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=64,
                              num_experts_per_tok=6, moe_intermediate_size=1408, n_shared_experts=2, n_group=1,
                              topk_group=1, first_k_dense_replace=1),
}


# ---------------------------------------------------------------------------------------------
# the kernels: where each lives, which of its strides are 1 in every launch, pointer dtypes


@dataclass(frozen=True)
class KernelSpec:
    """How to build a launch signature for one ``@triton.jit`` kernel. ``unit_strides`` are the
    innermost strides, 1 in every launch: the JIT specializes an int argument equal to 1 as a
    constant, so they are compiled as such. ``pointers`` maps a pointer argument to its dtype;
    ``"*"`` stands for the configuration's dtype. ``floats`` are fp32 scalars (the other scalars
    are i32). ``footprint`` estimates shared bytes from a configuration (to pick ``--subset``): the
    operand tiles of its dots, once: what the sm_90 compilations measured here hold in shared
    memory (their masked, gathered loads are not multi-buffered whatever ``num_stages`` says)."""

    module: str
    unit_strides: tuple[str, ...]
    pointers: dict[str, str]
    floats: tuple[str, ...] = ()
    footprint: Callable[[dict[str, Any]], int] = field(default=lambda c: 0)


def _triton_defaults() -> tuple[int, int]:
    """(num_warps, num_stages) Triton uses where a launcher passes none."""
    from triton.backends.nvidia.compiler import CUDAOptions

    return CUDAOptions.num_warps, CUDAOptions.num_stages


def _eb(c: dict[str, Any]) -> int:
    return ELEM_BYTES.get(c.get("dtype", "fp32"), 4)


_ATTN_PTRS = {"q_ptr": "*", "k_cache_ptr": "*", "v_cache_ptr": "*", "block_tables_ptr": "i32",
              "context_lens_ptr": "i32", "sinks_ptr": "fp32", "out_ptr": "*"}
KERNELS: dict[str, KernelSpec] = {
    "_rms_norm_kernel": KernelSpec(
        "triton_rms_norm", (), {"x_ptr": "*", "res_ptr": "*", "w_ptr": "*", "out_ptr": "*", "new_res_ptr": "*"},
        ("eps",), lambda c: c["BLOCK"] * 4),
    "_silu_and_mul_kernel": KernelSpec(
        "triton_activation", (), {"x_ptr": "*", "out_ptr": "*"}, (), lambda c: c["BLOCK"] * 4),
    "_rotary_kernel": KernelSpec(
        "triton_rotary", ("stride_qd", "stride_kd"),
        {"q_ptr": "*", "k_ptr": "*", "positions_ptr": "i64", "cos_sin_ptr": "fp32"}, (),
        lambda c: c["BLOCK_HQ"] * c["BLOCK_HALF"] * 4),
    "_store_kv_kernel": KernelSpec(
        "triton_store_kv", ("stride_kd", "stride_vd", "stride_kcd", "stride_vcd"),
        {"k_ptr": "*", "v_ptr": "*", "k_cache_ptr": "*", "v_cache_ptr": "*", "slot_mapping_ptr": "i64"}, (),
        lambda c: c["BLOCK_H"] * c["BLOCK_D"] * 4),
    "_paged_decode_kernel": KernelSpec(
        "triton_attention", ("stride_qd", "stride_kd", "stride_vd", "stride_btn", "stride_od"),
        {**_ATTN_PTRS, "part_acc_ptr": "fp32", "part_max_ptr": "fp32", "part_sum_ptr": "fp32"}, ("scale_log2e",),
        lambda c: (c["GROUP_PAD"] + 2 * c["BLOCK_N"]) * c["BLOCK_D"] * _eb(c)),
    "_paged_decode_merge_kernel": KernelSpec(
        "triton_attention", ("stride_od",),
        {"part_acc_ptr": "fp32", "part_max_ptr": "fp32", "part_sum_ptr": "fp32", "context_lens_ptr": "i32",
         "sinks_ptr": "fp32", "out_ptr": "*"}, (), lambda c: c["BLOCK_P"] * c["BLOCK_D"] * 4),
    "_prefill_kernel": KernelSpec(
        "triton_attention", ("stride_qd", "stride_kd", "stride_vd", "stride_btn", "stride_od"),
        {**_ATTN_PTRS, "cu_query_lens_ptr": "i32"}, ("scale_log2e",),
        lambda c: (c["BLOCK_M"] + 2 * c["BLOCK_N"]) * c["BLOCK_D"] * _eb(c)),
    "_mla_decode_kernel": KernelSpec(
        "triton_mla", ("stride_qlc", "stride_qpr", "stride_kvc", "stride_btn", "stride_oc"),
        {"q_lat_ptr": "*", "q_pe_ptr": "*", "kv_ptr": "*", "block_tables_ptr": "i32", "context_lens_ptr": "i32",
         "out_ptr": "*", "part_acc_ptr": "fp32", "part_max_ptr": "fp32", "part_sum_ptr": "fp32"}, ("scale_log2e",),
        lambda c: (c["BLOCK_H"] + c["BLOCK_N"]) * (c["BLOCK_C"] + c["BLOCK_R"]) * _eb(c)),
    "_moe_gate_up_kernel": KernelSpec(
        "triton_moe", ("stride_xh", "stride_wh", "stride_sk", "stride_bn", "stride_ii"),
        {"x_ptr": "*", "w_ptr": "*", "s_ptr": "fp32", "bias_ptr": "*", "sorted_pairs_ptr": "i32",
         "block_expert_ptr": "i32", "inter_ptr": "*"}, ("alpha", "limit"),
        lambda c: (c["BLOCK_M"] + 2 * c["BLOCK_N"]) * c["BLOCK_K"] * _eb(c)),
    "_moe_down_kernel": KernelSpec(
        "triton_moe", ("stride_ii", "stride_wi", "stride_sk", "stride_bh", "stride_rk", "stride_yh"),
        {"inter_ptr": "*", "w_ptr": "*", "s_ptr": "fp32", "bias_ptr": "*", "sorted_pairs_ptr": "i32",
         "block_expert_ptr": "i32", "weights_ptr": "fp32", "y_ptr": "fp32"}, (),
        lambda c: (c["BLOCK_M"] + c["BLOCK_N"]) * c["BLOCK_K"] * _eb(c)),
    "_moe_sum_kernel": KernelSpec(
        "triton_moe", ("stride_yh", "stride_ik", "stride_oh"), {"y_ptr": "fp32", "ids_ptr": "i64", "out_ptr": "*"},
        (), lambda c: c["BLOCK_H"] * 4),
    "_fp8_block_gemm_kernel": KernelSpec(
        "triton_fp8_gemm", ("stride_xk", "stride_wk", "stride_sk", "stride_yn"),
        {"x_ptr": "*", "w_ptr": "fp8e4nv", "s_ptr": "fp32", "b_ptr": "*", "y_ptr": "*"}, (),
        lambda c: (c["BLOCK_M"] + c["BLOCK_N"]) * c["BLOCK_K"] * _eb(c)),
    "_spec_accept_kernel": KernelSpec(
        "triton_verify", ("stride_pk", "stride_qk", "stride_uk"),
        {"p_ptr": "fp32", "q_ptr": "fp32", "u_ptr": "fp32", "num_drafts_ptr": "i64", "out_ptr": "i64"}, (),
        lambda c: c["BLOCK_N"] * c["BLOCK_K"] * 8),
    "_spec_recover_kernel": KernelSpec(
        "triton_verify", ("stride_pv", "stride_qv", "stride_tk", "stride_zv"),
        {"p_ptr": "fp32", "q_ptr": "fp32", "tok_ptr": "i64", "acc_ptr": "i64", "nd_ptr": "i64", "noise_ptr": "fp32",
         "out_ptr": "i64"}, (), lambda c: c["BLOCK_V"] * 8),
}


# ---------------------------------------------------------------------------------------------
# importing the kernels (from an installed kvbatch or a plain checkout)


def _map_repo() -> None:
    """``import kvbatch.kernels`` from a plain checkout too (the GPU image does not install
    kvbatch): gpu_check's mapping, one rule for both scripts."""
    if str(REPO / "benchmarks") not in sys.path:
        sys.path.insert(0, str(REPO / "benchmarks"))
    from gpu_check import _map_repo as map_repo

    map_repo()


def _module(name: str) -> Any:
    import importlib

    _map_repo()
    return importlib.import_module(f"kvbatch.kernels.{name}")


def discover_kernels() -> dict[str, list[str]]:
    """``{file name: [kernel, ...]}``: the ``@triton.jit`` functions of ``kernels/triton_*.py`` that a
    launcher launches (``name[grid](...)``); helpers only called from other kernels are compiled
    inside them. Read from the source, so a new kernel without a ``KERNELS`` entry is noticed."""
    found: dict[str, list[str]] = {}
    for path in sorted((REPO / "kernels").glob("triton_*.py")):
        text = path.read_text()
        names = re.findall(r"@triton\.jit\s*\ndef\s+(\w+)", text)
        found[path.name] = [n for n in names if re.search(rf"\b{n}\[", text)]
    return found


# ---------------------------------------------------------------------------------------------
# the configurations: the launchers' own choices over the supported models


@dataclass
class Config:
    kernel: str
    constexprs: dict[str, Any]
    dtype: str  # what "*" pointers hold
    num_warps: int
    num_stages: int
    models: list[str] = field(default_factory=list)

    def key(self) -> str:
        return json.dumps([self.kernel, self.constexprs, self.dtype, self.num_warps, self.num_stages], sort_keys=True)

    def as_dict(self) -> dict[str, Any]:
        return {**self.constexprs, "dtype": self.dtype, "num_warps": self.num_warps, "num_stages": self.num_stages}


class _Collector:
    """Configurations deduplicated, each with the models that launch it."""

    def __init__(self) -> None:
        self.configs: dict[str, Config] = {}

    def add(self, model: str, kernel: str, dtype: str, num_warps: int | None, num_stages: int | None,
            **constexprs: Any) -> None:
        """``num_warps``/``num_stages`` None: the launcher passes none, Triton's defaults apply."""
        warps, stages = _triton_defaults()
        cfg = Config(kernel, constexprs, dtype, num_warps or warps, num_stages or stages)
        kept = self.configs.setdefault(cfg.key(), cfg)
        if model not in kept.models:
            kept.models.append(model)


def _numerics(dtype: str) -> dict[str, Any]:
    """COMPUTE_F32 and DOT_PRECISION as the launchers pick them for ``dtype`` on a GPU."""
    import torch

    compute_f32, precision = _module("triton_attention")._numerics(getattr(torch, TORCH_NAMES[dtype]),
                                                                   interpreted=False)
    return dict(COMPUTE_F32=compute_f32, DOT_PRECISION=precision)


def _contexts(max_len: int, block_size: int) -> Iterable[int]:
    """Longest-context values that reach every partition count: powers of two, then max_len."""
    n = block_size
    while n < max_len:
        yield n
        n *= 2
    yield max_len


def _attention(col: _Collector, model: str, dtype: str, D: int, num_kv_heads: int, group: int,
               max_len: int, sinks: bool = False) -> None:
    """Paged decode (and its merge) and prefill attention over a [*, Hkv, D] cache, GQA ``group``;
    decode at every partition size its launcher picks for a batch and a longest context. ``sinks``:
    the model's attention has sinks (gpt-oss): the prefill and unsplit decode kernels read them, a
    split decode leaves them to its merge (as the launcher does)."""
    attn = _module("triton_attention")
    numerics = _numerics(dtype)
    dec = attn.decode_tiles(D, group, interpreted=False)
    pre = attn.prefill_tiles(D, ELEM_BYTES[dtype], interpreted=False)
    for bs in KV_BLOCK_SIZES:
        for ctx in _contexts(max_len, bs):
            for batch in BATCHES:
                size = attn.decode_partition_size(ctx, batch, num_kv_heads)
                part, n_parts = attn.split_plan(ctx, size, dec["block_n"])
                col.add(model, "_paged_decode_kernel", dtype, dec["num_warps"], dec["num_stages"],
                        GROUP=group, GROUP_PAD=dec["group_pad"], HEAD_DIM=D, BLOCK_D=dec["block_d"],
                        BLOCK_SIZE=bs, BLOCK_N=dec["block_n"], PARTITION_SIZE=part, SPLIT=n_parts > 1,
                        HAS_SINKS=sinks and n_parts == 1, **numerics)
                if n_parts > 1:
                    _merge(col, model, dtype, D, dec["block_d"], part, n_parts, sinks)
        col.add(model, "_prefill_kernel", dtype, pre["num_warps"], pre["num_stages"], GROUP=group, HEAD_DIM=D,
                BLOCK_D=pre["block_d"], BLOCK_SIZE=bs, BLOCK_M=pre["block_m"], BLOCK_N=pre["block_n"],
                HAS_SINKS=sinks, **numerics)


def _merge(col: _Collector, model: str, dtype: str, width: int, block: int, part: int, n_parts: int,
           sinks: bool = False) -> None:
    attn = _module("triton_attention")
    col.add(model, "_paged_decode_merge_kernel", dtype, 4, None, HEAD_DIM=width, BLOCK_D=block,
            PARTITION_SIZE=part, BLOCK_P=attn.merge_block_p(n_parts), HAS_SINKS=sinks)


def _rms_norm(col: _Collector, model: str, dtype: str, hidden: int, residual: bool) -> None:
    launch = _module("triton_rms_norm").rms_norm_launch(hidden)
    col.add(model, "_rms_norm_kernel", dtype, launch["num_warps"], None, HAS_RESIDUAL=residual, BLOCK=launch["block"])


def _mlp(col: _Collector, model: str, dtype: str, inter: int) -> None:
    col.add(model, "_silu_and_mul_kernel", dtype, 4, None, BLOCK=_module("triton_activation").silu_block(inter))


def _moe(col: _Collector, model: str, dtype: str, hidden: int, experts: int, top_k: int,
         bias: bool = False, swiglu: bool = False, block: tuple[int, int] | None = None,
         mxfp4: bool = False) -> None:
    """Fused MoE at every tile its launcher picks over step sizes, with the model's top-k and with
    top-1 (expert parallelism computes the rows a rank received one pair at a time); ``bias`` and
    ``swiglu``: the model's experts have biases and a clamped SwiGLU (gpt-oss); ``block``: an FP8
    checkpoint's block size, its experts launched as FP8 (``FP8_W``) and, where they are served
    dequantized (a gate/up join off a block boundary), plain; ``mxfp4``: an MXFP4 checkpoint's experts
    (gpt-oss), launched as MXFP4 (``MXFP4_W``) and plain."""
    moe = _module("triton_moe")
    numerics = _numerics(dtype)
    for k in sorted({top_k, 1}):
        tiles = []
        tokens = 1
        while tokens <= MAX_STEP_TOKENS:
            t = moe.moe_tiles(tokens * k, experts, ELEM_BYTES[dtype], interpreted=False)
            if t not in tiles:
                tiles.append(t)
            tokens *= 2
        for t in tiles:
            blocks = dict(TOP_K=k, BLOCK_M=t["block_m"], BLOCK_N=t["block_n"], BLOCK_K=t["block_k"], **numerics)
            # the launcher's plain stand-ins (FP8_W off, blocks of 1), then the FP8 variant
            plain = {"FP8_W": False, "GROUP_N": 1, "GROUP_K": 1, "SCALE_PER_COLUMN": False, "MXFP4_W": False}
            quants = [plain]
            if block is not None:
                quants.append({**plain, "FP8_W": True, "GROUP_N": block[0], "GROUP_K": block[1],
                               "SCALE_PER_COLUMN": block[1] % t["block_k"] == 0})
            if mxfp4:
                quants.append({**plain, "MXFP4_W": True})
            for quant in quants:
                col.add(model, "_moe_gate_up_kernel", dtype, t["num_warps"], t["num_stages"], HAS_BIAS=bias,
                        SWIGLU=swiglu, **blocks, **quant)
                col.add(model, "_moe_down_kernel", dtype, t["num_warps"], t["num_stages"], HAS_BIAS=bias, **blocks,
                        **quant)
        col.add(model, "_moe_sum_kernel", dtype, None, None, TOP_K=k, BLOCK_H=moe.sum_block_h(hidden))


def _fp8_gemm(col: _Collector, model: str, dtype: str, block: tuple[int, int]) -> None:
    """The FP8 block-scaled GEMM at every tile its launcher picks over step sizes (the tile depends
    on the rows, the block size and the activation dtype, not on the projection's shape), with and
    without a bias."""
    fp8 = _module("triton_fp8_gemm")
    numerics = _numerics(dtype)
    tiles = []
    rows = 1
    while rows <= MAX_STEP_TOKENS:
        t = fp8.fp8_gemm_tiles(rows, block, ELEM_BYTES[dtype], interpreted=False)
        if t not in tiles:
            tiles.append(t)
        rows *= 2
    for t in tiles:
        for bias in (False, True):
            col.add(model, "_fp8_block_gemm_kernel", dtype, t["num_warps"], t["num_stages"], GROUP_N=block[0],
                    GROUP_K=block[1], BLOCK_M=t["block_m"], BLOCK_N=t["block_n"], BLOCK_K=t["block_k"],
                    SCALE_PER_COLUMN=block[1] % t["block_k"] == 0, HAS_BIAS=bias, **numerics)


def _rotary_and_store(col: _Collector, model: str, dtype: str, D: int, Hq: int, Hkv: int) -> None:
    rot = _module("triton_rotary").rotary_blocks(D, Hq, Hkv)
    col.add(model, "_rotary_kernel", dtype, 4, None, **rot)


def _store(col: _Collector, model: str, dtype: str, heads: int, width: int) -> None:
    col.add(model, "_store_kv_kernel", dtype, 4, None, **_module("triton_store_kv").store_kv_blocks(heads, width))


def _speculative(col: _Collector, model: str, vocab: int) -> None:
    """The batched verifier's kernels (fp32 probabilities whatever the model dtype)."""
    ver = _module("triton_verify")
    for k in range(1, SPEC_MAX_DRAFTS + 1):
        col.add(model, "_spec_accept_kernel", "fp32", None, None, BLOCK_N=ver.SPEC_ACCEPT_BLOCK_N,
                BLOCK_K=ver.accept_block_k(k))
    for has_q in (False, True):
        col.add(model, "_spec_recover_kernel", "fp32", 4, None, HAS_Q=has_q, BLOCK_V=ver.recover_block_v(vocab))


def configurations(models: dict[str, dict[str, Any]] | None = None,
                   dtypes: tuple[str, ...] = DTYPES) -> list[Config]:
    """Every kernel configuration the engine launches for ``models`` (default: ``MODELS``) in ``dtypes``."""
    _map_repo()
    from kvbatch.engine.models.config import ModelConfig

    col = _Collector()
    for name, raw in (MODELS if models is None else models).items():
        c = ModelConfig.from_hf({"num_hidden_layers": 1, "rms_norm_eps": 1e-6, **raw})
        block = (raw.get("quantization_config") or {}).get("weight_block_size")
        mxfp4 = (raw.get("quantization_config") or {}).get("quant_method") == "mxfp4"
        for dtype in dtypes:
            for residual in (False, True):
                _rms_norm(col, name, dtype, c.hidden_size, residual)
            if block:
                _fp8_gemm(col, name, dtype, tuple(block))
            if c.moe is None or c.moe.first_k_dense_replace or c.moe.mlp_only_layers or c.moe.decoder_sparse_step > 1:
                _mlp(col, name, dtype, c.intermediate_size)
            if c.moe is not None:
                _moe(col, name, dtype, c.hidden_size, c.moe.num_experts, c.moe.top_k, c.moe.expert_bias,
                     c.moe.swiglu_limit is not None, tuple(block) if block else None, mxfp4)
                if c.moe.shared_expert_intermediate_size:
                    _mlp(col, name, dtype, c.moe.shared_expert_intermediate_size)
            if c.mla is None:
                if c.qk_norm:
                    _rms_norm(col, name, dtype, c.head_dim, False)
                _rotary_and_store(col, name, dtype, c.head_dim, c.num_heads, c.num_kv_heads)
                _store(col, name, dtype, c.num_kv_heads, c.head_dim)
                _attention(col, name, dtype, c.head_dim, c.num_kv_heads, c.num_heads // c.num_kv_heads,
                           c.max_position_embeddings, c.attention_sinks)
            else:
                _mla(col, name, dtype, c)
        _speculative(col, name, c.vocab_size)
    return list(col.configs.values())


def _mla(col: _Collector, model: str, dtype: str, c: Any) -> None:
    """DeepSeek-V3's attention: latent norms, rope on the shared key, the latent cache row store,
    MLA decode (and its merge), and MLA prefill as the paged prefill kernel over the cache row."""
    m = c.mla
    mla = _module("triton_mla")
    attn = _module("triton_attention")
    C, R = m.kv_lora_rank, m.qk_rope_head_dim
    if m.q_lora_rank:
        _rms_norm(col, model, dtype, m.q_lora_rank, False)
    _rms_norm(col, model, dtype, C, False)
    _rotary_and_store(col, model, dtype, R, c.num_heads, 1)
    _store(col, model, dtype, 1, C + R)
    tiles = mla.mla_decode_tiles(C, R, interpreted=False)
    numerics = _numerics(dtype)
    pre = attn.prefill_tiles(C + R, ELEM_BYTES[dtype], interpreted=False)
    for bs in KV_BLOCK_SIZES:
        for ctx in _contexts(c.max_position_embeddings, bs):
            part, n_parts = attn.split_plan(ctx, mla.MLA_PARTITION_SIZE, tiles["block_n"])
            col.add(model, "_mla_decode_kernel", dtype, tiles["num_warps"], tiles["num_stages"], C=C, R=R,
                    BLOCK_C=tiles["block_c"], BLOCK_R=tiles["block_r"], BLOCK_H=tiles["block_h"], BLOCK_SIZE=bs,
                    BLOCK_N=tiles["block_n"], PARTITION_SIZE=part, SPLIT=n_parts > 1, **numerics)
            if n_parts > 1:
                _merge(col, model, dtype, C, tiles["block_c"], part, n_parts)
        col.add(model, "_prefill_kernel", dtype, pre["num_warps"], pre["num_stages"], GROUP=c.num_heads,
                HEAD_DIM=C + R, BLOCK_D=pre["block_d"], BLOCK_SIZE=bs, BLOCK_M=pre["block_m"],
                BLOCK_N=pre["block_n"], HAS_SINKS=False, **numerics)


def subset(configs: list[Config]) -> list[Config]:
    """One configuration per kernel: the one with the largest estimated shared memory."""
    best: dict[str, Config] = {}
    for cfg in configs:
        size = KERNELS[cfg.kernel].footprint(cfg.as_dict())
        if cfg.kernel not in best or size > KERNELS[cfg.kernel].footprint(best[cfg.kernel].as_dict()):
            best[cfg.kernel] = cfg
    return list(best.values())


# ---------------------------------------------------------------------------------------------
# compiling one configuration (in a worker process)


def _worker_init(cache_dir: str) -> None:
    os.environ.pop("TRITON_INTERPRET", None)  # before triton is imported: compiled, not interpreted, kernels
    os.environ["TRITON_CACHE_DIR"] = cache_dir
    _map_repo()


def signature(cfg: Config) -> tuple[dict[str, str], dict[str, Any], dict[tuple[int, ...], list[list[Any]]]]:
    """(signature, constexprs, attrs) of ``cfg``'s launch, as the JIT would specialize it: pointers
    16-byte aligned, unit strides constant 1, the other ints i32."""
    spec = KERNELS[cfg.kernel]
    fn = getattr(_module(spec.module), cfg.kernel)
    sig: dict[str, str] = {}
    constexprs: dict[str, Any] = {}
    attrs: dict[tuple[int, ...], list[list[Any]]] = {}
    missing = [n for n in fn.arg_names if n not in cfg.constexprs and fn.params[fn.arg_names.index(n)].is_constexpr]
    if missing:
        raise ValueError(f"{cfg.kernel}: no value for constexpr {', '.join(missing)}")
    for i, name in enumerate(fn.arg_names):
        if fn.params[i].is_constexpr or name in spec.unit_strides:
            sig[name] = "constexpr"
            constexprs[name] = cfg.constexprs[name] if fn.params[i].is_constexpr else 1
        elif name in spec.pointers:
            # the MoE kernels' FP8 and MXFP4 variants: expert weights (MXFP4: and scales) as published
            kind = spec.pointers[name]
            if name == "w_ptr" and cfg.constexprs.get("FP8_W"):
                kind = "fp8e4nv"
            elif name in ("w_ptr", "s_ptr") and cfg.constexprs.get("MXFP4_W"):
                kind = "u8"
            sig[name] = "*" + (cfg.dtype if kind == "*" else kind)
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in spec.floats:
            sig[name] = "fp32"
        elif name.endswith("_ptr"):
            raise ValueError(f"{cfg.kernel}: pointer argument {name!r} has no dtype in KERNELS")
        else:
            sig[name] = "i32"
    return sig, constexprs, attrs


_REGS = re.compile(r"Used (\d+) registers")
_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def _ptxas_usage(log: str) -> tuple[int | None, int | None]:
    """(registers, spill bytes stored + loaded) from a ``ptxas -v`` log."""
    regs = _REGS.findall(log)
    spills = _SPILLS.findall(log)
    return (int(regs[-1]) if regs else None,
            sum(int(a) + int(b) for a, b in spills) if spills else None)


def _ptxas_v(ptx: str, arch: int) -> str:
    """``ptxas -v`` of the PTX with Triton's bundled ptxas, for its log."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        proc = subprocess.run([get_ptxas(arch).path, "-v", f"--gpu-name={sm_arch_from_capability(arch)}", str(src),
                               "-o", str(Path(tmp) / "k.cubin")], capture_output=True, text=True, check=True)
    return proc.stdout + proc.stderr


def compile_config(cfg: Config, arch: int) -> dict[str, Any]:
    """Compile ``cfg`` for ``cuda`` capability ``arch``; its JSON line (with ``error`` on failure
    or past the shared-memory limit)."""
    row: dict[str, Any] = {"kernel": cfg.kernel, "config": cfg.as_dict(), "models": cfg.models, "arch": arch}
    started = time.perf_counter()
    try:
        import triton
        from triton.backends.compiler import GPUTarget

        row["triton"] = triton.__version__
        fn = getattr(_module(KERNELS[cfg.kernel].module), cfg.kernel)
        sig, constexprs, attrs = signature(cfg)
        src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
        triton.knobs.nvidia.dump_ptxas_log = True  # ptxas -v's log, printed: registers and spills
        log = io.StringIO()
        with contextlib.redirect_stdout(log):
            kernel = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                                    options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
        row["shared_bytes"] = int(kernel.metadata.shared)
        regs, spills = getattr(kernel, "n_regs", None), getattr(kernel, "n_spills", None)
        if regs is None or spills is None:
            text = log.getvalue()
            if _REGS.search(text) is None:  # a cache hit compiles nothing: ask ptxas itself
                text = _ptxas_v(kernel.asm["ptx"], arch)
            regs, spills = _ptxas_usage(text)
        row["registers"], row["spills"] = regs, spills
        if row["shared_bytes"] > SHARED_LIMIT_BYTES:
            row["error"] = f"over 227 KiB: {row['shared_bytes']} bytes of shared memory (limit {SHARED_LIMIT_BYTES})"
    except Exception as exc:  # noqa: BLE001 - recorded in the line; the run goes on
        row["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        row["traceback"] = traceback.format_exc()[-3000:]
    row["seconds"] = round(time.perf_counter() - started, 2)
    return row


# ---------------------------------------------------------------------------------------------
# the run


def run(configs: list[Config], out: Path, arch: int, jobs: int) -> list[dict[str, Any]]:
    """Compile ``configs`` in ``jobs`` worker processes, appending each line to ``out/compile.jsonl``."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / "compile.jsonl"
    path.write_text("")
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="gpu-compile-cache-") as cache, \
            ProcessPoolExecutor(max_workers=jobs, mp_context=get_context("spawn"), initializer=_worker_init,
                                initargs=(cache,)) as pool:
        futures = [pool.submit(compile_config, cfg, arch) for cfg in configs]
        with path.open("a") as f:
            for fut in as_completed(futures):
                row = fut.result()
                rows.append(row)
                f.write(json.dumps(row) + "\n")
                f.flush()
    return rows


def missing_kernels(configs: list[Config]) -> list[str]:
    """Kernels launched in ``kernels/triton_*.py`` that no configuration compiles."""
    have = {c.kernel for c in configs}
    return [k for names in discover_kernels().values() for k in names if k not in have]


def summary(rows: list[dict[str, Any]]) -> list[str]:
    """One line per kernel: configurations, errors, largest shared memory, registers, spills, seconds."""
    lines = []
    for kernel in sorted({r["kernel"] for r in rows}):
        mine = [r for r in rows if r["kernel"] == kernel]
        ok = [r for r in mine if "shared_bytes" in r]
        errors = sum("error" in r for r in mine)
        shared = max((r["shared_bytes"] for r in ok), default=0)
        regs = max((r["registers"] or 0 for r in ok), default=0)
        spills = sum(r["spills"] or 0 for r in ok)
        lines.append(f"{kernel:28s} {len(mine):4d} configs  {errors:3d} errors  max shared {shared:7d} B "
                     f"({shared / 1024:5.1f} KiB)  max regs {regs:3d}  spill bytes {spills:5d}  "
                     f"{sum(r['seconds'] for r in mine):7.1f} s")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability as an int (90: H100/H200)")
    parser.add_argument("--out", type=Path, required=True, help="folder for compile.jsonl")
    parser.add_argument("--subset", action="store_true",
                        help="one configuration per kernel, the largest estimated shared memory (CI)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compilations at once")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs must be >= 1, got {args.jobs}")
    if args.arch < 75:
        parser.error(f"--arch {args.arch}: Triton compiles for capability 75 and up (90 is Hopper)")
    configs = configurations()
    missing = missing_kernels(configs)
    if args.subset:
        configs = subset(configs)
    started = time.perf_counter()
    rows = run(configs, args.out, args.arch, args.jobs)
    for kernel in missing:
        row = {"kernel": kernel, "config": {}, "error": "no configuration: add the kernel to gpu_compile.KERNELS "
               "and its launches to configurations()", "seconds": 0.0}
        rows.append(row)
        with (args.out / "compile.jsonl").open("a") as f:
            f.write(json.dumps(row) + "\n")
    for line in summary(rows):
        print(line)
    errors = [r for r in rows if "error" in r]
    print(f"gpu_compile: {len(rows)} configurations for sm_{args.arch}, {len(errors)} errors, "
          f"{time.perf_counter() - started:.0f} s wall with {args.jobs} jobs -> {args.out / 'compile.jsonl'}")
    for r in errors[:10]:
        print(f"  error: {r['kernel']} {json.dumps(r['config'])}: {r['error'].splitlines()[0]}", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
