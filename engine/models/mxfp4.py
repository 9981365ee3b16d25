"""MXFP4 checkpoints (gpt-oss's experts as published): the ``quantization_config`` read, and each
``<name>_blocks`` / ``<name>_scales`` pair dequantized at load.

The format (OCP microscaling, FP4 E2M1 elements, one E8M0 scale per 32 elements): ``_blocks`` is
uint8 ``[..., G, 16]``, two FP4 codes a byte (the low nibble the even element, the high nibble the
odd one), ``_scales`` uint8 ``[..., G]``, the exponent of each group of 32 elements biased by 127.
Element ``j`` of group ``g`` is ``FP4_VALUES[code] * 2 ** (scale[g] - 127)``: the weight
``[..., G * 32]`` as its rows lie, ``[E, out, in]`` for gpt-oss's experts, which this returns in
transformers' in-memory layout (``[E, in, out]``, a transposed view, no copy), the layout the
gpt-oss family converts from (:func:`kvbatch.engine.models.gpt_oss.convert_gpt_oss`).

The experts are dequantized to the engine dtype at load. For CUDA (``load_checkpoint(...,
keep_fp8=True)``, the flag that keeps FP8 weights) each layer's experts are also kept as published
(:func:`keep_mxfp4_experts`, ``Checkpoint.mxfp4_experts``): in the published tensors the groups of
32 run along each matrix's input dim, the reduction (K) dim of both expert GEMMs, so the engine's
layouts (``gate_up_proj`` ``[E, 2 I, H]`` gate rows then up rows, ``down_proj`` ``[E, H, I]``) are row
permutations of them that keep every group whole; the Triton fused MoE kernel's ``MXFP4_W`` variant
multiplies by them (``dispatch.fused_moe`` with ``mxfp4_scales``). The CPU keeps only the dequantized
tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvbatch.engine.models.errors import ModelLoadError
from kvbatch.engine.models.fp8 import SUPPORTED_QUANTIZATION as FP8_QUANTIZATION
from kvbatch.kernels.mxfp4_decode import FP4_VALUES, dequantize_mxfp4

__all__ = ["FP4_VALUES", "Mxfp4Experts", "dequantize_mxfp4", "dequantize_mxfp4_weights", "is_mxfp4", "is_mxfp4_part",
           "keep_mxfp4_experts"]

if TYPE_CHECKING:  # torch only where a weight is dequantized: tokenizing steps import the loader without it
    import torch

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


@dataclass(frozen=True)
class Mxfp4Experts:
    """One MoE layer's expert stack as an MXFP4 checkpoint publishes it, in the engine's layout:
    ``blocks`` uint8 ``[E, N, K / 32, 16]`` and ``scales`` uint8 ``[E, N, K / 32]``, the groups along
    K (each expert's matrix ``[N, K]``: ``[2 I, H]`` gate rows then up rows, or ``[H, I]``)."""

    blocks: torch.Tensor
    scales: torch.Tensor

    def __post_init__(self) -> None:
        b, s = self.blocks, self.scales
        if b.dim() != 4 or b.shape[-1] != 16 or tuple(b.shape[:-1]) != tuple(s.shape) or str(b.dtype) != "torch.uint8" \
                or str(s.dtype) != "torch.uint8":
            raise ValueError(f"MXFP4 experts {tuple(b.shape)} {b.dtype} with scales {tuple(s.shape)} {s.dtype}: "
                             "expected uint8 [E, N, K / 32, 16] and [E, N, K / 32]")

    @property
    def shape(self) -> tuple[int, int, int]:
        """The dequantized stack's shape ``(E, N, K)``."""
        E, N, G, _ = self.blocks.shape
        return E, N, G * 32

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``[E, N, K]`` in ``dtype`` (fp32 by default): what the loader holds for these experts."""
        return dequantize_mxfp4(self.blocks, self.scales, dtype)

    def to(self, device: torch.device | str) -> Mxfp4Experts:
        return Mxfp4Experts(self.blocks.to(device).contiguous(), self.scales.to(device).contiguous())


def keep_mxfp4_experts(stored: dict[str, torch.Tensor], config: dict[str, Any]) -> dict[str, Mxfp4Experts]:
    """gpt-oss's stored expert halves (``<layer>.mlp.experts.{gate_up,down}_proj_{blocks,scales}``) as
    :class:`Mxfp4Experts` under the names of the dequantized tensors, converted as
    :func:`~kvbatch.engine.models.gpt_oss.convert_gpt_oss` converts those: ``gate_up_proj``'s rows
    (its output dim: gate and up interleaved) reordered gate then up; ``down_proj`` as stored. Its
    transposes need no counterpart: published ``[E, out, in / 32, 16]`` already has the groups along
    ``in``. Other MXFP4 weights (none in gpt-oss) are not kept. Called after the dequantized load
    succeeded, so every pair is known to be well formed."""
    from kvbatch.engine.models.gpt_oss import _cat_halves

    if config.get("model_type") != "gpt_oss":
        return {}
    out: dict[str, Mxfp4Experts] = {}
    kept = ("experts.gate_up_proj_blocks", "experts.down_proj_blocks")
    for name in sorted(n.removesuffix("_blocks") for n in stored if n.endswith(kept)):
        blocks, scales = stored[name + "_blocks"], stored[name + "_scales"]
        if name.endswith("gate_up_proj"):
            blocks, scales = _cat_halves(blocks, 1), _cat_halves(scales, 1)
        out[name] = Mxfp4Experts(blocks.contiguous(), scales.contiguous())
    return out


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
