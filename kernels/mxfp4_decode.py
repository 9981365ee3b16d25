"""MXFP4 decoding (OCP microscaling: FP4 E2M1 elements, one E8M0 scale per 32 of them), shared by
the loader (:mod:`kvbatch.engine.models.mxfp4`, gpt-oss's experts) and the reference twin of the
fused MoE kernel's MXFP4 variant (:func:`kvbatch.kernels.dispatch.fused_moe_mxfp4_reference`).

Blocks are uint8 ``[..., G, 16]``, two FP4 codes a byte (the low nibble the even element, the high
nibble the odd one); scales uint8 ``[..., G]``, each group's exponent biased by 127. Element ``j``
of group ``g`` is ``FP4_VALUES[code] * 2 ** (scale[g] - 127)``.

torch is imported where a weight is decoded, not with this module: the loader that imports it also
serves steps that only tokenize.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# The FP4 (E2M1) value of each 4-bit code: sign bit 3, then exponent and mantissa.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``blocks`` uint8 [..., G, B] and ``scales`` uint8 [..., G] to ``dtype`` [..., G * 2 B] (the
    format: the module docstring): the FP4 values in ``dtype``, times ``2 ** (scale - 127)`` by ``torch.ldexp`` (exact:
    a power of two), a bounded number of leading rows at a time to bound the temporaries (and the
    passes: on a device, each is a few kernel launches); ``dtype`` None: fp32.
    On ``blocks``' device (the loader's CPU, or the device twin of the MXFP4 MoE kernel). ValueError
    when the shapes do not pair."""
    import torch

    dtype = dtype or torch.float32
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} ({blocks.dtype}) and scales {tuple(scales.shape)} "
                         f"({scales.dtype}) do not pair: expected uint8 [..., G, B] and [..., G]")
    lut = torch.tensor(FP4_VALUES, dtype=dtype, device=blocks.device)
    *lead, G, B = blocks.shape
    flat_blocks, flat_scales = blocks.reshape(-1, G, B), scales.reshape(-1, G)
    out = torch.empty((flat_blocks.shape[0], G, 2 * B), dtype=dtype, device=blocks.device)
    step = max(1, (1 << 20) // max(1, G * 2 * B))  # rows a pass: about a million values
    for i in range(0, flat_blocks.shape[0], step):
        codes, part = flat_blocks[i:i + step], out[i:i + step]
        part[..., 0::2] = lut[(codes & 0x0F).long()]
        part[..., 1::2] = lut[(codes >> 4).long()]
        torch.ldexp(part, (flat_scales[i:i + step].to(torch.int32) - 127)[..., None], out=part)
    return out.view(*lead, G * 2 * B)
