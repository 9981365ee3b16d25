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
