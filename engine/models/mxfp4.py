"""MXFP4 checkpoints (gpt-oss's experts as published): the ``quantization_config`` read, and each
``<name>_blocks`` / ``<name>_scales`` pair dequantized at load.

The format (OCP microscaling, FP4 E2M1 elements, one E8M0 scale per 32 elements): ``_blocks`` is
uint8 ``[..., G, 16]``, two FP4 codes a byte (the low nibble the even element, the high nibble the
odd one), ``_scales`` uint8 ``[..., G]``, the exponent of each group of 32 elements biased by 127.
Element ``j`` of group ``g`` is ``FP4_VALUES[code] * 2 ** (scale[g] - 127)``: the weight
``[..., G * 32]`` as its rows lie, ``[E, out, in]`` for gpt-oss's experts, which this returns in
transformers' in-memory layout (``[E, in, out]``, a transposed view, no copy), the layout the
gpt-oss family converts from (:func:`kvbatch.engine.models.gpt_oss.convert_gpt_oss`).

On the CPU the experts are dequantized to the engine dtype at load; kept as MXFP4 (a kernel that
multiplies by the blocks) is not implemented.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvbatch.engine.models.errors import ModelLoadError
from kvbatch.engine.models.fp8 import SUPPORTED_QUANTIZATION as FP8_QUANTIZATION

if TYPE_CHECKING:  # torch only where a weight is dequantized: tokenizing steps import the loader without it
    import torch

# The FP4 (E2M1) value of each 4-bit code: sign bit 3, then exponent and mantissa.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
SUPPORTED_QUANTIZATION = (*FP8_QUANTIZATION, "mxfp4 (gpt-oss experts: _blocks + _scales)")
SUFFIXES = ("_blocks", "_scales")


def is_mxfp4(config: dict[str, Any], source: str) -> bool:
    """Whether ``config`` declares MXFP4 weights (``quantization_config.quant_method: mxfp4``);
    a method other than ``fp8`` and ``mxfp4`` is refused in one line naming it and the supported ones."""
    quant = config.get("quantization_config")
    if not quant:
        return False
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    if method not in ("fp8", "mxfp4"):
        raise ModelLoadError(f"{source}: unsupported quantization method {method!r}; "
                             f"supported: {', '.join(SUPPORTED_QUANTIZATION)}")
    return method == "mxfp4"


def is_mxfp4_part(name: str, tensor: torch.Tensor) -> bool:
    """Whether a stored tensor is half of an MXFP4 weight (uint8 ``_blocks`` or ``_scales``)."""
    return name.endswith(SUFFIXES) and str(tensor.dtype) == "torch.uint8"


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``blocks`` uint8 [..., G, B] and ``scales`` uint8 [..., G] to ``dtype`` [..., G * 2 B] (module
    docstring): the FP4 values in ``dtype``, times ``2 ** (scale - 127)`` by ``torch.ldexp`` (exact:
    a power of two), one leading index at a time to bound the temporaries; ``dtype`` None: fp32.
    ValueError when the shapes do not pair."""
    import torch

    dtype = dtype or torch.float32
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} ({blocks.dtype}) and scales {tuple(scales.shape)} "
                         f"({scales.dtype}) do not pair: expected uint8 [..., G, B] and [..., G]")
    lut = torch.tensor(FP4_VALUES, dtype=dtype)
    *lead, G, B = blocks.shape
    flat_blocks, flat_scales = blocks.reshape(-1, G, B), scales.reshape(-1, G)
    out = torch.empty((flat_blocks.shape[0], G, 2 * B), dtype=dtype)
    for i in range(flat_blocks.shape[0]):
        codes = flat_blocks[i]
        out[i, :, 0::2] = lut[(codes & 0x0F).long()]
        out[i, :, 1::2] = lut[(codes >> 4).long()]
        torch.ldexp(out[i], (flat_scales[i].to(torch.int32) - 127)[:, None], out=out[i])
    return out.view(*lead, G * 2 * B)


def dequantize_mxfp4_weights(stored: dict[str, torch.Tensor], dtype: torch.dtype, source: str) -> dict[str, torch.Tensor]:
    """Every ``<name>_blocks`` of ``stored`` with its ``<name>_scales`` dequantized to ``dtype`` under
    ``<name>``, as transformers holds it in memory (the last two axes swapped: a view); a half
    without its partner, or pieces that do not pair, is a load error naming the weight."""
    names = {n[: -len(suffix)] for n in stored for suffix in SUFFIXES if n.endswith(suffix)}
    out: dict[str, torch.Tensor] = {}
    for name in sorted(names):
        blocks, scales = stored.get(name + "_blocks"), stored.get(name + "_scales")
        if blocks is None or scales is None:
            raise ModelLoadError(f"{source}: MXFP4 weight {name} has {'no _blocks' if blocks is None else 'no _scales'}")
        try:
            out[name] = dequantize_mxfp4(blocks, scales, dtype).transpose(-1, -2)
        except ValueError as exc:
            raise ModelLoadError(f"{source}: {name}: {exc}") from exc
    return out
