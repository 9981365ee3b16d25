"""Model and engine configuration as plain dataclasses, read from a Hugging Face config dict."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = {"llama", "mistral", "qwen2"}


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture or one of its options is not implemented."""


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    sliding_window: int | None = None

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "ModelConfig":
        model_type = cfg.get("model_type", "")
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"unsupported architecture {model_type!r} (supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))})"
            )
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        scaling = cfg.get("rope_scaling") or None
        # transformers 5 folds rope_theta into rope_parameters; accept both spellings.
        params = cfg.get("rope_parameters") or {}
        theta = cfg.get("rope_theta", params.get("rope_theta", 10000.0))
        if scaling is None and params.get("rope_type", "default") != "default":
            scaling = dict(params)
        if scaling is not None:
            kind = scaling.get("rope_type", scaling.get("type", "default"))
            if kind not in ("default", "llama3", "linear"):
                raise UnsupportedModelError(f"unsupported rope scaling {kind!r} (supported: llama3, linear)")
        sliding = cfg.get("sliding_window") if cfg.get("use_sliding_window", model_type == "mistral") else None
        max_pos = int(cfg.get("max_position_embeddings", 2048))
        if sliding is not None and int(sliding) < max_pos:
            raise UnsupportedModelError(
                f"sliding-window attention (window {sliding} < context {max_pos}) is not implemented"
            )
        return cls(
            model_type=model_type,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases; Llama-family models declare it.
            attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
        )


@dataclass
class EngineConfig:
    """Knobs of the engine, independent of the model."""

    block_size: int = 16
    num_blocks: int | None = None  # None: derived from kv_cache_bytes
    kv_cache_bytes: int = 1 << 30
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048  # per-step token budget (decode tokens + prefill chunks)
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    # Pad small GEMMs so that a row's result does not depend on how many other rows share the
    # step (bitwise batch invariance on CPU BLAS; costs up to ~2x at batch 1, off by default).
    batch_invariant: bool = False
    extra: dict[str, Any] = field(default_factory=dict)
