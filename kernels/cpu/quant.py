"""Weight-only int8 for the dense projections: symmetric, one scale per output channel.

``w[o, :] ~= q[o, :] * scale[o]`` with ``q`` in [-127, 127] and ``scale[o] = max|w[o, :]| / 127``;
activations stay in the model's dtype (fp32 or bf16), so the only error is the weight rounding
(at most half a step, ``scale / 2``, per weight). A quarter of fp32's bytes to stream per decode
step; whether that is faster depends on the CPU's int8 kernels, so the route is measured per
row-count bucket like the float kernels (:mod:`kvbatch.kernels.cpu.kernel_choice`):

* ``int8pack``: ``torch._weight_int8pack_mm`` (ATen's weight-only int8 GEMM, no weight copy);
* ``dequant``: cast the int8 weight to the activation dtype, multiply, scale the output columns
  (one transient float copy of the weight per call: only pays with many rows);
* ``gemv``: the native CPU kernels' int8 multiply (:func:`kvbatch.kernels.cpu.native.gemv`, fp32
  activations, any row count), each weight widened in registers as it streams, over the blocked
  layout it reads front to back (:class:`~kvbatch.kernels.cpu.native.Int8Blocks`); the fused
  decode layers run it too. Past a few rows it is compute-bound, each block re-read from L1/L2
  for every 8 rows: about as fast as oneDNN's fp32 GEMM there, where ``dequant`` first writes a
  float copy of the weight (64 rows of SmolLM2's layer: 1.1 ms against 2.7, EPYC 26).

An :class:`Int8Weight` holds the layouts its routes read: ``q`` [out, in] for ``int8pack`` (and
``dequant``), the blocks for ``gemv`` (``dequant`` reads them when ``q`` is not kept), so a model
whose buckets all take ``gemv`` or ``dequant`` holds its int8 weights once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvbatch.kernels import dispatch
from kvbatch.kernels.cpu import native as native_kernels

INT8PACK = "int8pack"
DEQUANT = "dequant"
GEMV = "gemv"
INT8_ROUTES = (INT8PACK, DEQUANT, GEMV)


@dataclass(frozen=True)
class Int8Weight:
    """A projection ``[out, in]`` as int8 values and per-output-channel fp32 scales, in the layouts
    its routes read: ``q`` [out, in] and/or ``blocks`` (at least one of them)."""

    q: torch.Tensor | None  # [out, in] int8
    scale: torch.Tensor  # [out] fp32
    scale_bf16: torch.Tensor  # [out] bf16: int8pack takes scales in the activations' dtype
    blocks: native_kernels.Int8Blocks | None = None

    def __post_init__(self) -> None:
        if self.q is None and self.blocks is None:
            raise ValueError("an int8 weight needs its [out, in] values or their blocks")

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.scale.shape[0], self.in_features))

    @property
    def in_features(self) -> int:
        return self.q.shape[1] if self.q is not None else self.blocks.q.shape[1]

    def values(self) -> torch.Tensor:
        """The int8 values [out, in] (from the blocks when ``q`` is not kept: a copy)."""
        if self.q is not None:
            return self.q
        return self.blocks.q.transpose(1, 2).reshape(-1, self.in_features)[:self.scale.shape[0]]

    def dequantize(self) -> torch.Tensor:
        """The fp32 weight this stands for."""
        return self.values().float() * self.scale[:, None]


def quantize_int8(w: torch.Tensor, routes: tuple[str, ...] = (INT8PACK, DEQUANT)) -> Int8Weight:
    """``w`` [out, in] (any float dtype) -> its symmetric per-output-channel int8 form, in the
    layouts ``routes`` read. A row of zeros gets scale 1 (its values are 0 either way), so no
    division by zero."""
    if w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"int8 quantization takes a 2-D float weight, got {tuple(w.shape)} {w.dtype}")
    unknown = set(routes) - set(INT8_ROUTES)
    if unknown or not routes:
        raise ValueError(f"unknown int8 routes {sorted(unknown) or routes!r} (use some of {INT8_ROUTES})")
    w = w.float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.clamp(torch.round(w / scale[:, None]), -127, 127).to(torch.int8).contiguous()
    blocks = native_kernels.int8_blocks(q, scale) if GEMV in routes else None
    keep_q = INT8PACK in routes or blocks is None
    return Int8Weight(q if keep_q else None, scale.contiguous(), scale.to(torch.bfloat16).contiguous(), blocks)


def int8_linear(x: torch.Tensor, w: Int8Weight, b: torch.Tensor | None, route: str) -> torch.Tensor:
    """``x`` [rows, in] (fp32 or bf16) times the int8 weight -> [rows, out] in ``x.dtype``. The
    ``gemv`` route runs ``dequant`` for bf16 activations and where the native kernels are off
    (``KVBATCH_KERNELS=reference``)."""
    if route == GEMV and w.blocks is not None and dispatch.native(x):
        return native_kernels.gemv(x, w.blocks, b)
    if route == INT8PACK:
        scale = w.scale if x.dtype == torch.float32 else w.scale_bf16.to(x.dtype)
        y = torch._weight_int8pack_mm(x.contiguous(), w.q, scale)
    elif route in (DEQUANT, GEMV):
        y = F.linear(x, w.values().to(x.dtype)) * w.scale.to(x.dtype)
    else:
        raise ValueError(f"unknown int8 route {route!r} (use one of {INT8_ROUTES})")
    return y + b if b is not None else y
