"""MKL's packed-weight sgemm: an fp32 weight reordered once, at load time, into MKL's internal
blocked layout (``cblas_sgemm_pack``) and multiplied by from there (``cblas_sgemm_compute``).

Plain ``x @ w`` (BLAS) repacks the weight into that layout on every call; for a batched decode
step, where the weights are reused by 9-64 rows and the multiply turns compute-bound, the repack
is a real share of the time. Measured on a 2-vCPU Intel Xeon (family 6 model 167, AVX-512, AMX),
2026-12-02: SmolLM2-135M's layer at 64 rows 1.26x BLAS's speed in a scratch timing (its results
bit-identical to BLAS's from ~40 rows); the batch-64 decode step's projections 79.1 ms with BLAS,
61.6 with this (``bench_engine.py --step-profile 20 --linear blas|mkl``); at one row it is slower.
Which kernel wins a bucket is measured per machine (:mod:`kvbatch.kernels.cpu.kernel_choice`).

The routines are not in torch's Python API; torch's CPU library carries MKL statically and exports
them, so they are reached through ctypes, and :func:`available` is False where that library lacks
them (a build without MKL, a non-x86 machine): the kernel is then simply not a candidate.

Two rules of MKL's packed storage shape this module: the packed buffer must never move (MKL
keeps alignment-dependent metadata inside it: a copy at another address crashed with SIGFPE, so
:class:`PackedWeight` holds its buffer privately and a second copy is packed again, never
cloned), and the same ``Layout`` must be used for packing and computing (row-major here).
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from kvbatch.kernels.cpu import native as native_kernels
from kvbatch.kernels.cpu.huge_pages import HugePageArena

# cblas enums (mkl_cblas.h)
_ROW_MAJOR = 101
_NO_TRANS, _TRANS = 111, 112
_B_MATRIX = 162
_PACKED = 151
# The row count the weight is packed for (MKL sizes its blocks for it; any row count multiplies
# by the result). 64: the batched-decode bucket, where this kernel is meant to win.
PACK_ROWS_HINT = 64
_INT, _F32, _P = ctypes.c_int, ctypes.c_float, ctypes.c_void_p  # MKL_INT is 32-bit in the LP64 symbols


@functools.cache
def _library() -> ctypes.CDLL | None:
    """torch's CPU library with the packed sgemm symbols bound, or None where it has none."""
    path = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
    try:
        lib = ctypes.CDLL(str(path))
        get_size, pack, compute = lib.cblas_sgemm_pack_get_size, lib.cblas_sgemm_pack, lib.cblas_sgemm_compute
    except (OSError, AttributeError):
        return None
    get_size.restype, get_size.argtypes = ctypes.c_size_t, [_INT, _INT, _INT, _INT]
    pack.restype, pack.argtypes = None, [_INT, _INT, _INT, _INT, _INT, _INT, _F32, _P, _INT, _P]
    compute.restype = None
    compute.argtypes = [_INT, _INT, _INT, _INT, _INT, _INT, _P, _INT, _P, _INT, _F32, _P, _INT]
    return lib


@functools.cache
def available() -> bool:
    """Whether the packed sgemm is there and multiplies correctly (probed once: a symbol that
    resolves but computes something else must not become a candidate)."""
    if _library() is None or not torch.backends.mkl.is_available():
        return False
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(24, 40, generator=g), torch.randn(5, 40, generator=g)
    return bool(torch.allclose(linear(x, pack(w)), x @ w.t(), rtol=1e-4, atol=1e-4))


@dataclass(frozen=True, eq=False)
class PackedWeight:
    """An ``[out, in]`` fp32 weight in MKL's packed layout. Opaque: it can be multiplied by
    (:func:`linear`) and nothing else, and never copied (see the module docstring)."""

    _buffer: torch.Tensor  # uint8, MKL's layout; address fixed for the weight's life
    in_features: int
    out_features: int

    def nbytes(self) -> int:
        return self._buffer.numel()

    def __reduce__(self) -> tuple:  # copy, deepcopy and pickle all come here: a moved buffer crashes MKL
        raise TypeError("an MKL packed weight cannot be copied or pickled (its buffer must not move); pack the "
                        "source weight again")


def pack(w: torch.Tensor, arena: HugePageArena | None = None) -> PackedWeight:
    """``w`` [out, in] (fp32, CPU) -> its packed layout, as the B matrix of ``x @ w.T``; in
    ``arena``'s huge pages where one is given (kernels/cpu/huge_pages.py: SmolLM2's 30 layers packed
    there multiplied 8 rows in 23.3 ms against 28.4, 64 rows in 49 against 53, Xeon 167)."""
    if w.dtype != torch.float32 or w.device.type != "cpu" or w.dim() != 2:
        raise ValueError(f"MKL's packed sgemm takes a 2-D fp32 CPU weight, not {w.dtype} {tuple(w.shape)} on {w.device}")
    lib = _library()
    if lib is None:
        raise RuntimeError("this torch build exports no cblas_sgemm_pack (no MKL)")
    out_f, in_f = w.shape
    if out_f == 0 or in_f == 0:
        raise ValueError(f"cannot pack an empty weight of shape {tuple(w.shape)}")
    w = w.contiguous()
    size = lib.cblas_sgemm_pack_get_size(_B_MATRIX, PACK_ROWS_HINT, out_f, in_f)
    # torch.empty leaves the pages untouched: MKL's size is an upper bound, what it writes is resident.
    buf = torch.empty(size, dtype=torch.uint8) if arena is None else arena.empty((size,), torch.uint8)
    # op(src) = w^T, [in, out]: the B of C = A @ B with A = x [rows, in]
    lib.cblas_sgemm_pack(_ROW_MAJOR, _B_MATRIX, _TRANS, PACK_ROWS_HINT, out_f, in_f, 1.0, w.data_ptr(), in_f,
                         buf.data_ptr())
    return PackedWeight(buf, in_f, out_f)


def linear(x: torch.Tensor, w: PackedWeight, b: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` [rows, in] (fp32) -> ``x @ w.T + b``, [rows, out]."""
    if x.dim() != 2 or x.shape[1] != w.in_features or x.dtype != torch.float32:
        raise ValueError(f"x must be fp32 [rows, {w.in_features}], not {x.dtype} {tuple(x.shape)}")
    rows = x.shape[0]
    y = torch.empty(rows, w.out_features, dtype=torch.float32)
    if rows:
        if x.stride(1) != 1 or x.stride(0) < w.in_features:  # (a broadcast or transposed view)
            x = x.contiguous()
        _library().cblas_sgemm_compute(_ROW_MAJOR, _NO_TRANS, _PACKED, rows, w.out_features, w.in_features,
                                       x.data_ptr(), x.stride(0), w._buffer.data_ptr(), w.out_features, 0.0,
                                       y.data_ptr(), w.out_features)
    return y.add_(b) if b is not None else y


def fused_weight(w: PackedWeight) -> native_kernels.GemmWeight:
    """``w`` as the fused decode layers take it: its packed bytes, multiplied there by
    :func:`sgemm_compute_address`'s routine with the arguments :func:`linear` passes (the same bits)."""
    return native_kernels.GemmWeight(w._buffer, w.in_features, w.out_features)


@functools.cache
def sgemm_compute_address() -> int | None:
    """The address of torch's MKL ``cblas_sgemm_compute`` (for the fused decode layers' C code, which
    links no MKL), or None where :func:`available` is False."""
    if not available():
        return None
    return ctypes.cast(_library().cblas_sgemm_compute, ctypes.c_void_p).value
