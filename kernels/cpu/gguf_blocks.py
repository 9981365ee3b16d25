"""A GGUF weight's quantized blocks as the file holds them, kept beside its dequantized tensor.

``weights="gguf"`` multiplies by these blocks directly (:mod:`kvbatch.kernels.cpu.gguf_kernels`);
everything else uses the fp32 tensor that :mod:`kvbatch.engine.models.weights` dequantizes from
the same bytes. Torch-free (numpy), like the loader.

Layouts (ggml's), one weight row of ``in`` values = ``in / 32`` blocks, rows one after another:

* ``Q4_0``: fp16 ``d``, 16 bytes of nibbles; weight ``(nibble - 8) * d`` (18 bytes per block);
* ``Q4_1``: fp16 ``d``, fp16 ``m``, 16 bytes of nibbles; weight ``nibble * d + m`` (20 bytes);
* ``Q8_0``: fp16 ``d``, 32 int8; weight ``q * d`` (34 bytes).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

BLOCK = 32  # weights per block, every type here
# GGUF type name -> (ggml's type id, the kernel's qtype argument; bytes per block)
NATIVE_QTYPES: dict[str, tuple[int, int]] = {"Q4_0": (2, 18), "Q4_1": (3, 20), "Q8_0": (8, 34)}


@dataclass(frozen=True)
class GGUFBlocks:
    """One ``[out, in]`` weight's blocks: ``data`` is uint8 ``[out, in / 32 * block_bytes]``, rows in
    the Hugging Face order (llama-arch Q/K rows already un-permuted, as the fp32 tensor is)."""

    qtype: str
    shape: tuple[int, int]
    data: np.ndarray

    def __post_init__(self) -> None:
        if self.qtype not in NATIVE_QTYPES:
            raise ValueError(f"no native kernel for GGUF type {self.qtype}; have {', '.join(NATIVE_QTYPES)}")
        out_f, in_f = self.shape
        if in_f % BLOCK or tuple(self.data.shape) != (out_f, in_f // BLOCK * block_bytes(self.qtype)):
            raise ValueError(f"{self.qtype} blocks of shape {tuple(self.data.shape)} cannot hold a {self.shape} weight")

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)


def layer_qtype(blocks: Mapping[str, GGUFBlocks]) -> str | None:
    """The GGUF type most of layer 0's projection weights have (what the kernels are measured on);
    None when none of them has blocks."""
    kinds = [b.qtype for name, b in blocks.items() if name.startswith("model.layers.0.") and name.endswith("proj.weight")]
    return max(sorted(set(kinds)), key=kinds.count) if kinds else None


def block_bytes(qtype: str) -> int:
    return NATIVE_QTYPES[qtype][1]


def qtype_id(qtype: str) -> int:
    return NATIVE_QTYPES[qtype][0]


def dequantize(blocks: GGUFBlocks) -> np.ndarray:
    """The fp32 ``[out, in]`` weight the blocks stand for: gguf-py's dequantization, the one the
    loader's fp32 path uses (so the reference and the engine's fp32 weights are the same values)."""
    import gguf

    qtype = gguf.GGMLQuantizationType[blocks.qtype]
    return np.ascontiguousarray(gguf.quants.dequantize(blocks.data, qtype), dtype=np.float32).reshape(blocks.shape)


def quantize(w: np.ndarray, qtype: str) -> GGUFBlocks:
    """``w`` [out, in] (``in`` a multiple of 32) as ``qtype`` blocks, by gguf-py's reference
    quantizer (llama.cpp's rounding): for tests and small models; slow for big ones."""
    import gguf

    w = np.ascontiguousarray(w, dtype=np.float32)
    data = gguf.quants.quantize(w, gguf.GGMLQuantizationType[qtype])
    return GGUFBlocks(qtype, (int(w.shape[0]), int(w.shape[1])), np.ascontiguousarray(data).reshape(w.shape[0], -1))
