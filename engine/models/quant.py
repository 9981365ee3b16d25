"""Weight-only int8 for the dense projections: symmetric, one scale per output channel.

``w[o, :] ~= q[o, :] * scale[o]`` with ``q`` in [-127, 127] and ``scale[o] = max|w[o, :]| / 127``;
activations stay in the model's dtype (fp32 or bf16), so the only error is the weight rounding
(at most half a step, ``scale / 2``, per weight). A quarter of fp32's bytes to stream per decode
step; whether that is faster depends on the CPU's int8 kernels, so the route is measured per
row-count bucket like the float kernels (:mod:`kvbatch.engine.models.kernel_choice`):

* ``int8pack``: ``torch._weight_int8pack_mm`` (ATen's weight-only int8 GEMM, no weight copy);
* ``dequant``: cast the int8 weight to the activation dtype, multiply, scale the output columns
  (one transient float copy of the weight per call: only pays with many rows).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

INT8PACK = "int8pack"
DEQUANT = "dequant"
INT8_ROUTES = (INT8PACK, DEQUANT)


@dataclass(frozen=True)
class Int8Weight:
    """A projection ``[out, in]`` as int8 values and per-output-channel fp32 scales."""

    q: torch.Tensor  # [out, in] int8
    scale: torch.Tensor  # [out] fp32
    scale_bf16: torch.Tensor  # [out] bf16: int8pack takes scales in the activations' dtype

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def dequantize(self) -> torch.Tensor:
        """The fp32 weight this stands for."""
        return self.q.float() * self.scale[:, None]


def quantize_int8(w: torch.Tensor) -> Int8Weight:
    """``w`` [out, in] (any float dtype) -> its symmetric per-output-channel int8 form. A row of
    zeros gets scale 1 (its values are 0 either way), so no division by zero."""
    if w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"int8 quantization takes a 2-D float weight, got {tuple(w.shape)} {w.dtype}")
    w = w.float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.clamp(torch.round(w / scale[:, None]), -127, 127).to(torch.int8).contiguous()
    return Int8Weight(q, scale.contiguous(), scale.to(torch.bfloat16).contiguous())


def int8_linear(x: torch.Tensor, w: Int8Weight, b: torch.Tensor | None, route: str) -> torch.Tensor:
    """``x`` [rows, in] (fp32 or bf16) times the int8 weight -> [rows, out] in ``x.dtype``."""
    if route == INT8PACK:
        scale = w.scale if x.dtype == torch.float32 else w.scale_bf16.to(x.dtype)
        y = torch._weight_int8pack_mm(x.contiguous(), w.q, scale)
    elif route == DEQUANT:
        y = F.linear(x, w.q.to(x.dtype)) * w.scale.to(x.dtype)
    else:
        raise ValueError(f"unknown int8 route {route!r} (use one of {INT8_ROUTES})")
    return y + b if b is not None else y
