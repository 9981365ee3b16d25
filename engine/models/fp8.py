"""FP8 block-scaled checkpoints (DeepSeek-V3's and Qwen3-*-FP8's format): float8_e4m3fn weights
with a ``<name>_scale_inv`` per ``weight_block_size`` block, declared by ``quantization_config:
{quant_method: fp8, weight_block_size: [bn, bk]}``. The CPU dequantizes them at load
(:mod:`kvbatch.engine.models.weights` calls :func:`dequantize_fp8_weights` once every shard is
read); any other quantization method is refused in one line naming it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvbatch.engine.models.errors import ModelLoadError

if TYPE_CHECKING:  # torch only where a weight is dequantized: tokenizing steps import the loader without it
    import torch

# Weight quantizations of HF folders that load (dequantized at load); others are refused by name.
SUPPORTED_QUANTIZATION = ("fp8 (float8_e4m3fn, block-scaled: weight_block_size)",)

def is_fp8(tensor: torch.Tensor) -> bool:
    return str(tensor.dtype) == "torch.float8_e4m3fn"


def is_float8(tensor: torch.Tensor) -> bool:
    return str(tensor.dtype).startswith("torch.float8")


def fp8_block_size(config: dict[str, Any], source: str) -> tuple[int, int] | None:
    """The ``[block_n, block_k]`` of an FP8 block-scaled checkpoint; None without a
    ``quantization_config``; any other quantization is refused in one line naming it."""
    quant = config.get("quantization_config")
    if not quant:
        return None
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    if method != "fp8":
        raise ModelLoadError(f"{source}: unsupported quantization method {method!r}; "
                             f"supported: {', '.join(SUPPORTED_QUANTIZATION)}")
    fmt = quant.get("fmt", "e4m3")
    size = quant.get("weight_block_size")
    if fmt != "e4m3" or not (isinstance(size, list) and len(size) == 2 and all(isinstance(n, int) and n > 0 for n in size)):
        raise ModelLoadError(f"{source}: fp8 quantization with fmt {fmt!r} and weight_block_size {size!r} is not "
                             f"supported (only e4m3 with a [block_n, block_k] block size, e.g. [128, 128])")
    return int(size[0]), int(size[1])


def dequantize_fp8_block(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """An FP8 weight [N, K] times its per-block scales [ceil(N / bn), ceil(K / bk)], in fp32:
    ``w[i, j] * scale_inv[i // bn, j // bk]`` (the dequantization of DeepSeek-V3's and Qwen3's FP8
    checkpoints; each product of an fp8 value and an fp32 scale is exact in fp32 up to one rounding)."""
    import torch

    bn, bk = block
    n, k = weight.shape
    expected = (-(-n // bn), -(-k // bk))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(f"scales of shape {tuple(scale_inv.shape)} for a [{n}, {k}] weight in "
                         f"{bn}x{bk} blocks (expected {expected})")
    scales = scale_inv.to(torch.float32).repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return weight.to(torch.float32) * scales


def dequantize_fp8_weights(stored: dict[str, torch.Tensor], block: tuple[int, int], dtype: torch.dtype,
                           source: str) -> dict[str, torch.Tensor]:
    """Every FP8 weight of ``stored`` dequantized with its ``<name>_scale_inv`` and cast to
    ``dtype``; an FP8 weight without scales, or scales without a weight, is a load error."""
    out: dict[str, torch.Tensor] = {}
    scales = {name.removesuffix("_scale_inv"): t for name, t in stored.items() if name.endswith("_scale_inv")}
    for name, weight in stored.items():
        if name.endswith("_scale_inv"):
            if name.removesuffix("_scale_inv") not in stored:
                raise ModelLoadError(f"{source}: {name} scales no weight")
            continue
        if name not in scales:
            raise ModelLoadError(f"{source}: FP8 weight {name} has no {name}_scale_inv")
        if weight.dim() != 2:
            raise ModelLoadError(f"{source}: FP8 weight {name} is not a matrix (shape {tuple(weight.shape)})")
        try:
            out[name] = dequantize_fp8_block(weight, scales[name], block).to(dtype)
        except ValueError as exc:
            raise ModelLoadError(f"{source}: {name}: {exc}") from exc
    return out


