"""The CPU kernels of ``cpu_native.c``: a decode step's small operations, one call each.

:mod:`kvbatch.kernels.dispatch` runs these instead of the PyTorch reference for fp32 CPU tensors,
and the small ops and decode attention for bf16 ones too, when the library builds on this machine
(:mod:`kvbatch.kernels.native_build`; ``KVBATCH_KERNELS`` chooses, see dispatch). Each function
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
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from kvbatch.kernels import native_build

SOURCE = Path(__file__).with_name("cpu_native.c")
_ABI = 5
# Rows the native GEMVs (fp32 and int8) and the fused decode layers are offered for: decode and
# small batches, where a multiply is bound by streaming the weights; more rows are compute-bound.
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
                                         _F32, _P, _INT]
    lib.kvb_decode_layers.restype = _INT
    lib.kvb_decode_layers.argtypes = [_P, _I64, _P, _P, _P, _INT, _P, _INT]
    lib.kvb_attention_parts.restype = _I64
    lib.kvb_attention_parts.argtypes = [_I64, _P, _I64, _I64, _INT]
    lib.kvb_gemv.restype = _INT
    lib.kvb_int8_block.restype = _INT
    lib.kvb_int8_block.argtypes = []
    lib.kvb_gemv.argtypes = [_P, _I64, _P, _P, _I64, _I64, _P, _P, _INT]
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
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """:func:`kvbatch.kernels.reference.paged_decode_attention`, reading K and V where they lie:
    ``q`` [B, Hq, D] (rows may be strided), caches [num_blocks, block_size, Hkv, D], all fp32, or
    all bf16 (computed in fp32, K and V widened as they are read; the result rounded to bf16)."""
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
    out = q.new_empty((B, Hq, D))
    rc = _lib().kvb_decode_attention(q.data_ptr(), B, q.stride(0), Hq, Hkv, D, k_cache.data_ptr(),
                                     v_cache.data_ptr(), int(bf16), num_blocks, block_size, tables.data_ptr(),
                                     tables.shape[1], lens.data_ptr(), scale, out.data_ptr(), torch.get_num_threads())
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


def int8_block() -> int:
    """Output columns per block of :class:`Int8Blocks` (the native library's I8_BLOCK)."""
    return int(_lib().kvb_int8_block())


def int8_blocks(q: torch.Tensor, scale: torch.Tensor) -> Int8Blocks:
    """The blocked layout of an int8 weight ``q`` [out, in] with scales [out]."""
    if q.dtype != torch.int8 or q.dim() != 2 or scale.shape != (q.shape[0],):
        raise ValueError(f"int8_blocks takes an int8 [out, in] and its [out] scales, got {q.dtype} "
                         f"{tuple(q.shape)} and {tuple(scale.shape)}")
    out, width = q.shape[0], int8_block()
    pad = -out % width
    q = torch.cat([q, q.new_zeros(pad, q.shape[1])]) if pad else q
    blocks = q.view(-1, width, q.shape[1]).transpose(1, 2).contiguous()
    scale = torch.cat([scale.float(), scale.new_zeros(pad, dtype=torch.float32)]) if pad else scale.float()
    return Int8Blocks(blocks, scale.contiguous(), out)


Weight = torch.Tensor | Int8Blocks  # fp32 [in, out], or int8 blocks with their scales


def _weight_ptrs(w: Weight, name: str) -> tuple[int, int | None, tuple[int, int]]:
    """(data pointer, scale pointer or None, (in, out)) of a weight the native GEMV takes, checked."""
    if isinstance(w, Int8Blocks):
        q, scale, out = w
        if q.dtype != torch.int8 or scale.dtype != torch.float32 or q.device.type != "cpu" or q.dim() != 3 \
                or q.shape[2] != int8_block() or q.shape[0] != -(-out // q.shape[2]) \
                or scale.shape != (q.shape[0] * q.shape[2],) or not (q.is_contiguous() and scale.is_contiguous()):
            raise ValueError(f"{name}: int8 blocks are a contiguous int8 [ceil({out} / {int8_block()}), in, "
                             f"{int8_block()}] with padded fp32 scales, got {q.dtype} {tuple(q.shape)} and "
                             f"{scale.dtype} {tuple(scale.shape)}")
        return q.data_ptr(), scale.data_ptr(), (q.shape[1], out)
    _fp32(w)
    if w.dim() != 2 or not w.is_contiguous():
        raise ValueError(f"{name}: the weight must be a contiguous [in, out], got {tuple(w.shape)}")
    return w.data_ptr(), None, tuple(w.shape)


def gemv(x: torch.Tensor, w: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w (+ bias)`` for fp32 ``x`` [rows, in] and ``w`` [in, out] (BLAS's layout: the weight
    transposed), or int8 :class:`Int8Blocks`: the fused decode layers' GEMV as its own call, each
    thread a band of output columns, every 4 rows of ``w`` read once for all rows of ``x``
    (memory-bound at a few rows, so the kernel measurement offers it for 1-8 rows:
    :data:`kvbatch.engine.models.linear.NATIVE`, and the int8 route ``gemv``)."""
    _fp32(x, *(() if bias is None else (bias,)))
    w_ptr, scale_ptr, (w_in, w_out) = _weight_ptrs(w, "gemv")
    bad_bias = bias is not None and (bias.shape != (w_out,) or not bias.is_contiguous())
    if x.dim() != 2 or x.shape[1] != w_in or bad_bias:
        raise ValueError(f"gemv: x [rows, in] @ w [in, out] + bias [out], got {tuple(x.shape)}, "
                         f"{(w_in, w_out)}, {None if bias is None else tuple(bias.shape)}")
    x = x.contiguous()
    y = x.new_empty((x.shape[0], w_out))
    if x.shape[0]:
        _check(_lib().kvb_gemv(x.data_ptr(), x.shape[0], w_ptr, scale_ptr, w_in, w_out,
                               None if bias is None else bias.data_ptr(), y.data_ptr(), torch.get_num_threads()),
               "gemv")
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
    _fields_ = [("w", ctypes.c_void_p), ("scale", ctypes.c_void_p)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p)] + \
               [(name, _Proj) for name in ("qkv", "o", "gate_up", "down")] + \
               [(name, ctypes.c_void_p) for name in ("qkv_bias", "k_plane", "v_plane")]


class _Step(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int64) for name in ("rows", "dim", "hq", "hkv", "d", "inter", "max_pos", "num_slots",
                                                  "num_blocks", "block_size", "table_stride")] + \
               [("eps", ctypes.c_float), ("scale", ctypes.c_float)] + \
               [(name, ctypes.c_void_p) for name in ("positions", "slots", "cos_sin", "block_tables", "context_lens")]


@dataclass(frozen=True)
class DenseLayer:
    """One dense Llama layer as :func:`decode_layers` takes it: norms [dim], projections in the
    ``[in, out]`` layout (the BLAS layout the engine keeps; fp32, or int8 with per-column scales),
    and the layer's cache [2, blocks, block_size, Hkv, D]."""

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
    for its life); ``tensors`` holds what the pointers point into."""

    structs: ctypes.Array
    tensors: tuple[DenseLayer, ...]
    dim: int
    inter: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int


def fuse_layers(layers: list[DenseLayer]) -> FusedLayers:
    """Check every layer's shapes and layouts and lay them out for :func:`decode_layers`."""
    if not layers:
        raise ValueError("fuse_layers needs at least one layer")
    first = layers[0]
    dim, inter = first.input_norm.shape[0], _weight_ptrs(first.down, "layer 0: down")[2][0]
    hkv, d = first.kv_layer.shape[-2:]
    hq = _weight_ptrs(first.o, "layer 0: o")[2][0] // d  # query heads: the o projection's inputs, D each
    qkv_out = (hq + 2 * hkv) * d
    structs = (_Layer * len(layers))()
    for i, lw in enumerate(layers):
        tensors = [lw.input_norm, lw.post_norm, lw.kv_layer]
        if lw.qkv_bias is not None:  # the struct keeps raw pointers: no temporary copies here
            tensors.append(lw.qkv_bias)
        _fp32(*tensors)
        if not all(t.is_contiguous() for t in tensors):
            raise ValueError(f"layer {i}: fuse_layers takes contiguous tensors")
        projs = {name: _weight_ptrs(getattr(lw, name), f"layer {i}: {name}")
                 for name in ("qkv", "o", "gate_up", "down")}
        shapes = {"o": (projs["o"][2], (hq * d, dim)), "qkv": (projs["qkv"][2], (dim, qkv_out)),
                  "gate_up": (projs["gate_up"][2], (dim, 2 * inter)), "down": (projs["down"][2], (inter, dim)),
                  "kv_layer": (lw.kv_layer.shape, first.kv_layer.shape)}
        for name, (got, want) in shapes.items():
            if tuple(got) != tuple(want):
                raise ValueError(f"layer {i}: {name} is {tuple(got)}, expected {tuple(want)}")
        if lw.qkv_bias is not None and lw.qkv_bias.shape != (qkv_out,):
            raise ValueError(f"layer {i}: qkv bias {tuple(lw.qkv_bias.shape)} does not match {qkv_out} outputs")
        k_plane = lw.kv_layer.data_ptr()
        structs[i] = _Layer(lw.input_norm.data_ptr(), lw.post_norm.data_ptr(),
                            *(_Proj(*projs[name][:2]) for name in ("qkv", "o", "gate_up", "down")),
                            None if lw.qkv_bias is None else lw.qkv_bias.data_ptr(), k_plane,
                            k_plane + lw.kv_layer.stride(0) * lw.kv_layer.element_size())
    return FusedLayers(structs, tuple(layers), dim, inter, hq, hkv, d)


def decode_layers(fused: FusedLayers, num_layers: int, h: torch.Tensor, residual: torch.Tensor | None,
                  positions: torch.Tensor, slot_mapping: torch.Tensor, cos_sin: torch.Tensor,
                  block_tables: torch.Tensor, context_lens: torch.Tensor, eps: float,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``num_layers`` layers of a decode step of ``h`` [rows, dim] (one token per
    sequence; ``residual`` None at the first layer) in one call: returns ``(h, residual)`` after
    them, as the layer loop of ``LlamaModel.forward`` leaves them. Writes each token's K/V."""
    _fp32(h, cos_sin)
    rows, dim = h.shape
    if dim != fused.dim or not 0 < num_layers <= len(fused.tensors):
        raise ValueError(f"decode_layers: rows of {fused.dim} through 1-{len(fused.tensors)} layers, "
                         f"got {tuple(h.shape)} through {num_layers}")
    hq, hkv, d = fused.num_q_heads, fused.num_kv_heads, fused.head_dim
    h = h.clone() if not h.is_contiguous() else h
    resid = torch.empty_like(h) if residual is None else residual.contiguous()
    positions, slots = _ints(positions, torch.int64), _ints(slot_mapping, torch.int64)
    tables, lens = _ints(block_tables, torch.int32), _ints(context_lens, torch.int32)
    if positions.numel() != rows or slots.numel() != rows or lens.numel() != rows or tables.shape[0] != rows:
        raise ValueError(f"decode_layers: {rows} tokens need {rows} positions, slots, block tables and context lengths")
    cos_sin = cos_sin.contiguous()
    kv_layer = fused.tensors[0].kv_layer
    step = _Step(rows, dim, hq, hkv, d, fused.inter, cos_sin.shape[0], kv_layer[0].numel() // (hkv * d),
                 kv_layer.shape[1], kv_layer.shape[2], tables.shape[1], eps, scale, positions.data_ptr(),
                 slots.data_ptr(), cos_sin.data_ptr(), tables.data_ptr(), lens.data_ptr())
    qkv_out = (hq + 2 * hkv) * d
    work = torch.empty(rows * (dim + qkv_out + hq * d + 3 * fused.inter), dtype=torch.float32)
    rc = _lib().kvb_decode_layers(fused.structs, num_layers, ctypes.byref(step), h.data_ptr(), resid.data_ptr(),
                                  int(residual is not None), work.data_ptr(), torch.get_num_threads())
    _check(rc, "decode_layers")
    return h, resid
