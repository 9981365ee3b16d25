"""The one place that decides which implementation of a hot-path kernel runs.

On CUDA tensors with Triton importable, the Triton kernels run. On fp32 and bf16 CPU tensors the
small operations of a decode step (residual add + RMSNorm, SiLU-and-multiply, rotary + K/V cache
write, decode attention) run as C kernels built for this CPU (:mod:`kvbatch.kernels.cpu.native`)
when a C compiler is at hand. Everywhere else the PyTorch reference twins in
:mod:`kvbatch.kernels.reference` (and ``reference_mla``, ``reference_verify``) do. Callers import
from here only, so a kernel can be swapped or disabled without touching the engine.

``KVBATCH_KERNELS`` (read at every call):
- unset / ``auto``: Triton for CUDA tensors when it imports; the native CPU kernels for fp32 (and bf16) CPU
  tensors when they build (silently the reference when they do not); the reference otherwise;
- ``native``: as ``auto``, but an fp32 CPU call raises when the native kernels cannot be built;
- ``reference``: always the reference (bit for bit what the engine computed before the native
  kernels, e.g. for ``tests/test_small_ops.py``);
- ``triton``: always Triton; CUDA tensors need it importable, CPU tensors also need
  ``TRITON_INTERPRET=1`` (set before the kernels are first imported) and run in the Triton
  interpreter (~100x slower than the reference; for tests).

Triton is imported lazily, on the first call that wants it, so importing this module works on
a machine without Triton or a GPU; with Triton installed, a Triton kernel module that does not
import raises its ImportError at that first call.
"""

from __future__ import annotations

import os
from functools import cache
from types import SimpleNamespace

import torch

from kvbatch.kernels import reference, reference_mla, reference_verify
from kvbatch.kernels.cpu import native as native_kernels
from kvbatch.kernels.mxfp4_decode import dequantize_mxfp4

gather_slots = reference.gather_slots  # index arithmetic only: the Triton kernels do not need it
slot_major = reference.slot_major  # a view of one layer's cache, for store_kv_layer
# Bitwise batch-invariant attention for CPU determinism; no Triton twin (on a GPU, invariance
# would need a kernel with a fixed reduction order, which is future work).
invariant_attention = reference.invariant_attention
# A whole decode step's dense layers in one native call (fp32 or bf16 CPU; callers check native() first).
DenseLayer, FusedLayers = native_kernels.DenseLayer, native_kernels.FusedLayers
fuse_layers, decode_layers = native_kernels.fuse_layers, native_kernels.decode_layers


@cache
def _triton_kernels() -> SimpleNamespace | None:
    """The Triton kernels, or None when Triton is not installed. A kernel module that fails to
    import while Triton is there is a bug, not a missing extra: its ImportError is raised, never
    turned into a silent fallback to the reference (or, in the tests, a skip)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return None
    from kvbatch.kernels import (
        triton_activation,
        triton_attention,
        triton_fp8_gemm,
        triton_mla,
        triton_moe,
        triton_rms_norm,
        triton_rotary,
        triton_store_kv,
        triton_verify,
    )
    return SimpleNamespace(
        rms_norm=triton_rms_norm.rms_norm,
        silu_and_mul=triton_activation.silu_and_mul,
        apply_rotary=triton_rotary.apply_rotary,
        store_kv=triton_store_kv.store_kv,
        paged_decode_attention=triton_attention.paged_decode_attention,
        prefill_attention=triton_attention.prefill_attention,
        fused_moe=triton_moe.fused_moe,
        fp8_block_linear=triton_fp8_gemm.fp8_block_linear,
        mla_decode_attention=triton_mla.mla_decode_attention,
        spec_accept=triton_verify.spec_accept,
        spec_recover=triton_verify.spec_recover,
        interpreted=triton_attention.INTERPRETED,
    )


def _mode() -> str:
    mode = os.environ.get("KVBATCH_KERNELS", "auto").strip().lower() or "auto"
    if mode not in ("auto", "native", "reference", "triton"):
        raise ValueError(f"KVBATCH_KERNELS={mode!r}: expected 'auto', 'native', 'reference' or 'triton'")
    return mode


def native(t: torch.Tensor, bf16: bool = False) -> bool:
    """Whether the native CPU kernels run for tensors like ``t`` (fp32 on the CPU, and bf16 for
    the kernels that take it, ``bf16=True``; see the module docstring). Raises ``RuntimeError``
    under ``KVBATCH_KERNELS=native`` when they cannot be built."""
    if t.device.type != "cpu" or not (t.dtype == torch.float32 or (bf16 and t.dtype == torch.bfloat16)):
        return False
    mode = _mode()
    if mode not in ("auto", "native"):
        return False
    if native_kernels.available():
        return True
    if mode == "native":
        raise RuntimeError(f"KVBATCH_KERNELS=native, but {native_kernels.unavailable_reason()}")
    return False


def backend(t: torch.Tensor) -> str:
    """``"triton"`` or ``"reference"``: which implementation runs for tensors like ``t`` (the
    operations :func:`native` covers may run natively instead; see there)."""
    mode = _mode()
    if mode == "reference":
        return "reference"
    if t.is_cuda:
        if _triton_kernels() is not None:
            return "triton"
        if mode == "triton":
            raise RuntimeError("KVBATCH_KERNELS=triton, but triton cannot be imported")
        return "reference"
    if mode in ("auto", "native"):
        return "reference"
    if os.environ.get("TRITON_INTERPRET", "0") not in ("1", "true", "True"):
        raise RuntimeError(f"KVBATCH_KERNELS=triton on {t.device} tensors needs TRITON_INTERPRET=1")
    kernels = _triton_kernels()
    if kernels is None:
        raise RuntimeError("KVBATCH_KERNELS=triton, but triton cannot be imported")
    if not kernels.interpreted:
        raise RuntimeError(
            "KVBATCH_KERNELS=triton on CPU tensors: the Triton kernels were imported before "
            "TRITON_INTERPRET=1 was set, so they were compiled for a GPU"
        )
    return "triton"


def _impl(t: torch.Tensor):
    return _triton_kernels() if backend(t) == "triton" else reference


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """See :func:`reference.rms_norm`."""
    return _impl(x).rms_norm(x, weight, eps, residual)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``torch.argmax(x, dim=-1)`` of logits ``x`` [rows, vocab]: natively on fp32 CPU rows (the
    same indices, several times faster at a batched step's 64 rows), by torch elsewhere."""
    if x.dim() == 2 and x.shape[0] and x.shape[1] and x.stride(1) == 1 and native(x):
        return native_kernels.argmax_rows(x)
    return torch.argmax(x, dim=-1)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """See :func:`reference.silu_and_mul`."""
    if native(x, bf16=True):
        return native_kernels.silu_and_mul(x)
    return _impl(x).silu_and_mul(x)


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """See :func:`reference.apply_rotary`. Use the result: the Triton kernel rotates ``q``
    and ``k`` in place and returns them, the reference returns new tensors."""
    return _impl(q).apply_rotary(q, k, positions, cos_sin)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """See :func:`reference.store_kv`."""
    _impl(k_cache).store_kv(k, v, k_cache, v_cache, slot_mapping)


def add_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rms_norm` that may add ``residual`` into ``x`` in place (the reference does, see
    :func:`reference.add_rms_norm`): the caller hands ``x`` over."""
    if native(x, bf16=True) and weight.dtype == x.dtype and (residual is None or residual.dtype == x.dtype):
        return native_kernels.add_rms_norm(x, weight, eps, residual)
    impl = _impl(x)
    if impl is reference:
        return reference.add_rms_norm(x, weight, eps, residual)
    return impl.rms_norm(x, weight, eps, residual)


def rotary_table(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> reference.RotaryTable | None:
    """:func:`reference.rotary_table`, once per forward pass, where the reference path will run for
    tensors like ``x``; None where a kernel will (it reads ``cos_sin`` itself)."""
    if native(x, bf16=True) or _impl(x) is not reference:
        return None
    return reference.rotary_table(positions, cos_sin)


def rotate_qk(qk: torch.Tensor, num_q_heads: int, positions: torch.Tensor, cos_sin: torch.Tensor,
              table: reference.RotaryTable | None) -> torch.Tensor:
    """Rotate the query and key heads of ``qk`` [T, Hq + Hkv, D] in place (``num_q_heads`` = Hq);
    returns ``qk``. The reference uses ``table`` (:func:`rotary_table` of ``positions``), the
    Triton kernel ``positions`` and ``cos_sin``."""
    impl = _impl(qk)
    if impl is reference:
        return reference.rotate_qk(qk, table if table is not None else reference.rotary_table(positions, cos_sin))
    impl.apply_rotary(qk[:, :num_q_heads], qk[:, num_q_heads:], positions, cos_sin)
    return qk


def rotate_and_store(qkv: torch.Tensor, num_q_heads: int, num_kv_heads: int, positions: torch.Tensor,
                     cos_sin: torch.Tensor, table: reference.RotaryTable | None, kv_layer: torch.Tensor,
                     slot_mapping: torch.Tensor, slots_view: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`rotate_qk` of the query and key heads of ``qkv`` [T, (Hq + 2 Hkv) D] (a fused
    projection's output), then :func:`store_kv_layer` of its K and V heads into ``kv_layer``; one
    call on the native path. Returns the rotated ``[T, Hq + Hkv, D]`` view of ``qkv``."""
    T = qkv.shape[0]
    D = kv_layer.shape[-1]
    qk = qkv[:, :(num_q_heads + num_kv_heads) * D].view(T, num_q_heads + num_kv_heads, D)
    if native(qkv, bf16=True) and kv_layer.dtype == qkv.dtype and cos_sin.dtype == torch.float32:
        native_kernels.rotate_and_store(qkv, num_q_heads, num_kv_heads, D, positions, cos_sin, kv_layer, slot_mapping)
        return qk
    rotate_qk(qk, num_q_heads, positions, cos_sin, table)
    store_kv_layer(qkv[:, num_q_heads * D:].view(T, 2, num_kv_heads, D), kv_layer, slot_mapping, slots_view)
    return qk


def store_kv_layer(kv: torch.Tensor, kv_layer: torch.Tensor, slot_mapping: torch.Tensor,
                   slots_view: torch.Tensor | None = None) -> None:
    """See :func:`reference.store_kv_layer` (``slots_view`` serves the reference only); the Triton
    kernel writes K and V of ``kv`` [T, 2, Hkv, D] into ``kv_layer[0]`` and ``kv_layer[1]``."""
    impl = _impl(kv_layer)
    if impl is reference:
        reference.store_kv_layer(kv, kv_layer, slot_mapping, slots_view)
        return
    impl.store_kv(kv[:, 0], kv[:, 1], kv_layer[0], kv_layer[1], slot_mapping)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    slots: torch.Tensor | None = None,
    workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
    plan: reference.DecodePlan | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """See :func:`reference.paged_decode_attention` (``workspace`` and ``plan`` serve the reference
    only). ``sinks``: gpt-oss's per-head sink logits [Hq] fp32, taken by every implementation (the
    native kernel, the Triton kernel, the reference)."""
    if native(q, bf16=True) and q.dtype == k_cache.dtype:
        sink = {} if sinks is None else {"sinks": sinks}  # gpt-oss only
        return native_kernels.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, **sink)
    impl = _impl(q)
    if impl is reference:
        return reference.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, slots,
                                                workspace, plan, sinks)
    return impl.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, slots, sinks=sinks)


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_query_lens: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    plan: reference.PrefillPlan | None = None,
    max_query_len: int = 0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """See :func:`reference.prefill_attention` (``plan`` serves the reference only).
    ``max_query_len`` > 0: the longest chunk, known on the host, sizes the Triton kernel's grid
    (no device-to-host read of ``cu_query_lens``). ``sinks``: gpt-oss's per-head sink logits [Hq]
    fp32, taken by the Triton kernel and the reference alike.

    A ``plan`` where Triton runs is never :func:`plan_prefill`'s (None there): it is a caller's
    windowed reference plan (gpt-oss's sliding layers, ``llama.sliding_plans``), and only the
    reference knows its window (this call carries none), so the reference runs it."""
    impl = _impl(q)
    if impl is reference or plan is not None:
        return reference.prefill_attention(q, k_cache, v_cache, block_tables, cu_query_lens, context_lens, scale,
                                           plan, sinks)
    return impl.prefill_attention(q, k_cache, v_cache, block_tables, cu_query_lens, context_lens, scale,
                                  max_query_len=max_query_len or None, sinks=sinks)


def plan_decode(x: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
                block_size: int) -> reference.DecodePlan | None:
    """:func:`reference.plan_decode` where the reference path will run for tensors like ``x``
    (its in-place decode path is fp32 only: a 16-bit model plans the padded path alone)."""
    if native(x, bf16=True) or _impl(x) is not reference or block_tables.shape[0] == 0:
        return None
    return reference.plan_decode(block_tables, context_lens, block_size, sparse=x.dtype == torch.float32)


def plan_prefill(x: torch.Tensor, block_tables: torch.Tensor, cu_query_lens: torch.Tensor,
                 context_lens: torch.Tensor, block_size: int, group: int) -> reference.PrefillPlan | None:
    """:func:`reference.plan_prefill`, once per forward pass, where the reference path will run
    ``prefill_attention`` for tensors like ``x``; None where a kernel will (it needs no plan)."""
    if _impl(x) is not reference:
        return None
    return reference.plan_prefill(block_tables, cu_query_lens, context_lens, block_size, group)


def fused_moe(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    swiglu: tuple[float, float] | None = None,
    fp8_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    fp8_block: tuple[int, int] | None = None,
    mxfp4_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """See :func:`reference.fused_moe`. gpt-oss's experts (biases, clamped SwiGLU) go where the
    others do: the Triton MoE kernel takes both (constexpr variants), the reference runs on the CPU.
    ``fp8_scales``: the expert weights are float8_e4m3fn with these block scales (``fp8_block``; see
    :func:`fused_moe_fp8_reference`): the Triton kernel's FP8 variant where Triton runs (CUDA), else
    that reference. ``mxfp4_scales``: the expert weights are MXFP4 blocks with these E8M0 scales (see
    :func:`fused_moe_mxfp4_reference`): the kernel's MXFP4 variant there, else that reference."""
    if mxfp4_scales is not None:
        if backend(x) == "triton":
            return _triton_kernels().fused_moe(x, w_gate_up, w_down, topk_ids, topk_weights, gate_up_bias,
                                               down_bias, swiglu, mxfp4_scales=mxfp4_scales)
        return fused_moe_mxfp4_reference(x, w_gate_up, w_down, topk_ids, topk_weights, gate_up_bias, down_bias,
                                         swiglu, mxfp4_scales)
    if fp8_scales is None:
        return _impl(x).fused_moe(x, w_gate_up, w_down, topk_ids, topk_weights, gate_up_bias, down_bias, swiglu)
    if backend(x) == "triton":
        return _triton_kernels().fused_moe(x, w_gate_up, w_down, topk_ids, topk_weights, gate_up_bias, down_bias,
                                           swiglu, fp8_scales=fp8_scales, fp8_block=fp8_block)
    return fused_moe_fp8_reference(x, w_gate_up, w_down, topk_ids, topk_weights, gate_up_bias, down_bias, swiglu,
                                   fp8_scales, fp8_block)


def dequantize_fp8_experts(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """:func:`dequantize_fp8_block` of each expert's matrix: FP8 ``[E, N, K]`` with scales
    ``[E, ceil(N / bn), ceil(K / bk)]`` -> fp32 ``[E, N, K]`` (an empty stack stays empty)."""
    if weight.dim() != 3 or scale_inv.dim() != 3 or weight.shape[0] != scale_inv.shape[0]:
        raise ValueError(f"expert weights {tuple(weight.shape)} with scales {tuple(scale_inv.shape)}: expected "
                         "[E, N, K] and [E, ceil(N / bn), ceil(K / bk)]")
    if weight.shape[0] == 0:  # an expert-parallel rank holding no expert of a layer
        return torch.empty(weight.shape, dtype=torch.float32, device=weight.device)
    return torch.stack([dequantize_fp8_block(weight[e], scale_inv[e], block) for e in range(weight.shape[0])])


def fused_moe_fp8_reference(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_up_bias: torch.Tensor | None,
    down_bias: torch.Tensor | None,
    swiglu: tuple[float, float] | None,
    fp8_scales: tuple[torch.Tensor, torch.Tensor],
    fp8_block: tuple[int, int],
) -> torch.Tensor:
    """:func:`reference.fused_moe` of FP8 experts: each expert's weights dequantized in fp32
    (:func:`dequantize_fp8_experts`) and rounded to ``x.dtype`` — the tensors the CPU loader holds
    for a model of that dtype, so the same result bit for bit. The readable twin of the Triton
    kernel's FP8 variant (:func:`kvbatch.kernels.triton_moe.fused_moe` with ``fp8_scales``)."""
    w_gu = dequantize_fp8_experts(w_gate_up, fp8_scales[0], fp8_block).to(x.dtype)
    w_dn = dequantize_fp8_experts(w_down, fp8_scales[1], fp8_block).to(x.dtype)
    return reference.fused_moe(x, w_gu, w_dn, topk_ids, topk_weights, gate_up_bias, down_bias, swiglu)


def fused_moe_mxfp4_reference(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_ids: torch.Tensor,
                              topk_weights: torch.Tensor, gate_up_bias: torch.Tensor | None,
                              down_bias: torch.Tensor | None, swiglu: tuple[float, float] | None,
                              mxfp4_scales: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """:func:`reference.fused_moe` of MXFP4 experts (uint8 blocks ``[E, 2I, H / 32, 16]`` and
    ``[E, H, I / 32, 16]``, E8M0 scales ``[E, 2I, H / 32]`` and ``[E, H, I / 32]``): dequantized in
    fp32 by the loader's own :func:`~kvbatch.kernels.mxfp4_decode.dequantize_mxfp4` and rounded to
    ``x.dtype`` — the tensors a CPU model of that dtype holds, so the same result bit for bit. The
    readable twin of the Triton kernel's MXFP4 variant."""
    w_gu = dequantize_mxfp4(w_gate_up, mxfp4_scales[0]).to(x.dtype)
    w_dn = dequantize_mxfp4(w_down, mxfp4_scales[1]).to(x.dtype)
    return reference.fused_moe(x, w_gu, w_dn, topk_ids, topk_weights, gate_up_bias, down_bias, swiglu)


def dequantize_fp8_block(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """An FP8 weight [N, K] times its per-block scales [ceil(N / bn), ceil(K / bk)], in fp32:
    ``w[i, j] * scale_inv[i // bn, j // bk]`` (the dequantization of DeepSeek-V3's and Qwen3's FP8
    checkpoints; each product of an fp8 value and an fp32 scale is exact in fp32 up to one rounding).
    Raises ValueError when the scales' shape does not fit."""
    bn, bk = block
    n, k = weight.shape
    expected = (-(-n // bn), -(-k // bk))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(f"scales of shape {tuple(scale_inv.shape)} for a [{n}, {k}] weight in "
                         f"{bn}x{bk} blocks (expected {expected})")
    scales = scale_inv.to(torch.float32).repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return weight.to(torch.float32) * scales


def fp8_block_linear_reference(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                               block: tuple[int, int], bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K] @ dequant(weight)^T (+ bias)`` -> ``[M, N]`` in ``x.dtype``: the weight
    dequantized in fp32 and rounded to ``x.dtype`` (what the CPU loader holds), then ``F.linear``.
    The readable twin of :func:`kvbatch.kernels.triton_fp8_gemm.fp8_block_linear`."""
    w = dequantize_fp8_block(weight, scale_inv, block).to(x.dtype)
    return torch.nn.functional.linear(x, w, None if bias is None else bias.to(x.dtype))


def fp8_block_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """An FP8 block-scaled projection (weight float8_e4m3fn [N, K], fp32 ``scale_inv`` per ``block``):
    the Triton kernel where :func:`backend` picks Triton (CUDA), else :func:`fp8_block_linear_reference`."""
    if backend(x) == "triton":
        return _triton_kernels().fp8_block_linear(x, weight, scale_inv, block, bias)
    return fp8_block_linear_reference(x, weight, scale_inv, block, bias)


def store_mla_kv(latent: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """See :func:`reference_mla.store_mla_kv`; on Triton it is the paged ``store_kv`` kernel with
    the latent row as a single-head key (and the same row as its value: one cache, written once
    per token by each of the two stores, identical bytes)."""
    if backend(kv_cache) == "triton":
        rows = latent.reshape(latent.shape[0], 1, latent.shape[-1])
        _triton_kernels().store_kv(rows, rows, kv_cache, kv_cache, slot_mapping)
        return
    reference_mla.store_mla_kv(latent, kv_cache, slot_mapping)


def mla_decode_attention(
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    workspace: torch.Tensor | None = None,
) -> torch.Tensor:
    """See :func:`reference_mla.mla_decode_attention` (``workspace`` serves the reference only)."""
    if backend(q_latent) == "triton":
        return _triton_kernels().mla_decode_attention(q_latent, q_pe, kv_cache, block_tables, context_lens, scale)
    return reference_mla.mla_decode_attention(q_latent, q_pe, kv_cache, block_tables, context_lens, scale, workspace)


def mla_prefill_attention(
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_query_lens: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_query_len: int = 0,
) -> torch.Tensor:
    """See :func:`reference_mla.mla_prefill_attention`. On Triton it is the paged prefill kernel
    run as multi-query attention with one key "head" ``[c_kv ; k_pe]`` (the cache row) whose value
    is the same row, keeping the first ``kv_lora_rank`` output columns: the absorbed MLA prefill,
    with no host read (``max_query_len`` > 0, known on the host, sizes the grid)."""
    if backend(q_latent) == "triton":
        C = q_latent.shape[-1]
        q = torch.cat([q_latent, q_pe], dim=-1).to(kv_cache.dtype)
        out = _triton_kernels().prefill_attention(q, kv_cache, kv_cache, block_tables, cu_query_lens, context_lens,
                                                  scale, max_query_len=max_query_len or None)
        return out[..., :C].to(q_latent.dtype)
    return reference_mla.mla_prefill_attention(q_latent, q_pe, kv_cache, block_tables, cu_query_lens, context_lens,
                                               scale)


def spec_accept(
    p_draft_token: torch.Tensor,
    q_draft_token: torch.Tensor,
    uniforms: torch.Tensor,
    num_drafts: torch.Tensor,
) -> torch.Tensor:
    """See :func:`reference_verify.spec_accept`."""
    impl = _triton_kernels() if backend(p_draft_token) == "triton" else reference_verify
    return impl.spec_accept(p_draft_token, q_draft_token, uniforms, num_drafts)


def spec_recover(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    draft_tokens: torch.Tensor,
    num_accepted: torch.Tensor,
    num_drafts: torch.Tensor,
    noise: torch.Tensor,
) -> torch.Tensor:
    """See :func:`reference_verify.spec_recover`."""
    impl = _triton_kernels() if backend(target_probs) == "triton" else reference_verify
    return impl.spec_recover(target_probs, draft_probs, draft_tokens, num_accepted, num_drafts, noise)
