"""Dense projection weights in the layout the CPU multiplies fastest, and the one multiply.

Measured on this kind of machine (2 Zen 5 cores, torch 2.13 with MKL and oneDNN 3.12; the 120
projections of SmolLM2's 30 layers, 425 MB in fp32): oneDNN's inner product over weights
reordered once at load time streams them at ~30 GB/s whether a pass carries 1 or 16 rows, where
MKL's sgemm reaches ~20 GB/s at one row and half of that at 2-8 rows, repacking the weight on
every call. fp32: 1 row 14 ms against 22, 8 rows 16 against 36, 128 rows 67 against 159;
bf16: 1 row 6 ms against 15. A pass over a few rows costing about what one row costs is what
makes speculative verification pay, and it speeds up plain decode and prefill as well.

The packed weights are opaque oneDNN tensors: they can be multiplied by and nothing else, so
everything that needs to read weights (the embedding, MoE experts, MLA's absorbed heads) keeps
plain tensors. Where oneDNN is missing, or ``KVBATCH_LINEAR=blas``, weights stay plain and the
multiply is BLAS in the layout measured fastest for it.

On a CUDA device neither CPU layout is used: weights stay ``[out, in]`` on the device and
``F.linear`` runs cuBLAS (``CUBLAS``); ``KVBATCH_LINEAR`` applies to the CPU only.

Which CPU layout wins depends on the machine (on an Intel Xeon with AMX, BLAS beat oneDNN at one
row), so :func:`kvbatch.engine.models.factory.build_model` measures the candidates per row-count
bucket at load time (:mod:`kvbatch.kernels.cpu.kernel_choice`) and hands the result in through
:func:`use_linear_format`. When the buckets disagree, ``prepare`` keeps one layout per kernel
chosen (a :class:`MixedWeight`: more memory, the fastest multiply at every row count). ``INT8``
holds weight-only int8 weights (:mod:`kvbatch.kernels.cpu.quant`; its ``gemv`` route is the
native int8 GEMV, which the fused decode step runs too); ``NATIVE`` is the fused
decode layers' own GEMV (:func:`kvbatch.kernels.cpu.native.gemv`) over BLAS's fp32 layout, a
candidate for 1-8 rows (a bucket it wins runs the fused decode step), in bf16 over bf16 blocks
of its own (:class:`~kvbatch.kernels.cpu.native.Bf16Blocks`); ``GGUF`` multiplies by a GGUF
file's own Q4_0/Q4_1/Q8_0 blocks in the buckets where that measured faster
(:mod:`kvbatch.kernels.cpu.gguf_kernels`), by the dequantized fp32 weight elsewhere. ``MKL`` is
MKL's own packed-weight sgemm (:mod:`kvbatch.kernels.cpu.mkl_packed`, fp32), a candidate at
every row count where torch's library exports it.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.nn.functional as F

from kvbatch.kernels import dispatch
from kvbatch.kernels.cpu import mkl_packed
from kvbatch.kernels.cpu import native as native_kernels
from kvbatch.kernels.cpu.gguf_kernels import GGUFWeight, gguf_linear, lookup_blocks
from kvbatch.kernels.cpu.gguf_kernels import fused_weight as gguf_fused_weight  # beside LinearFormat.fused_weight
from kvbatch.kernels.cpu.huge_pages import HugePageArena
from kvbatch.kernels.cpu.quant import GEMV, Int8Weight, int8_linear, quantize_int8

ONEDNN = "onednn"
BLAS = "blas"
CUBLAS = "cublas"  # CUDA: plain [out, in] weights, F.linear (cuBLAS GEMMs)
MIXED = "mixed"  # per row-count bucket, one of the CPU kernels above (see ``bucket_kinds``)
INT8 = "int8"  # weight-only int8, per-output-channel scales; ``bucket_kinds`` name its routes
# GGUF: per bucket GGUF_NATIVE (the file's blocks, our C kernel) or a CPU kind over the fp32 weight
GGUF = "gguf"
GGUF_NATIVE = "gguf-native"
# The native decode GEMV (kvbatch.kernels.cpu.native.gemv), in fp32 over BLAS's [in, out] layout, in
# bf16 over blocks of its own (native_kernels.Bf16Blocks): what the fused decode layers multiply with,
# so the kernel measurement times it against the others for up to NATIVE_MAX_ROWS rows (a multiply
# of more rows runs BLAS on the same fp32 layout, PyTorch over the bf16 blocks).
NATIVE = "native"
NATIVE_MAX_ROWS = native_kernels.GEMV_MAX_ROWS
# MKL's packed sgemm over weights packed once at load (mkl_packed): fp32 only, opaque like oneDNN's.
MKL = "mkl"
CPU_KINDS = (ONEDNN, BLAS, NATIVE, MKL)
_FP32_ONLY = (MKL,)
_PLAIN_KINDS = (BLAS, NATIVE)  # the kinds that multiply the plain fp32 [in, out] layout
_BUCKETED = (MIXED, INT8, GGUF)
# Row-count buckets the kernels are measured and chosen for: upper bounds (inclusive), the last
# one open. 1: plain decode; 2-8: small batches, speculative verification; 9-64: batched decode;
# 65+: prefill chunks.
BUCKET_BOUNDS = (1, 8, 64)
_CPU = torch.device("cpu")
# oneDNN chooses the packed layout for an expected row count; 16 measured as fast as 1 at one
# row and faster at 8-128 rows.
_PACK_ROWS_HINT = 16


@functools.cache
def onednn_available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether this torch build, on this CPU, has the packed-weight inner product for ``dtype``
    (a private op: probe it). bf16 packing needs AVX512-BW/VL/DQ or AVX-NE-CONVERT: an AVX2-only
    CPU (seen on an AMD EPYC with avx2 and no avx512) packs fp32 but refuses bf16."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        w = torch.ops.mkldnn._reorder_linear_weight(torch.eye(2, dtype=dtype), 2)
        y = torch.ops.mkldnn._linear_pointwise(torch.ones(2, 2, dtype=dtype), w, None, "none", [], "")
    except (AttributeError, RuntimeError, NotImplementedError):
        return False
    return bool(torch.equal(y, torch.ones(2, 2, dtype=dtype)))


@dataclass(frozen=True)
class LinearFormat:
    """How one model holds its ``[out, in]`` projection weights (``prepare``) and multiplies
    rows by them (``__call__``): ``onednn`` packed, or ``blas`` plain — fp32 as ``[in, out]``
    with ``x @ w`` (batch-1 ~1.3x faster than F.linear), others as ``[out, in]``."""

    kind: str
    dtype: torch.dtype
    device: torch.device = _CPU
    # MIXED / INT8: the kernel (or int8 route) per row-count bucket of BUCKET_BOUNDS (one more
    # entry than bounds); empty for a single kernel.
    bucket_kinds: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        if self.kind in _BUCKETED and len(self.bucket_kinds) != len(BUCKET_BOUNDS) + 1:
            raise ValueError(f"a {self.kind} linear format needs {len(BUCKET_BOUNDS) + 1} bucket kinds, "
                             f"got {self.bucket_kinds!r}")
        if self.kind == MIXED and not set(self.bucket_kinds) <= set(CPU_KINDS):
            raise ValueError(f"mixed bucket kinds must be among {CPU_KINDS}, got {self.bucket_kinds!r}")
        only_fp32 = next((k for k in _FP32_ONLY if k in (self.kind, *self.bucket_kinds)), None)
        if only_fp32 and (self.dtype != torch.float32 or self.device.type != "cpu"):
            raise ValueError(f"the {only_fp32} kernel multiplies fp32 on the CPU, not {self.dtype} on {self.device}")
        if NATIVE in (self.kind, *self.bucket_kinds) and (self.dtype not in (torch.float32, torch.bfloat16)
                                                           or self.device.type != "cpu"):
            raise ValueError(f"the {NATIVE} kernel multiplies fp32 or bf16 on the CPU, not {self.dtype} on {self.device}")
        if self.kind == GGUF and (not set(self.bucket_kinds) <= {GGUF_NATIVE, *CPU_KINDS}
                                  or self.dtype != torch.float32):
            raise ValueError(f"gguf bucket kinds must be among {(GGUF_NATIVE, *CPU_KINDS)} over fp32, "
                             f"got {self.bucket_kinds!r} {self.dtype}")

    def kind_for(self, rows: int) -> str:
        """The kernel a multiply of ``rows`` rows runs."""
        if not self.bucket_kinds:
            return self.kind
        return self.bucket_kinds[bucket_index(rows)]

    def prepare(self, w: torch.Tensor, arena: HugePageArena | None = None) -> Any:
        """``w`` [out, in] in ``self.dtype`` -> what ``__call__`` takes (on ``self.device``): a tensor,
        a :class:`MixedWeight`, an int8 weight (:class:`~kvbatch.kernels.cpu.quant.Int8Weight`) or a
        :class:`~kvbatch.kernels.cpu.gguf_kernels.GGUFWeight`. ``arena``: the huge pages its CPU
        memory goes to (kernels/cpu/huge_pages.py; MKL's packed buffers are packed there, the rest
        copied in by :func:`place_in_huge_pages`); None leaves it where torch and oneDNN put it."""
        made = self._prepare(w, arena)
        return made if arena is None else place_in_huge_pages(arena, made)

    def _prepare(self, w: torch.Tensor, arena: HugePageArena | None) -> Any:
        """:meth:`prepare` before its tensors are copied into ``arena`` (MKL packs into it directly:
        its buffers cannot move)."""
        if self.kind == INT8:
            return quantize_int8(w.to(device=self.device), tuple(dict.fromkeys(self.bucket_kinds)))
        if self.kind == GGUF:
            return self._prepare_gguf(w.to(device=self.device, dtype=self.dtype).contiguous(), arena)
        w = w.to(device=self.device, dtype=self.dtype).contiguous()
        if self.kind == MIXED:
            layouts: dict[str, Any] = {}
            plain = self._plain_kinds()
            for k in dict.fromkeys(self.bucket_kinds):  # fp32 BLAS and NATIVE share one plain layout
                shared = next((layouts[o] for o in plain if k in plain and o in layouts), None)
                layouts[k] = shared if shared is not None else _SINGLE[k, self.dtype]._prepare(w, arena)
            return MixedWeight(layouts)
        if self.kind == CUBLAS:
            return w
        if self.kind == ONEDNN:
            return torch.ops.mkldnn._reorder_linear_weight(w, _PACK_ROWS_HINT)
        if self.kind == MKL:
            return mkl_packed.pack(w, arena)
        if self.kind == NATIVE and self.dtype == torch.bfloat16:
            return native_kernels.bf16_blocks(w)
        return w.t().contiguous() if self.dtype == torch.float32 else w

    def __call__(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None,
                 batch_invariant: bool = False) -> torch.Tensor:
        """``x`` [rows, in] -> [rows, out]. ``batch_invariant``: pad ``x`` so each row's bits do
        not depend on how many rows came with it (see ``invariant_rows``)."""
        rows = x.shape[0]
        if batch_invariant:
            padded = self.invariant_rows(rows)
            if padded != rows:
                x = torch.cat([x, x.new_zeros(padded - rows, x.shape[1])])
                return self._multiply(x, w, b)[:rows]
        return self._multiply(x, w, b)

    def _multiply(self, x: torch.Tensor, w: Any, b: torch.Tensor | None) -> torch.Tensor:
        if self.kind == MIXED:
            kind = self.kind_for(x.shape[0])
            return _SINGLE[kind, self.dtype]._multiply(x, w.layouts[kind], b)
        if self.kind == INT8:
            return int8_linear(x, w, b, self.kind_for(x.shape[0]))
        if self.kind == GGUF:
            kind = self.kind_for(x.shape[0])
            if kind == GGUF_NATIVE and w.blocks is not None:
                return gguf_linear(x, w.blocks, b)
            kind = kind if kind in w.layouts else next(iter(w.layouts))
            return _SINGLE[kind, self.dtype]._multiply(x, w.layouts[kind], b)
        if self.kind == ONEDNN:
            return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
        if self.kind == MKL:
            return mkl_packed.linear(x, w, b)
        if self.kind == NATIVE and x.shape[0] <= NATIVE_MAX_ROWS and dispatch.native(x, bf16=True):
            return native_kernels.gemv(x, w, b)  # (KVBATCH_KERNELS=reference: BLAS on the same layout, below)
        if self.kind == NATIVE and isinstance(w, native_kernels.Bf16Blocks):
            return native_kernels.blocks_linear(x, w, b)
        if self.kind == CUBLAS or self.dtype != torch.float32:
            return F.linear(x, w, b)
        return torch.addmm(b, x, w) if b is not None else x @ w

    def fused_rows(self, rows: int) -> bool:
        """Whether a multiply of ``rows`` rows runs a kernel whose weight layout the fused native
        decode layers take (what :meth:`fused_weight` hands out): BLAS or the native GEMV over the
        plain fp32 ``[in, out]`` layout, the native GEMV over its bf16 blocks, the int8 ``gemv``
        route over its blocks, or the native GGUF kernel over the file's blocks."""
        if self.device.type != "cpu":
            return False
        if self.kind in (INT8, GGUF):
            native = GEMV if self.kind == INT8 else GGUF_NATIVE
            return self.dtype == torch.float32 and rows <= NATIVE_MAX_ROWS and self.kind_for(rows) == native
        return self.fused_gemm(rows) or (self.kind in (*_PLAIN_KINDS, MIXED) and self.kind_for(rows) in self._plain_kinds())

    def fused_gemm(self, rows: int) -> bool:
        """Whether the fused decode layers multiply a step of ``rows`` rows through MKL's packed
        GEMM (their batched schedule, any row count: :class:`~kvbatch.kernels.cpu.native.GemmWeight`),
        the kernel this format runs for that many rows."""
        return (self.device.type == "cpu" and self.kind in (MKL, MIXED) and self.kind_for(rows) == MKL
                and mkl_packed.sgemm_compute_address() is not None)

    def _plain_kinds(self) -> tuple[str, ...]:
        """The kinds whose layout the fused decode layers take in this dtype: fp32 BLAS and the
        native GEMV share the plain ``[in, out]``; in bf16 only the native GEMV's blocks."""
        return _PLAIN_KINDS if self.dtype == torch.float32 else (NATIVE,) if self.dtype == torch.bfloat16 else ()

    def fused_weight(self, w: Any, rows: int = 1) -> native_kernels.Weight | None:
        """The layout of a weight this format prepared that the fused decode layers multiply a step
        of ``rows`` rows by (see :meth:`fused_rows`): MKL's packed bytes where that step runs MKL
        (:meth:`fused_gemm`), else the plain fp32 ``[in, out]`` tensor, the native GEMV's bf16 blocks,
        an int8 weight's blocks, or a GGUF weight's blocks (for the GGUF kernel's own entry); for a
        GGUF weight the file held in another type, its plain fp32 layout where it keeps one, else
        None (that model's decode keeps the per-op path)."""
        if self.fused_gemm(rows):
            return mkl_packed.fused_weight(w.layouts[MKL] if self.kind == MIXED else w)
        if self.kind == INT8 and w.blocks is not None:
            return w.blocks
        if self.kind == GGUF:
            if w.blocks is not None:
                return gguf_fused_weight(w.blocks)
            return next((w.layouts[k] for k in _PLAIN_KINDS if k in w.layouts), None)
        if self.kind == MIXED:
            return next(w.layouts[k] for k in self._plain_kinds() if k in w.layouts)
        if self.kind not in self._plain_kinds():
            raise ValueError(f"a {self.kind} {self.dtype} format holds no layout the fused decode layers take")
        return w

    def invariant_rows(self, rows: int) -> int:
        """The row count to multiply ``rows`` rows as so each row's result equals its result in
        any larger batch: ``rows`` padded up to where the kernel's bits stop depending on the
        batch (``_INVARIANT_FROM``, measured)."""
        if self.kind in (*_BUCKETED, NATIVE):  # each bucket's kernel rounds differently (NATIVE: up to 8 rows)
            raise ValueError(f"a {self.kind} linear format is not batch-invariant; use one kernel")
        if self.kind == MKL:  # its per-row bits have not been measured against the batch size
            raise ValueError(f"the {MKL} kernel has no measured batch-invariant padding; use {ONEDNN} or {BLAS}")
        if self.kind == ONEDNN:
            return max(rows, _INVARIANT_FROM[ONEDNN, self.dtype == torch.float32]) if rows else 0
        return blas_invariant_rows(rows, self.dtype)

    def _prepare_gguf(self, w: torch.Tensor, arena: HugePageArena | None) -> GGUFWeight:
        """The file's blocks for ``w`` (found by content, see gguf_kernels) plus a float layout for
        each CPU kind a bucket uses; a weight with no blocks (the file held it as F32/F16, or a
        type with no native kernel) gets a float layout for every bucket: the first CPU kind the
        buckets name, else BLAS."""
        blocks = lookup_blocks(w)
        kinds = [k for k in dict.fromkeys(self.bucket_kinds) if k != GGUF_NATIVE]
        if blocks is None and not kinds:
            kinds = [BLAS]
        return GGUFWeight(blocks, {k: _SINGLE[k, self.dtype]._prepare(w, arena) for k in kinds})


@dataclass(frozen=True)
class MixedWeight:
    """One projection held in each layout a :data:`MIXED` format's buckets use."""

    layouts: dict[str, Any]  # kind -> a tensor, or an opaque packed weight (mkl_packed.PackedWeight)


def place_in_huge_pages(arena: HugePageArena, w: Any) -> Any:
    """``w`` as :meth:`LinearFormat.prepare` made it, the CPU tensors a multiply streams copied into
    ``arena`` (kernels/cpu/huge_pages.py): a plain layout, bf16 or int8 blocks, an int8 weight's values,
    a GGUF weight's blocks, and a :class:`MixedWeight`'s or GGUF weight's float layouts, each shared
    tensor once. Packed weights stay where they are: oneDNN's, whose memory its own code
    allocates, and MKL's, which cannot move (``prepare`` packs them in the arena)."""
    if isinstance(w, torch.Tensor):  # oneDNN's packed weights are tensors of their own layout: kept
        return arena.place(w) if w.device.type == "cpu" and w.layout == torch.strided else w
    if isinstance(w, (native_kernels.Bf16Blocks, native_kernels.Int8Blocks)):
        return w._replace(q=arena.place(w.q))
    if isinstance(w, Int8Weight):
        return replace(w, q=None if w.q is None else arena.place(w.q),
                       blocks=None if w.blocks is None else place_in_huge_pages(arena, w.blocks))
    if isinstance(w, (MixedWeight, GGUFWeight)):
        placed: dict[int, Any] = {}  # BLAS and the native GEMV share one plain tensor: one copy
        layouts = {}
        for k, layout in w.layouts.items():
            if id(layout) not in placed:
                placed[id(layout)] = place_in_huge_pages(arena, layout)
            layouts[k] = placed[id(layout)]
        if isinstance(w, MixedWeight):
            return replace(w, layouts=layouts)
        blocks = None if w.blocks is None else replace(w.blocks, data=arena.place(w.blocks.data))
        return replace(w, blocks=blocks, layouts=layouts)
    return w


class _SingleFormats(dict):
    """``(kind, dtype)`` -> a single-kernel :class:`LinearFormat`, made once (the mixed multiply
    delegates to these on every call)."""

    def __missing__(self, key: tuple[str, torch.dtype]) -> LinearFormat:
        self[key] = LinearFormat(*key)
        return self[key]


_SINGLE = _SingleFormats()


def bucket_index(rows: int) -> int:
    """Which of the row-count buckets (``BUCKET_BOUNDS``) ``rows`` falls in."""
    for i, bound in enumerate(BUCKET_BOUNDS):
        if rows <= bound:
            return i
    return len(BUCKET_BOUNDS)


# From how many rows on every row of a multiply gets the same bits whatever the batch size,
# (kernel, fp32?) -> rows; smaller batches are padded up to it. Measured (rows 1-159 against 160,
# SmolLM2's shapes and small ones): MKL fp32 on an AMD EPYC at 4, 8 and from 12 rows, on an Intel
# Xeon with AMX from 17 (the down projection, 1536 inputs; 2 rows for the others); oneDNN fp32
# from 2 on both; bf16, MKL and oneDNN, on that Xeon from 37 (1 on the EPYC). The floors leave a
# margin over the largest seen; they cost speed at small batches (deterministic mode only).
_INVARIANT_FROM = {(BLAS, True): 24, (BLAS, False): 48, (ONEDNN, True): 2, (ONEDNN, False): 48}


def blas_invariant_rows(rows: int, dtype: torch.dtype = torch.float32) -> int:
    """``rows`` padded up to where MKL's per-row results stop depending on the batch size
    (``_INVARIANT_FROM``); 0 stays 0."""
    return max(rows, _INVARIANT_FROM[BLAS, dtype == torch.float32]) if rows else 0


# The format build_model measured (or was told to use) for the model being built right now; a
# context variable so the model classes keep their signature and concurrent loads stay apart.
_PLANNED: ContextVar[LinearFormat | None] = ContextVar("kvbatch_linear_format", default=None)


@contextlib.contextmanager
def use_linear_format(fmt: LinearFormat | None) -> Iterator[None]:
    """While inside, :func:`choose_linear_format` returns ``fmt`` (for its dtype and device)."""
    token = _PLANNED.set(fmt)
    try:
        yield
    finally:
        _PLANNED.reset(token)


def linear_override() -> str:
    """The ``KVBATCH_LINEAR`` variable, lower-cased ('' when unset); raises ``ValueError`` for a
    value that names no kernel."""
    wanted = os.environ.get("KVBATCH_LINEAR", "").strip().lower()
    if wanted not in ("", ONEDNN, BLAS, MKL, CUBLAS):
        raise ValueError(f"KVBATCH_LINEAR must be {ONEDNN!r}, {BLAS!r} or {MKL!r}, not {wanted!r} "
                         f"({CUBLAS!r} runs the CUDA layout on the CPU, for tests)")
    return wanted


def choose_linear_format(dtype: torch.dtype, device: torch.device | str = "cpu") -> LinearFormat:
    """On CUDA: cuBLAS over plain weights. On the CPU: the format :func:`use_linear_format`
    installed (build_model's measurement) when it matches ``dtype``, else oneDNN packed weights
    where this build has them (fp32, bf16), else BLAS; the ``KVBATCH_LINEAR`` variable
    (``onednn``, ``blas``, ``mkl`` (fp32), or ``cublas``: the CUDA layout, plain weights and
    ``F.linear``) overrides the static CPU choice."""
    device = torch.device(device)
    planned = _PLANNED.get()
    if planned is not None and planned.dtype == dtype and planned.device == device:
        return planned
    if device.type == "cuda":
        return LinearFormat(CUBLAS, dtype, device)
    wanted = linear_override()
    if wanted == CUBLAS:  # the CUDA layout on the CPU: how tests run the GPU code path without a GPU
        return LinearFormat(CUBLAS, dtype, device)
    if wanted == MKL:
        if dtype != torch.float32:
            raise ValueError(f"KVBATCH_LINEAR=mkl multiplies fp32 weights, not {dtype}")
        if not mkl_packed.available():
            raise ValueError("KVBATCH_LINEAR=mkl, but this torch build exports no MKL packed sgemm")
        return LinearFormat(MKL, dtype)
    packable = dtype in (torch.float32, torch.bfloat16) and onednn_available(dtype)
    if wanted == ONEDNN and not packable:
        raise ValueError(f"KVBATCH_LINEAR=onednn, but this torch build cannot pack {dtype} weights with oneDNN")
    return LinearFormat(ONEDNN if packable and wanted != BLAS else BLAS, dtype)
