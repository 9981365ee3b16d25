"""Multi-head Latent Attention (DeepSeek-V2/V3) settings, read from a Hugging Face config dict.

Kept apart from :mod:`kvbatch.engine.models.config` so that module stays about the Llama family and
the MoE fields; ``ModelConfig.mla`` holds one of these for DeepSeek-V3 checkpoints.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from kvbatch.engine.models.errors import UnsupportedModelError

MLA_ARCHITECTURES = {"deepseek_v3"}
# Rope kinds the MLA model implements: plain rope and YaRN (DeepSeek-V3's long-context form).
MLA_ROPE_KINDS = ("default", "yarn")


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention-temperature factor, 0.1 * mscale * ln(scale) + 1 (1 when not stretched)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class MLAConfig:
    """Shapes of one MLA layer and the softmax scale they imply.

    Per token the KV cache holds only ``kv_lora_rank + qk_rope_head_dim`` numbers per layer: the
    normalised latent ``c_kv`` (keys and values are ``kv_b_proj`` of it) and the one rope key
    ``k_pe`` every head shares.
    """

    q_lora_rank: int | None  # None: queries come from one q_proj instead of q_a -> norm -> q_b
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool  # rope pairs are (x0, x1), (x2, x3)... rather than split halves
    softmax_scale: float  # qk_head_dim ** -0.5, times YaRN's mscale(mscale_all_dim) squared

    @property
    def cache_dim(self) -> int:
        """Numbers stored per token and layer: the latent then the rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], rope_scaling: dict[str, Any] | None) -> "MLAConfig | None":
        """The MLA settings of an HF config dict (None for other architectures); raises
        UnsupportedModelError for options the engine does not implement."""
        model_type = cfg.get("model_type", "")
        if model_type not in MLA_ARCHITECTURES:
            return None
        try:
            q_lora = cfg.get("q_lora_rank")
            nope, rope = int(cfg["qk_nope_head_dim"]), int(cfg["qk_rope_head_dim"])
            out = cls(
                q_lora_rank=int(q_lora) if q_lora else None,
                kv_lora_rank=int(cfg["kv_lora_rank"]),
                qk_nope_head_dim=nope,
                qk_rope_head_dim=rope,
                v_head_dim=int(cfg["v_head_dim"]),
                rope_interleave=bool(cfg.get("rope_interleave", True)),
                softmax_scale=(nope + rope) ** -0.5 * _mscale_squared(rope_scaling),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise UnsupportedModelError(f"{model_type}: config lacks a valid MLA entry ({exc})") from exc
        if rope % 2:
            raise UnsupportedModelError(f"{model_type}: qk_rope_head_dim {rope} is odd")
        kind = _rope_kind(rope_scaling)
        if kind not in MLA_ROPE_KINDS:
            raise UnsupportedModelError(
                f"{model_type}: rope scaling {kind!r} is not implemented (supported: {', '.join(MLA_ROPE_KINDS)})")
        if kind == "yarn":
            assert rope_scaling is not None
            for key in ("factor", "original_max_position_embeddings"):
                if rope_scaling.get(key) is None:
                    raise UnsupportedModelError(f"{model_type}: yarn rope scaling without {key!r}")
            if float(rope_scaling.get("partial_rotary_factor", 1.0)) != 1.0:
                raise UnsupportedModelError(f"{model_type}: partial_rotary_factor is not implemented")
        if cfg.get("attention_bias"):
            raise UnsupportedModelError(f"{model_type}: attention_bias=true is not implemented")
        return out


def _rope_kind(scaling: dict[str, Any] | None) -> str:
    if not scaling:
        return "default"
    return str(scaling.get("rope_type", scaling.get("type", "default")))


def _mscale_squared(scaling: dict[str, Any] | None) -> float:
    """transformers' ``yarn_apply_mscale``: with YaRN and ``mscale_all_dim`` set, the softmax
    scale grows by mscale(factor, mscale_all_dim) squared (once for q, once for k)."""
    if _rope_kind(scaling) == "default":
        return 1.0
    assert scaling is not None
    all_dim = scaling.get("mscale_all_dim") or 0
    if not all_dim:
        return 1.0
    m = yarn_mscale(float(scaling["factor"]), float(all_dim))
    return m * m
