"""FP8 block-scaled checkpoints (DeepSeek-V3's and Qwen3-*-FP8's format): float8_e4m3fn weights
with a ``<name>_scale_inv`` per ``weight_block_size`` block, declared by ``quantization_config:
{quant_method: fp8, weight_block_size: [bn, bk]}``. The CPU dequantizes them at load
(:mod:`kvbatch.engine.models.weights` calls :func:`dequantize_fp8_weights` once every shard is
read); any other quantization method is refused in one line naming it.

For CUDA the loader (``load_checkpoint(..., keep_fp8=True)``) also keeps each FP8 weight as
published, an :class:`Fp8BlockWeight` (float8 values, fp32 scales, the block size) in
``Checkpoint.fp8_weights``: uploaded as it is (a byte per value) and multiplied by the block-scaled
Triton GEMM (``kernels/triton_fp8_gemm.py``, through :func:`kvbatch.kernels.dispatch.fp8_block_linear`),
which dequantizes in registers exactly as the loader dequantizes on the CPU. A MoE layer's experts
are kept too, stacked (``weights._fuse_fp8_experts``: ``experts.gate_up_proj`` / ``down_proj``, as
the dequantized ones are fused) and multiplied by the Triton fused MoE kernel's FP8 variant
(``moe.load_moe_layer`` under ``moe.use_fp8_experts``, ``dispatch.fused_moe`` with ``fp8_scales``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
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
    """:func:`kvbatch.kernels.dispatch.dequantize_fp8_block` (kept there, beside the FP8 GEMM's
    reference, so the kernels layer need not import the engine): ``w[i, j] * scale_inv[i // bn, j // bk]``
    in fp32; ValueError when the scales' shape does not fit."""
    from kvbatch.kernels import dispatch  # torch: only where a weight is dequantized

    return dispatch.dequantize_fp8_block(weight, scale_inv, block)


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




@dataclass(frozen=True)
class Fp8BlockWeight:
    """One projection as an FP8 checkpoint publishes it: ``weight`` float8_e4m3fn ``[N, K]``,
    ``scale_inv`` fp32 ``[ceil(N / bn), ceil(K / bk)]``, ``block`` ``(bn, bk)``.

    A MoE layer's experts are a stack of such matrices (:meth:`stack`): ``weight`` ``[E, N, K]``,
    ``scale_inv`` ``[E, ceil(N / bn), ceil(K / bk)]``, one expert's blocks per row of the stack; the
    row operations and :meth:`linear` are for the 2-D weights only.

    Row operations keep the block structure or refuse: :meth:`split` and :meth:`cat` (a family's fused
    projections split at load, the decoder's own fusing of q/k/v and gate/up) need every cut on a
    multiple of ``bn``; :meth:`reorder_rows` (partial rotary's per-head order) needs every row to stay
    in its block. ``shape``/``split``/``clone`` let a family's ``convert_tensors`` treat it as a tensor."""

    weight: torch.Tensor
    scale_inv: torch.Tensor
    block: tuple[int, int]

    def __post_init__(self) -> None:
        bn, bk = self.block
        *experts, n, k = self.weight.shape
        want = (*experts, -(-n // bn), -(-k // bk))
        if self.weight.dim() not in (2, 3) or tuple(self.scale_inv.shape) != want:
            raise ValueError(f"scales of shape {tuple(self.scale_inv.shape)} for a {list(self.weight.shape)} weight in "
                             f"{bn}x{bk} blocks (expected {want})")

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    def to(self, device: torch.device | str) -> Fp8BlockWeight:
        """On ``device``, still FP8 (the scales in fp32)."""
        import torch

        return Fp8BlockWeight(self.weight.to(device), self.scale_inv.to(device=device, dtype=torch.float32),
                              self.block)

    def clone(self) -> Fp8BlockWeight:
        return Fp8BlockWeight(self.weight.clone(), self.scale_inv.clone(), self.block)

    def dequantize(self) -> torch.Tensor:
        """fp32 ``[N, K]`` (``[E, N, K]`` for experts): what the CPU loader holds (before its cast to
        the engine dtype)."""
        if self.weight.dim() == 3:
            from kvbatch.kernels import dispatch

            return dispatch.dequantize_fp8_experts(self.weight, self.scale_inv, self.block)
        return dequantize_fp8_block(self.weight, self.scale_inv, self.block)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x [M, K] @ dequant(weight)^T (+ bias)`` in ``x.dtype``: the Triton GEMM on CUDA, its
        reference elsewhere (:func:`kvbatch.kernels.dispatch.fp8_block_linear`)."""
        from kvbatch.kernels import dispatch

        return dispatch.fp8_block_linear(x, self.weight, self.scale_inv, self.block, bias)

    def split(self, sizes: Sequence[int]) -> tuple[Fp8BlockWeight, ...]:
        """Row slices of ``sizes`` rows, each with its rows of scales; ValueError unless every cut
        falls on a block boundary."""
        bn = self.block[0]
        if sum(sizes) != self.shape[0] or any(n % bn for n in sizes[:-1]):
            raise ValueError(f"cannot split {self.shape[0]} FP8 rows in {bn}-row blocks into {list(sizes)}")
        out, start = [], 0
        for n in sizes:
            out.append(Fp8BlockWeight(self.weight[start:start + n], self.scale_inv[start // bn:-(-(start + n) // bn)],
                                      self.block))
            start += n
        return tuple(out)

    @staticmethod
    def cat(parts: Sequence[Fp8BlockWeight]) -> Fp8BlockWeight:
        """The parts' rows one after another (one block size; every part but the last a whole number
        of blocks, so each block's scale stays its own); ValueError otherwise."""
        import torch

        block = parts[0].block
        if any(p.block != block for p in parts) or any(p.shape[0] % block[0] for p in parts[:-1]):
            raise ValueError(f"cannot join FP8 weights of {[p.shape[0] for p in parts]} rows in blocks "
                             f"{[p.block for p in parts]}: every part but the last must fill whole "
                             f"{block[0]}-row blocks")
        return Fp8BlockWeight(torch.cat([p.weight for p in parts]), torch.cat([p.scale_inv for p in parts]), block)

    @staticmethod
    def stack(experts: Sequence[Fp8BlockWeight]) -> Fp8BlockWeight:
        """Experts' 2-D weights (one shape, one block size) as one ``[E, N, K]`` stack; ValueError otherwise."""
        import torch

        if (not experts or any(w.weight.dim() != 2 or w.shape != experts[0].shape or w.block != experts[0].block
                               for w in experts)):
            raise ValueError(f"cannot stack FP8 experts of shapes {[tuple(w.shape) for w in experts]} in blocks "
                             f"{[w.block for w in experts]}")
        return Fp8BlockWeight(torch.stack([w.weight for w in experts]), torch.stack([w.scale_inv for w in experts]),
                              experts[0].block)

    def reorder_rows(self, order: torch.Tensor) -> Fp8BlockWeight:
        """Rows in ``order`` (``new[i] = old[order[i]]``); ValueError when a row would leave its block
        (its scale would no longer apply)."""
        import torch

        bn = self.block[0]
        if not torch.equal(order // bn, torch.arange(len(order)) // bn):
            raise ValueError(f"the row order moves FP8 rows across {bn}-row blocks")
        return Fp8BlockWeight(self.weight[order].contiguous(), self.scale_inv, self.block)


def kept_projection(fp8: Mapping[str, Fp8BlockWeight], names: Sequence[str], device: Any,
                    reorder: Callable[[str, Fp8BlockWeight], Fp8BlockWeight] | None = None) -> Fp8BlockWeight | None:
    """The projection ``names`` joined (rows of each, in order) as published in FP8, on ``device``:
    what a CUDA model multiplies with the block-scaled GEMM. ``reorder``: the rows a model reorders
    (partial rotary, de-interleaved rope), per name. None where a name is not kept or a join or a
    reorder would cut a block: the dequantized tensor then serves."""
    if not names or not all(n in fp8 for n in names):
        return None
    try:
        return Fp8BlockWeight.cat([fp8[n] if reorder is None else reorder(n, fp8[n]) for n in names]).to(device)
    except ValueError:
        return None


def fp8_block_weights(stored: dict[str, torch.Tensor], block: tuple[int, int],
                      source: str) -> dict[str, Fp8BlockWeight]:
    """Every FP8 weight of ``stored`` with its ``<name>_scale_inv`` as an :class:`Fp8BlockWeight`
    (the same checks as :func:`dequantize_fp8_weights`, which the loader runs first)."""
    import torch

    out: dict[str, Fp8BlockWeight] = {}
    for name, weight in stored.items():
        if name.endswith("_scale_inv"):
            continue
        try:
            out[name] = Fp8BlockWeight(weight, stored[name + "_scale_inv"].to(torch.float32), block)
        except (KeyError, ValueError) as exc:
            raise ModelLoadError(f"{source}: {name}: {exc}") from exc
    return out


def keep_fp8_weights(stored: dict[str, torch.Tensor], block: tuple[int, int], config: dict[str, Any],
                     source: str) -> dict[str, Fp8BlockWeight]:
    """The FP8 weights of ``stored`` as published, under the common decoder's names (a family's
    ``convert_tensors`` applied, e.g. Phi-3's fused projections split at block boundaries): what
    ``Checkpoint.fp8_weights`` holds for a CUDA model. {} when the family's conversion cannot keep
    the blocks (a cut inside a block): the dequantized tensors then serve everywhere."""
    from kvbatch.engine.models.family import FAMILIES

    kept = fp8_block_weights(stored, block, source)
    family = FAMILIES.get(config.get("model_type", ""))
    if family is None or family.convert_tensors is None:
        return kept
    try:
        return family.convert_tensors(kept, config)
    except ValueError:
        return {}
