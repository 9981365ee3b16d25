"""The CPU kernels of ``native.c`` (and the parts it includes): a decode step's small operations,
one call each.

:mod:`kvbatch.kernels.dispatch` runs these instead of the PyTorch reference for fp32 CPU tensors,
and for bf16 ones too (the small ops, decode attention, the GEMV and the fused decode layers over
bf16 weights), when the library builds on this machine
(:mod:`kvbatch.kernels.cpu.native_build`; ``KVBATCH_KERNELS`` chooses, see dispatch). Each function
takes what its reference twin takes and computes the same formula in fp32 (bf16 tensors rounded
where the reference's round), in another summation order (the tests bound the difference), except
that :func:`rotate_and_store` does the work of ``rotate_qk`` and ``store_kv_layer`` in one call.

Every index the C code follows (positions, slots, block ids, context lengths) is checked there
against the tensor it indexes; a bad one raises ``IndexError`` here and nothing is written out of
bounds.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NamedTuple

import torch

from kvbatch.kernels.cpu import native_build

SOURCE = Path(__file__).with_name("native.c")  # includes native_common.h and the native_*.c parts: one library
_ABI = 11
# Rows the native fp32 and bf16 GEMVs and the fused decode layers over them are offered for: decode
# and small batches, where a multiply is bound by streaming the weights; more rows are compute-bound,
# and there oneDNN's or MKL's GEMMs win (the fused layers take MKL's at any row count). (The int8 blocks are offered at every row count: widened in registers, they
# multiply as fast as oneDNN's fp32 GEMM, where the other int8 routes copy or emulate.)
GEMV_MAX_ROWS = 8
_ERRORS = {1: (IndexError, "an index (position, slot, block id or context length) is out of range"),
           2: (ValueError, "a shape the kernel does not take"),
           3: (MemoryError, "no memory for the attention scores")}
_P, _I64, _F32, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int


@functools.cache
def _library() -> ctypes.CDLL | str:
    """The loaded library, or the reason there is none (cached: one build per process)."""
    lib = native_build.load(lambda: native_build.build(SOURCE, native_build.cache_dir("cpu-native")),
                            "kvb_native_abi_version", _ABI)
    if isinstance(lib, str):
        return lib
    lib.kvb_add_rms_norm.restype = None
    lib.kvb_add_rms_norm.argtypes = [_P, _P, _P, _P, _I64, _I64, _F32, _INT]
    lib.kvb_silu_and_mul.restype = None
    lib.kvb_silu_and_mul.argtypes = [_P, _P, _I64, _I64, _INT]
    lib.kvb_rotary_store.restype = _INT
    lib.kvb_rotary_store.argtypes = [_P, _I64, _I64, _I64, _I64, _I64, _P, _P, _I64, _P, _P, _P, _I64, _INT]
    for fp32_fn, bf16_fn in ((lib.kvb_add_rms_norm, lib.kvb_add_rms_norm_bf16),
                             (lib.kvb_silu_and_mul, lib.kvb_silu_and_mul_bf16),
                             (lib.kvb_rotary_store, lib.kvb_rotary_store_bf16)):
        bf16_fn.restype, bf16_fn.argtypes = fp32_fn.restype, fp32_fn.argtypes
    lib.kvb_decode_attention.restype = _INT
    lib.kvb_decode_attention.argtypes = [_P, _I64, _I64, _I64, _I64, _I64, _P, _P, _INT, _I64, _I64, _P, _I64, _P,
                                         _F32, _P, _INT, _I64, _P]
    lib.kvb_decode_layers.restype = _INT
    lib.kvb_decode_layers.argtypes = [_P, _I64, _P, _P, _P, _INT, _P, _INT]
    lib.kvb_attention_parts.restype = _I64
    lib.kvb_attention_parts.argtypes = [_I64, _P, _I64, _I64, _INT]
    lib.kvb_gemv.restype = _INT
    lib.kvb_block_cols.restype = _INT
    lib.kvb_block_cols.argtypes = []
    lib.kvb_gemv.argtypes = [_P, _I64, _P, _P, _INT, _I64, _I64, _P, _P, _INT]
    lib.kvb_greedy_head.restype = _INT
    lib.kvb_greedy_head.argtypes = [_P, _I64, _P, _P, _I64, _I64, _P, _P, _P, _INT]
    lib.kvb_screen_select.restype = _INT
    lib.kvb_screen_select.argtypes = [_P, _P, _I64, _I64, _P, _P, _P, _P, _P, _P, _P, _I64, _INT]
    lib.kvb_argmax_rows.restype = _INT
    lib.kvb_argmax_rows.argtypes = [_P, _I64, _I64, _I64, _P, _INT]
    return lib


def available() -> bool:
    return not unavailable_reason()


def unavailable_reason() -> str:
    """Why the native kernels are off ('' when they are on)."""
    return native_build.reason(_library())


def identity() -> str:
    """Names the build a measurement timed (kernel_choice's cache key: a changed source or compiler
    measures the native GEMV again)."""
    cc = native_build.compiler()
    return native_build.build_key(SOURCE, cc) if cc and available() else "unavailable"


def _lib() -> ctypes.CDLL:
    lib = _library()
    if isinstance(lib, str):
        raise RuntimeError(f"the native CPU kernels are unavailable: {lib}")
    return lib


def _check(rc: int, what: str) -> None:
    if rc:
        kind, reason = _ERRORS.get(rc, (RuntimeError, f"error {rc}"))
        raise kind(f"{what}: {reason}")


def _fp32(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.dtype != torch.float32 or t.device.type != "cpu":
            raise ValueError(f"the native CPU kernels take fp32 CPU tensors, got {t.dtype} on {t.device}")


def _bf16(*tensors: torch.Tensor) -> bool:
    """Whether ``tensors`` are all bf16 (the small ops' bf16 twins take them) rather than all fp32
    CPU tensors; raises ``ValueError`` for anything else, or a mix."""
    if all(t.dtype == torch.bfloat16 and t.device.type == "cpu" for t in tensors):
        return True
    if all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors):
        return False
    got = ", ".join(f"{t.dtype} on {t.device}" for t in tensors)
    raise ValueError(f"the native CPU kernels take all-fp32 or all-bf16 CPU tensors, got {got}")


def _ints(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype and t.is_contiguous() else t.to(dtype).contiguous()


def add_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`kvbatch.kernels.reference.add_rms_norm`: ``(normed, new_residual)``, the residual
    added into ``x`` in place (the caller hands ``x`` over). All fp32, or all bf16 (rounded where
    the reference's bf16 tensors round)."""
    bf16 = _bf16(x, weight, *(() if residual is None else (residual,)))
    dim = x.shape[-1]
    if weight.shape != (dim,):
        raise ValueError(f"rms_norm weight {tuple(weight.shape)} does not match rows of {dim}")
    if not x.is_contiguous():
        x = x.contiguous()
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError(f"residual {tuple(residual.shape)} does not match x {tuple(x.shape)}")
        residual = residual.contiguous()
    weight = weight.contiguous()  # bound to a name: a temporary's memory would be freed before the call
    out = torch.empty_like(x)
    fn = _lib().kvb_add_rms_norm_bf16 if bf16 else _lib().kvb_add_rms_norm
    fn(x.data_ptr(), None if residual is None else residual.data_ptr(), weight.data_ptr(), out.data_ptr(),
       x.numel() // max(dim, 1), dim, eps, torch.get_num_threads())
    return out, x


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``torch.argmax(x, dim=-1)`` of an fp32 CPU ``x`` [rows, cols] (cols >= 1) whose rows are
    contiguous: the same indices, NaN taken as the largest value as torch takes it."""
    _fp32(x)
    if x.dim() != 2 or x.shape[1] < 1 or x.stride(1) != 1:
        raise ValueError(f"argmax_rows takes [rows, cols >= 1] with contiguous rows, got {tuple(x.shape)} "
                         f"strides {x.stride()}")
    out = torch.empty(x.shape[0], dtype=torch.int64)
    _check(_lib().kvb_argmax_rows(x.data_ptr(), x.shape[0], x.shape[1], max(x.stride(0), x.shape[1]),
                                  out.data_ptr(), torch.get_num_threads()), "argmax_rows")
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """:func:`kvbatch.kernels.reference.silu_and_mul`: ``silu(gate) * up`` of ``x`` [..., 2 I], fp32
    or bf16."""
    bf16 = _bf16(x)
    if x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul: the last axis holds gate and up halves, got odd width {x.shape[-1]}")
    x = x.contiguous()
    half = x.shape[-1] // 2
    out = x.new_empty((*x.shape[:-1], half))
    fn = _lib().kvb_silu_and_mul_bf16 if bf16 else _lib().kvb_silu_and_mul
    fn(x.data_ptr(), out.data_ptr(), x.numel() // max(2 * half, 1), half, torch.get_num_threads())
    return out


def rotate_and_store(qkv: torch.Tensor, num_q_heads: int, num_kv_heads: int, head_dim: int,
                     positions: torch.Tensor, cos_sin: torch.Tensor, kv_layer: torch.Tensor | None,
                     slot_mapping: torch.Tensor) -> None:
    """Rotate the query and key heads of ``qkv`` [T, (Hq + 2 Hkv) D] (a fused projection's output:
    q, k, v heads in that order) in place, as :func:`kvbatch.kernels.reference.rotate_qk` does,
    then write each token's K and V to its slot of ``kv_layer`` [2, num_blocks, block_size, Hkv,
    D] as :func:`kvbatch.kernels.reference.store_kv_layer` does (``kv_layer`` None: rotate only).
    ``qkv`` and ``kv_layer`` fp32, or both bf16 (rotated in fp32, rounded once); ``cos_sin`` fp32."""
    _fp32(cos_sin)
    bf16 = _bf16(qkv, *(() if kv_layer is None else (kv_layer,)))
    T = qkv.shape[0]
    if qkv.dim() != 2 or qkv.stride(1) != 1 or qkv.shape[1] < (num_q_heads + 2 * num_kv_heads) * head_dim:
        raise ValueError(f"rotate_and_store takes rows of (Hq + 2 Hkv) x D = "
                         f"{(num_q_heads + 2 * num_kv_heads) * head_dim} values, got {tuple(qkv.shape)}")
    if cos_sin.dim() != 2 or cos_sin.shape[1] != head_dim:
        raise ValueError(f"cos_sin must be [max_positions, {head_dim}], got {tuple(cos_sin.shape)}")
    positions, slots = _ints(positions, torch.int64), _ints(slot_mapping, torch.int64)
    if positions.numel() != T or (kv_layer is not None and slots.numel() != T):
        raise ValueError(f"{T} tokens need {T} positions and slots, got {positions.numel()} and {slots.numel()}")
    k_plane = v_plane = None
    num_slots = 0
    if kv_layer is not None:
        if not kv_layer.is_contiguous() or kv_layer.shape[0] != 2 or kv_layer.shape[-2:] != (num_kv_heads, head_dim):
            raise ValueError(f"kv_layer must be a contiguous [2, blocks, block_size, {num_kv_heads}, {head_dim}], "
                             f"got {tuple(kv_layer.shape)}")
        k_plane = kv_layer.data_ptr()
        num_slots = kv_layer[0].numel() // (num_kv_heads * head_dim)
        v_plane = k_plane + kv_layer.stride(0) * kv_layer.element_size()
    cos_sin = cos_sin.contiguous()
    fn = _lib().kvb_rotary_store_bf16 if bf16 else _lib().kvb_rotary_store
    rc = fn(qkv.data_ptr(), T, qkv.stride(0), num_q_heads, num_kv_heads, head_dim, positions.data_ptr(),
            cos_sin.data_ptr(), cos_sin.shape[0], k_plane, v_plane, slots.data_ptr(), num_slots,
            torch.get_num_threads())
    _check(rc, "rotate_and_store")


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           window: int = 0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`kvbatch.kernels.reference.paged_decode_attention`, reading K and V where they lie:
    ``q`` [B, Hq, D] (rows may be strided), caches [num_blocks, block_size, Hkv, D], all fp32, or
    all bf16 (computed in fp32, K and V widened as they are read, or on a CPU with AVX512-BF16 the
    query-key products by ``vdpbf16ps``, exact products summed in fp32; the result rounded to bf16).
    ``window`` > 0: a sliding window, each query sees the last ``window`` positions of its context
    only (read from the block holding the first of them); 0: the whole context. ``sinks`` [Hq]
    (gpt-oss): each head's sink logit joins its softmax's denominator only (in fp32)."""
    if window < 0:
        raise ValueError(f"paged_decode_attention: window must be >= 0, got {window}")
    bf16 = q.dtype == torch.bfloat16
    if bf16:
        if k_cache.dtype != torch.bfloat16 or v_cache.dtype != torch.bfloat16 or q.device.type != "cpu":
            raise ValueError(f"bf16 queries need bf16 CPU caches, got {k_cache.dtype} and {v_cache.dtype}")
        q = q.float()
    else:
        _fp32(q, k_cache, v_cache)
    B, Hq, D = q.shape
    num_blocks, block_size, Hkv, Dk = k_cache.shape
    if Dk != D or v_cache.shape != k_cache.shape or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError(f"caches must be contiguous [blocks, block_size, Hkv, {D}], got {tuple(k_cache.shape)} "
                         f"and {tuple(v_cache.shape)}")
    if q.stride(2) != 1 or q.stride(1) != D:
        q = q.contiguous()
    tables, lens = _ints(block_tables, torch.int32), _ints(context_lens, torch.int32)
    if tables.dim() != 2 or tables.shape[0] != B or lens.numel() != B:
        raise ValueError(f"{B} sequences need [{B}, max_blocks] block tables and {B} context lengths, "
                         f"got {tuple(tables.shape)} and {lens.numel()}")
    if sinks is not None:
        sinks = sinks.detach().to(device="cpu", dtype=torch.float32).contiguous()
        if sinks.shape != (Hq,):
            raise ValueError(f"sinks must be one logit per query head [{Hq}], got {tuple(sinks.shape)}")
    out = q.new_empty((B, Hq, D))
    rc = _lib().kvb_decode_attention(q.data_ptr(), B, q.stride(0), Hq, Hkv, D, k_cache.data_ptr(),
                                     v_cache.data_ptr(), int(bf16), num_blocks, block_size, tables.data_ptr(),
                                     tables.shape[1], lens.data_ptr(), scale, out.data_ptr(), torch.get_num_threads(),
                                     int(window), None if sinks is None else sinks.data_ptr())
    _check(rc, "paged_decode_attention")
    return out.to(torch.bfloat16) if bf16 else out


class Int8Blocks(NamedTuple):
    """An int8 weight as the native GEMV streams it: ``q`` [ceil(out / 16), in, 16], blocks of 16
    output columns each one contiguous run (the last block's missing columns zero), standing for
    ``w[i, c] = q[c // 16, i, c % 16] * scale[c]`` (weight-only int8, one scale per output channel;
    ``scale`` padded to whole blocks). Made by :func:`int8_blocks`."""

    q: torch.Tensor  # [blocks, in, 16] int8
    scale: torch.Tensor  # [blocks * 16] fp32
    out_features: int


class Bf16Blocks(NamedTuple):
    """A bf16 weight as the native GEMV streams it: ``q`` [ceil(out / 16), in, 16] bf16 in
    :class:`Int8Blocks`' layout, standing for ``w[i, c] = q[c // 16, i, c % 16]`` (no scale).
    Made by :func:`bf16_blocks`."""

    q: torch.Tensor  # [blocks, in, 16] bf16
    out_features: int


def block_cols() -> int:
    """Output columns per block of :class:`Int8Blocks` and :class:`Bf16Blocks` (the native
    library's W_BLOCK)."""
    return int(_lib().kvb_block_cols())


def _blocked(w: torch.Tensor) -> torch.Tensor:
    """``w`` [out, in] as [ceil(out / block_cols), in, block_cols], the missing columns zero."""
    width = block_cols()
    pad = -w.shape[0] % width
    w = torch.cat([w, w.new_zeros(pad, w.shape[1])]) if pad else w
    return w.view(-1, width, w.shape[1]).transpose(1, 2).contiguous()


def int8_blocks(q: torch.Tensor, scale: torch.Tensor) -> Int8Blocks:
    """The blocked layout of an int8 weight ``q`` [out, in] with scales [out]."""
    if q.dtype != torch.int8 or q.dim() != 2 or scale.shape != (q.shape[0],):
        raise ValueError(f"int8_blocks takes an int8 [out, in] and its [out] scales, got {q.dtype} "
                         f"{tuple(q.shape)} and {tuple(scale.shape)}")
    out = q.shape[0]
    pad = -out % block_cols()
    scale = torch.cat([scale.float(), scale.new_zeros(pad, dtype=torch.float32)]) if pad else scale.float()
    return Int8Blocks(_blocked(q), scale.contiguous(), out)


def bf16_blocks(w: torch.Tensor) -> Bf16Blocks:
    """The blocked layout of a bf16 weight ``w`` [out, in] (the native GEMV's, and the fused
    layers', for a bf16 model)."""
    if w.dtype != torch.bfloat16 or w.dim() != 2:
        raise ValueError(f"bf16_blocks takes a bf16 [out, in], got {w.dtype} {tuple(w.shape)}")
    return Bf16Blocks(_blocked(w), w.shape[0])


def blocks_linear(x: torch.Tensor, w: Bf16Blocks, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w (+ bias)`` by PyTorch over the blocks as they lie (a batched matmul, no copy of the
    weight): where the native GEMV does not run (past 8 rows, ``KVBATCH_KERNELS=reference``)."""
    nb, rows = w.q.shape[0], x.shape[0]
    xs = x.unsqueeze(0).expand(nb, rows, x.shape[1])
    if bias is None:
        y = torch.bmm(xs, w.q)
    else:  # the bias added before the one rounding to bf16, as the native GEMV and F.linear add it
        padded = torch.cat([bias, bias.new_zeros(nb * w.q.shape[2] - bias.shape[0])]) if bias.shape[0] % w.q.shape[2] \
            else bias
        y = torch.baddbmm(padded.view(nb, 1, -1), xs, w.q)
    return y.transpose(0, 1).reshape(rows, -1)[:, :w.out_features]


class ColumnsWeight(NamedTuple):
    """A weight in another native library's format, multiplied inside the fused decode layers by
    that library's kernel (``kvb_cols_fn`` in native_gemv.c): each thread calls ``cols`` for its
    range of output columns. ``data`` holds the bytes it reads (kept alive here), ``qtype`` the
    format's type code; it stands for an ``[in_features, out_features]`` product, of up to
    ``max_rows`` rows. The GGUF blocks: :func:`kvbatch.kernels.cpu.gguf_kernels.fused_weight`."""

    cols: int  # the C function's address
    data: torch.Tensor
    qtype: int
    in_features: int
    out_features: int
    max_rows: int


class GemmWeight(NamedTuple):
    """An fp32 weight in MKL's packed layout, multiplied inside the fused decode layers by MKL's
    ``cblas_sgemm_compute`` (whose address :func:`fuse_layers` takes): the layers' batched schedule,
    one MKL call per projection between parallel loops of the small ops. ``data`` holds the packed
    bytes (kept alive here; never copied: MKL's buffer must not move); it stands for an
    ``[in_features, out_features]`` product. :func:`kvbatch.kernels.cpu.mkl_packed.fused_weight`."""

    data: torch.Tensor
    in_features: int
    out_features: int


Weight = torch.Tensor | Int8Blocks | Bf16Blocks | ColumnsWeight | GemmWeight  # fp32 [in, out], int8 or bf16 blocks, another kernel's
# kvb_proj_t's kinds (native_gemv.c): how the C code reads a weight's bytes
_W_F32, _W_I8, _W_BF16, _W_COLS, _W_MKL = 0, 1, 2, 3, 4


def _weight_ptrs(w: Weight, name: str) -> tuple[int, int | None, int, tuple[int, int]]:
    """(data pointer, scale pointer or None, kind, (in, out)) of a weight the native GEMV or the
    fused layers take, checked."""
    width = block_cols()
    if isinstance(w, ColumnsWeight):
        if not w.cols or not w.data.is_contiguous() or w.data.device.type != "cpu":
            raise ValueError(f"{name}: a columns weight needs its kernel's address and contiguous CPU bytes")
        return w.data.data_ptr(), None, _W_COLS, (w.in_features, w.out_features)
    if isinstance(w, GemmWeight):
        if not w.data.is_contiguous() or w.data.device.type != "cpu":
            raise ValueError(f"{name}: an MKL-packed weight needs its contiguous CPU bytes")
        return w.data.data_ptr(), None, _W_MKL, (w.in_features, w.out_features)
    if isinstance(w, (Int8Blocks, Bf16Blocks)):
        int8 = isinstance(w, Int8Blocks)
        q, out = w.q, w.out_features
        scale = w.scale if int8 else None
        want = torch.int8 if int8 else torch.bfloat16
        bad_scale = int8 and (scale.dtype != torch.float32 or not scale.is_contiguous()
                              or scale.shape != (q.shape[0] * width,))
        if q.dtype != want or q.device.type != "cpu" or q.dim() != 3 or q.shape[2] != width \
                or q.shape[0] != -(-out // width) or not q.is_contiguous() or bad_scale:
            raise ValueError(f"{name}: {'int8' if int8 else 'bf16'} blocks are a contiguous "
                             f"{str(want).removeprefix('torch.')} [ceil({out} / {width}), in, {width}]"
                             f"{' with padded fp32 scales' if int8 else ''}, got {q.dtype} {tuple(q.shape)}"
                             f"{f' and {scale.dtype} {tuple(scale.shape)}' if int8 else ''}")
        return q.data_ptr(), None if scale is None else scale.data_ptr(), _W_I8 if int8 else _W_BF16, \
            (q.shape[1], out)
    _fp32(w)
    if w.dim() != 2 or not w.is_contiguous():
        raise ValueError(f"{name}: the weight must be a contiguous [in, out], got {tuple(w.shape)}")
    return w.data_ptr(), None, _W_F32, tuple(w.shape)


def gemv(x: torch.Tensor, w: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w (+ bias)`` for fp32 ``x`` [rows, in] and ``w`` [in, out] (BLAS's fp32 layout: the
    weight transposed) or int8 :class:`Int8Blocks`, or bf16 ``x`` and :class:`Bf16Blocks`: the fused
    decode layers' GEMV as its own call, each thread a band of output columns (of an fp32 ``[in,
    out]`` weight on 2+ threads a run of its inputs, the partial sums added at the end), every part of
    ``w`` read once for all rows of ``x`` (memory-bound at a few rows, so the kernel measurement
    offers the float weights for 1-8 rows: :data:`kvbatch.kernels.cpu.linear.NATIVE`; int8
    blocks, the int8 route ``gemv``, for any row count: a blocked GEMM past 8 rows, each block
    re-read from cache for every 8 rows). bf16 is summed in fp32 and rounded once, as torch's
    bf16 matmul rounds (on a CPU with AVX512-BF16 and an even ``in``, the exact products come
    from ``vdpbf16ps``). A :class:`ColumnsWeight` runs in the fused layers only."""
    w_ptr, scale_ptr, kind, (w_in, w_out) = _weight_ptrs(w, "gemv")
    if kind in (_W_COLS, _W_MKL):
        raise ValueError("gemv: a columns or MKL-packed weight is multiplied inside the fused decode layers only")
    bf16 = kind == _W_BF16
    if _bf16(x, *(() if bias is None else (bias,))) != bf16:
        raise ValueError(f"gemv: x and bias take the weight's dtype ({'bf16' if bf16 else 'fp32'}), got {x.dtype}"
                         f"{'' if bias is None else f' and {bias.dtype}'}")
    bad_bias = bias is not None and (bias.shape != (w_out,) or not bias.is_contiguous())
    if x.dim() != 2 or x.shape[1] != w_in or bad_bias:
        raise ValueError(f"gemv: x [rows, in] @ w [in, out] + bias [out], got {tuple(x.shape)}, "
                         f"{(w_in, w_out)}, {None if bias is None else tuple(bias.shape)}")
    x = x.float().contiguous()  # bf16 activations widened (exact); a contiguous fp32 x stays as it is
    bias = None if bias is None else bias.float()
    y = x.new_empty((x.shape[0], w_out))
    if x.shape[0]:
        _check(_lib().kvb_gemv(x.data_ptr(), x.shape[0], w_ptr, scale_ptr, kind, w_in, w_out,
                               None if bias is None else bias.data_ptr(), y.data_ptr(), torch.get_num_threads()),
               "gemv")
    return y.to(torch.bfloat16) if bf16 else y


def greedy_head(x: torch.Tensor, screen: Int8Blocks, error: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
    """The greedy LM head's logits (``kernels/cpu/greedy_head.py``) for fp32 ``x`` [rows, dim]: the
    int8 ``screen`` of ``head`` [vocab, dim] fp32 multiplies x, and each token whose upper bound
    (screen logit + ``error`` [vocab] x ||x||_2) reaches the row's best lower bound gets its fp32
    logit ``head[v] . x``; every other token -inf. One native call (the GEMV, the bounds, the
    selection and the kept tokens' dot products)."""
    _fp32(x, error, head)
    vocab, dim = head.shape
    if (not isinstance(screen, Int8Blocks) or screen.out_features != vocab or screen.q.shape[1] != dim
            or x.dim() != 2 or x.shape[1] != dim or error.shape != (vocab,)
            or not (head.is_contiguous() and error.is_contiguous())):
        raise ValueError(f"greedy_head: x [rows, {dim}], the head's int8 blocks, error [{vocab}] and a contiguous "
                         f"head [{vocab}, {dim}], got x {tuple(x.shape)}, error {tuple(error.shape)}")
    x = x.contiguous()
    y = x.new_empty((x.shape[0], vocab))
    if x.shape[0]:
        _check(_lib().kvb_greedy_head(x.data_ptr(), x.shape[0], screen.q.data_ptr(), screen.scale.data_ptr(), dim,
                                      vocab, error.data_ptr(), head.data_ptr(), y.data_ptr(),
                                      torch.get_num_threads()), "greedy_head")
    return y


def screen_select(s: torch.Tensor, y: torch.Tensor, sw: torch.Tensor, xn: torch.Tensor, error: torch.Tensor,
                  cr: torch.Tensor, wn: torch.Tensor, x: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
    """The batched greedy head's selection (``kernels/cpu/greedy_head.py``), in place on ``y``
    [rows, vocab] fp32 (the outlier columns' products on entry, the logits on return: fp32 ``head[v]
    . x[r]`` for each kept token, -inf for the rest). ``s`` [rows, vocab] fp32: the int8 rows'
    scaled products with the int8 head; ``xn``, ``cr`` [rows] float64: each row's norm and the
    bound's factor on ||w'||; ``sw``, ``error``, ``wn`` [vocab] fp32: each token's int8 scale, bound
    factor on ||x|| and int8 row norm; ``x`` [rows, dim] and ``head`` [vocab, dim] fp32."""
    rows, vocab = y.shape
    dim = head.shape[1]
    _fp32(s, y, sw, error, wn, x, head)
    ok = (s.shape == (rows, vocab) and head.shape == (vocab, dim) and x.shape == (rows, dim)
          and all(t.dtype == torch.float64 and t.shape == (rows,) for t in (xn, cr))
          and all(t.shape == (vocab,) for t in (sw, error, wn))
          and all(t.is_contiguous() for t in (s, y, sw, xn, error, cr, wn, x, head)))
    if not ok:
        raise ValueError(f"screen_select: s and y [rows, vocab], x [rows, {dim}], float64 [rows] row terms, fp32 "
                         f"[vocab] token terms, all contiguous; got s {tuple(s.shape)}, y {tuple(y.shape)}, x "
                         f"{tuple(x.shape)}, head {tuple(head.shape)}")
    if rows:
        _check(_lib().kvb_screen_select(s.data_ptr(), y.data_ptr(), rows, vocab, sw.data_ptr(), xn.data_ptr(),
                                        error.data_ptr(), cr.data_ptr(), wn.data_ptr(), x.data_ptr(),
                                        head.data_ptr(), dim, torch.get_num_threads()), "screen_select")
    return y


def attention_parts(context_lens: torch.Tensor, num_kv_heads: int, block_size: int, threads: int) -> int:
    """How many (sequence, part) pieces decode attention cuts these contexts into on ``threads``
    threads: one per sequence, unless that leaves fewer than 8 tasks (pieces x KV heads) per
    thread, when contexts longer than a part (at least 128 positions, whole blocks) are split and
    their parts' softmax sums combined (:func:`paged_decode_attention` and the fused layers alike)."""
    lens = _ints(context_lens, torch.int32)
    items = _lib().kvb_attention_parts(lens.numel(), lens.data_ptr(), num_kv_heads, block_size, threads)
    if items < 0:
        raise MemoryError("attention_parts: out of memory")
    return int(items)


# ---------------------------------------------------------------- the fused decode layers

class _Proj(ctypes.Structure):
    _fields_ = [("w", ctypes.c_void_p), ("scale", ctypes.c_void_p), ("kind", ctypes.c_int32),
                ("qtype", ctypes.c_int32), ("cols", ctypes.c_void_p)]


def _proj(w: Weight, ptrs: tuple[int, int | None, int, tuple[int, int]]) -> _Proj:
    qtype, cols = (w.qtype, w.cols) if isinstance(w, ColumnsWeight) else (0, None)
    return _Proj(*ptrs[:3], qtype, cols)


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p)] + \
               [(name, _Proj) for name in ("qkv", "o", "gate_up", "down")] + \
               [(name, ctypes.c_void_p) for name in ("qkv_bias", "k_plane", "v_plane")]


class _Step(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int64) for name in ("rows", "dim", "hq", "hkv", "d", "inter", "max_pos", "num_slots",
                                                  "num_blocks", "block_size", "table_stride")] + \
               [("eps", ctypes.c_float), ("scale", ctypes.c_float)] + \
               [(name, ctypes.c_void_p) for name in ("positions", "slots", "cos_sin", "block_tables", "context_lens")] + \
               [("bf16", ctypes.c_int32), ("sgemm_compute", ctypes.c_void_p)]


@dataclass(frozen=True)
class DenseLayer:
    """One dense Llama layer as :func:`decode_layers` takes it: norms [dim], projections in the
    ``[in, out]`` layout (the BLAS layout the engine keeps; fp32, or :class:`Int8Blocks`; for a
    bf16 model :class:`Bf16Blocks`; another library's :class:`ColumnsWeight`), or all four MKL's
    :class:`GemmWeight`, and the layer's cache [2, blocks, block_size, Hkv, D]. All fp32 (int8
    projections allowed), or all bf16."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: Weight
    qkv_bias: torch.Tensor | None
    o: Weight
    gate_up: Weight
    down: Weight
    kv_layer: torch.Tensor


@dataclass(frozen=True)
class FusedLayers:
    """The C structs of a model's layers over one KV cache, made once (the runner keeps its cache
    for its life); ``tensors`` holds what the pointers point into (a bf16 model's norms and bias
    as fp32 copies: the C code reads them as fp32)."""

    structs: ctypes.Array
    tensors: tuple[DenseLayer, ...]
    bf16: bool
    dim: int
    inter: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    max_rows: int | None = None  # the fewest rows a columns-kernel projection takes (None: no such projection)
    sgemm_compute: int | None = None  # MKL's cblas_sgemm_compute, for GemmWeight projections (else None)


def fuse_layers(layers: list[DenseLayer], sgemm_compute: int | None = None) -> FusedLayers:
    """Check every layer's shapes and layouts and lay them out for :func:`decode_layers`.
    ``sgemm_compute``: the address of MKL's ``cblas_sgemm_compute``, which layers of
    :class:`GemmWeight` projections (all four in every layer, fp32) are multiplied by."""
    if not layers:
        raise ValueError("fuse_layers needs at least one layer")
    first = layers[0]
    dim, inter = first.input_norm.shape[0], _weight_ptrs(first.down, "layer 0: down")[3][0]
    hkv, d = first.kv_layer.shape[-2:]
    hq = _weight_ptrs(first.o, "layer 0: o")[3][0] // d  # query heads: the o projection's inputs, D each
    qkv_out = (hq + 2 * hkv) * d
    bf16 = first.kv_layer.dtype == torch.bfloat16
    structs = (_Layer * len(layers))()
    held = []
    for i, lw in enumerate(layers):
        tensors = [lw.input_norm, lw.post_norm, lw.kv_layer]
        if lw.qkv_bias is not None:  # the struct keeps raw pointers: no temporary copies here
            tensors.append(lw.qkv_bias)
        if _bf16(*tensors) != bf16:
            raise ValueError(f"layer {i}: norms, bias and cache share layer 0's dtype, {first.kv_layer.dtype}")
        if not all(t.is_contiguous() for t in tensors):
            raise ValueError(f"layer {i}: fuse_layers takes contiguous tensors")
        projs = {name: _weight_ptrs(getattr(lw, name), f"layer {i}: {name}")
                 for name in ("qkv", "o", "gate_up", "down")}
        if bf16 and any(kind != _W_BF16 for _, _, kind, _ in projs.values()):
            raise ValueError(f"layer {i}: a bf16 model's fused layers take bf16 projections")
        if not bf16 and any(kind == _W_BF16 for _, _, kind, _ in projs.values()):
            raise ValueError(f"layer {i}: fp32 layers take fp32, int8 or columns-kernel projections, not bf16")
        gemm = sum(kind == _W_MKL for _, _, kind, _ in projs.values())
        if gemm and (gemm != len(projs) or not sgemm_compute):
            raise ValueError(f"layer {i}: MKL-packed projections run every projection of the layer through MKL "
                             f"(with cblas_sgemm_compute's address), got {gemm} of {len(projs)}"
                             f"{' and no address' if not sgemm_compute else ''}")
        if i > 0 and bool(gemm) != (structs[0].qkv.kind == _W_MKL):
            raise ValueError(f"layer {i}: MKL-packed projections in some layers and not in others")
        shapes = {"o": (projs["o"][3], (hq * d, dim)), "qkv": (projs["qkv"][3], (dim, qkv_out)),
                  "gate_up": (projs["gate_up"][3], (dim, 2 * inter)), "down": (projs["down"][3], (inter, dim)),
                  "kv_layer": (lw.kv_layer.shape, first.kv_layer.shape)}
        for name, (got, want) in shapes.items():
            if tuple(got) != tuple(want):
                raise ValueError(f"layer {i}: {name} is {tuple(got)}, expected {tuple(want)}")
        if lw.qkv_bias is not None and lw.qkv_bias.shape != (qkv_out,):
            raise ValueError(f"layer {i}: qkv bias {tuple(lw.qkv_bias.shape)} does not match {qkv_out} outputs")
        if bf16:  # the C code reads norms and bias as fp32: widened copies (exact), kept alive in `held`
            lw = replace(lw, input_norm=lw.input_norm.float(), post_norm=lw.post_norm.float(),
                         qkv_bias=None if lw.qkv_bias is None else lw.qkv_bias.float())
        held.append(lw)
        k_plane = lw.kv_layer.data_ptr()
        structs[i] = _Layer(lw.input_norm.data_ptr(), lw.post_norm.data_ptr(),
                            *(_proj(getattr(lw, name), projs[name]) for name in ("qkv", "o", "gate_up", "down")),
                            None if lw.qkv_bias is None else lw.qkv_bias.data_ptr(), k_plane,
                            k_plane + lw.kv_layer.stride(0) * lw.kv_layer.element_size())
    limits = [w.max_rows for lw in layers for w in (lw.qkv, lw.o, lw.gate_up, lw.down) if isinstance(w, ColumnsWeight)]
    gemm = structs[0].qkv.kind == _W_MKL
    return FusedLayers(structs, tuple(held), bf16, dim, inter, hq, hkv, d, min(limits) if limits else None,
                       sgemm_compute if gemm else None)


def decode_layers(fused: FusedLayers, num_layers: int, h: torch.Tensor, residual: torch.Tensor | None,
                  positions: torch.Tensor, slot_mapping: torch.Tensor, cos_sin: torch.Tensor,
                  block_tables: torch.Tensor, context_lens: torch.Tensor, eps: float,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``num_layers`` layers of a decode step of ``h`` [rows, dim] (one token per
    sequence; ``residual`` None at the first layer) in one call: returns ``(h, residual)`` after
    them, as the layer loop of ``LlamaModel.forward`` leaves them. Writes each token's K/V. ``h``
    and ``residual`` in the layers' dtype (a bf16 model's are widened for the call and narrowed
    after it: exact, the C code keeps them bf16 values); ``cos_sin`` fp32."""
    _fp32(cos_sin)
    if _bf16(h, *(() if residual is None else (residual,))) != fused.bf16:
        raise ValueError(f"decode_layers: h and residual take the layers' dtype "
                         f"({'bf16' if fused.bf16 else 'fp32'}), got {h.dtype}")
    rows, dim = h.shape
    if fused.max_rows is not None and rows > fused.max_rows:
        raise ValueError(f"decode_layers: these layers' columns-kernel projections take up to {fused.max_rows} rows, "
                         f"got {rows}")
    if dim != fused.dim or not 0 < num_layers <= len(fused.tensors):
        raise ValueError(f"decode_layers: rows of {fused.dim} through 1-{len(fused.tensors)} layers, "
                         f"got {tuple(h.shape)} through {num_layers}")
    hq, hkv, d = fused.num_q_heads, fused.num_kv_heads, fused.head_dim
    h = h.float() if fused.bf16 else h.clone() if not h.is_contiguous() else h
    resid = torch.empty_like(h) if residual is None else residual.float().contiguous()
    positions, slots = _ints(positions, torch.int64), _ints(slot_mapping, torch.int64)
    tables, lens = _ints(block_tables, torch.int32), _ints(context_lens, torch.int32)
    if positions.numel() != rows or slots.numel() != rows or lens.numel() != rows or tables.shape[0] != rows:
        raise ValueError(f"decode_layers: {rows} tokens need {rows} positions, slots, block tables and context lengths")
    cos_sin = cos_sin.contiguous()
    kv_layer = fused.tensors[0].kv_layer
    step = _Step(rows, dim, hq, hkv, d, fused.inter, cos_sin.shape[0], kv_layer[0].numel() // (hkv * d),
                 kv_layer.shape[1], kv_layer.shape[2], tables.shape[1], eps, scale, positions.data_ptr(),
                 slots.data_ptr(), cos_sin.data_ptr(), tables.data_ptr(), lens.data_ptr(), int(fused.bf16),
                 fused.sgemm_compute)
    qkv_out = (hq + 2 * hkv) * d
    work = torch.empty(rows * (dim + qkv_out + hq * d + 3 * fused.inter), dtype=torch.float32)
    rc = _lib().kvb_decode_layers(fused.structs, num_layers, ctypes.byref(step), h.data_ptr(), resid.data_ptr(),
                                  int(residual is not None), work.data_ptr(), torch.get_num_threads())
    _check(rc, "decode_layers")
    return (h.to(torch.bfloat16), resid.to(torch.bfloat16)) if fused.bf16 else (h, resid)
