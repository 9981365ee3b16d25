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
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

ONEDNN = "onednn"
BLAS = "blas"
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

    def prepare(self, w: torch.Tensor) -> torch.Tensor:
        """``w`` [out, in] in ``self.dtype`` -> the tensor ``__call__`` takes."""
        w = w.to(self.dtype).contiguous()
        if self.kind == ONEDNN:
            return torch.ops.mkldnn._reorder_linear_weight(w, _PACK_ROWS_HINT)
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

    def _multiply(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        if self.kind == ONEDNN:
            return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
        if self.dtype != torch.float32:
            return F.linear(x, w, b)
        return torch.addmm(b, x, w) if b is not None else x @ w

    def invariant_rows(self, rows: int) -> int:
        """The row count to multiply ``rows`` rows as so each row's result equals its result in
        any larger batch. Measured: oneDNN fp32 gives every row the same bits from 2 rows up
        (one row takes a matrix-vector kernel), oneDNN bf16 from 1; MKL from 4, 8 and 12 up."""
        if self.kind == ONEDNN:
            return 2 if rows == 1 and self.dtype == torch.float32 else rows
        return blas_invariant_rows(rows)


def blas_invariant_rows(rows: int) -> int:
    """MKL sgemm gives 4, 8 and >= 12 rows the same per-row result as any larger batch; 1-3,
    5-7 and 9-11 rows do not (measured), so round those up to a multiple of 4."""
    return rows + (4 - rows % 4) if 0 < rows < 12 and rows % 4 else rows


def choose_linear_format(dtype: torch.dtype) -> LinearFormat:
    """oneDNN packed weights where this build has them (fp32, bf16), else BLAS; the
    ``KVBATCH_LINEAR`` variable (``onednn`` or ``blas``) overrides the choice."""
    wanted = os.environ.get("KVBATCH_LINEAR", "").strip().lower()
    if wanted not in ("", ONEDNN, BLAS):
        raise ValueError(f"KVBATCH_LINEAR must be {ONEDNN!r} or {BLAS!r}, not {wanted!r}")
    packable = dtype in (torch.float32, torch.bfloat16) and onednn_available(dtype)
    if wanted == ONEDNN and not packable:
        raise ValueError(f"KVBATCH_LINEAR=onednn, but this torch build cannot pack {dtype} weights with oneDNN")
    return LinearFormat(ONEDNN if packable and wanted != BLAS else BLAS, dtype)
