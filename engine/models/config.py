"""Model configuration as plain dataclasses, read from a Hugging Face config dict."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from kvbatch.engine.models.errors import UnsupportedModelError
from kvbatch.engine.models.family import FAMILIES
from kvbatch.engine.models.mla_config import MLA_ARCHITECTURES, MLAConfig

SUPPORTED_ARCHITECTURES = {"llama", "mistral", "qwen2", "mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3"}
# Architectures whose MLPs are (partly) mixtures of experts; MoEConfig.from_hf reads these.
MOE_ARCHITECTURES = {"mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3"}


@dataclass(frozen=True)
class MoEConfig:
    """How a mixture-of-experts MLP routes and what it holds, one spelling for every family.

    Routed output per token: ``sum_j w_j * expert_{id_j}(x)`` over the ``top_k`` chosen experts
    (SiLU-gated MLPs of ``moe_intermediate_size``), plus a shared expert when
    ``shared_expert_intermediate_size`` > 0 (scaled by ``sigmoid(shared_gate . x)`` when
    ``shared_expert_gate``). Scoring is ``softmax`` (Mixtral, Qwen) or ``sigmoid`` (DeepSeek-V3,
    which picks among the best ``topk_group`` of ``n_group`` expert groups, with a
    per-expert correction bias that steers selection only).
    """

    num_experts: int
    top_k: int
    moe_intermediate_size: int
    scoring: str = "softmax"  # "softmax" | "sigmoid" | "softmax_topk" (gpt-oss: softmax over the top-k logits)
    norm_topk_prob: bool = True  # renormalise the chosen weights to sum to 1
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    has_correction_bias: bool = False  # DeepSeek-V3's e_score_correction_bias
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    shared_expert_gate: bool = False  # Qwen2-MoE: sigmoid gate on the shared expert's output
    first_k_dense_replace: int = 0  # layers below this index are dense (DeepSeek)
    decoder_sparse_step: int = 1  # Qwen: every n-th layer is sparse
    mlp_only_layers: tuple[int, ...] = ()  # Qwen: layers kept dense
    # gpt-oss (declared by its Family.moe): the router's logits carry a bias; the experts' projections
    # carry biases; their activation is the clamped SwiGLU (up.clamp(-limit, limit) + 1) *
    # gate.clamp(max=limit) * sigmoid(alpha * gate.clamp(max=limit)) when swiglu_limit is set
    router_bias: bool = False
    expert_bias: bool = False
    swiglu_alpha: float = 1.0
    swiglu_limit: float | None = None

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` has a MoE MLP (the rule transformers applies)."""
        return (layer >= self.first_k_dense_replace and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "MoEConfig | None":
        """The MoE settings of an HF config dict; None for a dense architecture."""
        model_type = cfg.get("model_type", "")
        family = FAMILIES.get(model_type)
        if family is not None and family.moe is not None:
            return cls(**family.moe(cfg))
        if model_type not in MOE_ARCHITECTURES:
            return None
        if cfg.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"{model_type}: hidden_act {cfg.get('hidden_act')!r} (only silu)")
        # transformers 5 writes num_local_experts for some families where the hub has num_experts.
        experts = cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts")
        if not experts:
            raise UnsupportedModelError(f"{model_type}: config states no number of experts")
        top_k = int(cfg.get("num_experts_per_tok") or 0)
        if not 0 < top_k <= int(experts):
            raise UnsupportedModelError(f"{model_type}: num_experts_per_tok {top_k} not in 1..{experts}")
        common = dict(num_experts=int(experts), top_k=top_k)
        if model_type == "mixtral":
            return cls(**common, moe_intermediate_size=int(cfg["intermediate_size"]), norm_topk_prob=True)
        if model_type in ("qwen2_moe", "qwen3_moe"):
            shared = int(cfg.get("shared_expert_intermediate_size") or 0) if model_type == "qwen2_moe" else 0
            return cls(**common, moe_intermediate_size=int(cfg["moe_intermediate_size"]),
                       norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                       shared_expert_intermediate_size=shared, shared_expert_gate=shared > 0,
                       decoder_sparse_step=int(cfg.get("decoder_sparse_step") or 1),
                       mlp_only_layers=tuple(int(i) for i in cfg.get("mlp_only_layers") or ()))
        # deepseek_v3
        scoring = cfg.get("scoring_func", "sigmoid")
        method = cfg.get("topk_method", "noaux_tc")
        if scoring != "sigmoid" or method != "noaux_tc":
            raise UnsupportedModelError(
                f"deepseek_v3: routing {scoring}/{method} (only sigmoid scoring with noaux_tc top-k)")
        if int(cfg.get("moe_layer_freq") or 1) != 1:
            raise UnsupportedModelError("deepseek_v3: moe_layer_freq other than 1 is not implemented")
        n_group = int(cfg.get("n_group") or 1)
        if int(experts) % n_group:
            raise UnsupportedModelError(f"deepseek_v3: {experts} experts do not split into {n_group} groups")
        topk_group = int(cfg.get("topk_group") or 1)
        if top_k > topk_group * (int(experts) // n_group):
            raise UnsupportedModelError(
                f"deepseek_v3: top-{top_k} cannot be chosen from {topk_group} groups of {int(experts) // n_group}")
        inter = int(cfg["moe_intermediate_size"])
        return cls(**common, moe_intermediate_size=inter, scoring="sigmoid",
                   norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
                   routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
                   n_group=n_group, topk_group=topk_group, has_correction_bias=True,
                   shared_expert_intermediate_size=inter * int(cfg.get("n_shared_experts") or 0),
                   first_k_dense_replace=int(cfg.get("first_k_dense_replace") or 0))


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
    moe: MoEConfig | None = None  # None: every MLP is dense
    qk_norm: bool = False  # Qwen3: RMSNorm over each query/key head before rotary
    mla: MLAConfig | None = None  # DeepSeek-V3 multi-head latent attention; None: plain GQA
    rotary_dim: int = 0  # dims of each head that rotary turns (Phi: partial_rotary_factor); 0: all
    # Declared by a family (engine/models/family.py: Family and its ``settings``); Gemma 3 sets them all.
    layer_windows: tuple[int, ...] = ()  # per layer, the keys a token sees (itself included); 0: all; (): none
    local_rope_theta: float | None = None  # the sliding layers' rope base, unscaled; None: rope_theta
    attention_scale: float | None = None  # the softmax scale; None: head_dim ** -0.5
    hidden_act: str = "silu"  # the gated MLP's activation: "silu" or "gelu_pytorch_tanh"
    final_logit_softcap: float | None = None  # logits -> cap * tanh(logits / cap)
    norm_unit_offset: bool = False  # RMSNorm scales by (1 + weight), in fp32
    sandwich_norms: bool = False  # each sublayer's output normed too (Family.sandwich_norms)
    embedding_multiplier: float | None = None  # embeddings times this (sqrt(hidden_size)), in their dtype
    attention_sinks: bool = False  # gpt-oss: a learned logit per query head joins each softmax's denominator
    o_proj_bias: bool = False  # gpt-oss: o_proj has a bias too

    @property
    def rotary_dims(self) -> int:
        """How many leading dims of each query/key head rotary turns (the rest pass through)."""
        return self.rotary_dim or self.head_dim

    def window(self, layer: int) -> int:
        """The sliding window of decoder layer ``layer``: a token at position p attends keys
        ``p - window + 1 .. p`` (transformers' ``kv_idx > q_idx - sliding_window``); 0: all ``0 .. p``."""
        return self.layer_windows[layer] if self.layer_windows else 0

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
            # MLA models check their own rope kinds (MLAConfig.from_hf).
            if kind not in ("default", "llama3", "linear", "longrope", "yarn") and model_type not in MLA_ARCHITECTURES:
                raise UnsupportedModelError(
                    f"unsupported rope scaling {kind!r} (supported: llama3, linear, longrope, yarn)")
            if kind == "yarn" and not scaling.get("original_max_position_embeddings"):
                raise UnsupportedModelError("yarn rope scaling without original_max_position_embeddings")
        family = FAMILIES.get(model_type)
        # they apply any window they state
        sliding_default = model_type in ("mistral", "mixtral") or (family is not None and family.sliding_default)
        sliding = cfg.get("sliding_window") if cfg.get("use_sliding_window", sliding_default) else None
        max_pos = int(cfg.get("max_position_embeddings", 2048))
        if sliding is not None and int(sliding) < max_pos:
            raise UnsupportedModelError(
                f"sliding-window attention (window {sliding} < context {max_pos}) is not implemented"
            )
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        rotary_dim = 0
        if family is not None and family.partial_rotary:
            # transformers 5 moves it into rope_parameters
            factor = float(cfg.get("partial_rotary_factor") or params.get("partial_rotary_factor") or 1.0)
            rotary_dim = int(head_dim * factor)
            if not 0 < rotary_dim <= head_dim or rotary_dim % 2:
                raise UnsupportedModelError(
                    f"{model_type}: partial_rotary_factor {factor} gives {rotary_dim} of {head_dim} dims (need an even count)")
            rotary_dim = 0 if rotary_dim == head_dim else rotary_dim
        if scaling is not None and scaling.get("rope_type", scaling.get("type")) == "longrope":
            scaling = _longrope(scaling, cfg, rotary_dim or head_dim, max_pos)
        config = cls(
            model_type=model_type,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=_attention_bias(cfg),
            moe=MoEConfig.from_hf(cfg),
            qk_norm=model_type == "qwen3_moe" or (family is not None and family.qk_norm),
            mla=MLAConfig.from_hf(cfg, scaling),
            rotary_dim=rotary_dim,
        )
        if family is None:
            return config
        declared: dict[str, Any] = dict(norm_unit_offset=family.norm_unit_offset, sandwich_norms=family.sandwich_norms,
                                        embedding_multiplier=hidden ** 0.5 if family.embedding_scale else None)
        declared.update(family.settings(cfg) if family.settings is not None else {})
        return replace(config, **declared)


def _longrope(scaling: dict[str, Any], cfg: dict[str, Any], rotary_dims: int, max_pos: int) -> dict[str, Any]:
    """``scaling`` with ``original_max_position_embeddings`` in it (hub configs state it beside
    ``rope_scaling``) and ``factor`` (unstated: context / original, as transformers derives it, so a
    table of any length gets the same attention factor), once both factor lists are checked to hold
    one number per rotary pair."""
    original = scaling.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings")
    if not original or int(original) <= 0:
        raise UnsupportedModelError("longrope rope scaling without original_max_position_embeddings")
    for key in ("short_factor", "long_factor"):
        factors = scaling.get(key)
        if not isinstance(factors, list) or len(factors) != rotary_dims // 2:
            raise UnsupportedModelError(f"longrope {key} must list {rotary_dims // 2} numbers (one per rotary "
                                        f"pair of {rotary_dims} dims), got {factors!r:.80}")
    return dict(scaling, original_max_position_embeddings=int(original),
                factor=float(scaling.get("factor") or max_pos / int(original)))


def _attention_bias(cfg: dict[str, Any]) -> bool:
    """Whether q/k/v carry biases. Qwen2 always has them, Qwen2-MoE says so as ``qkv_bias``
    (default on); Llama-family models declare ``attention_bias``."""
    model_type = cfg.get("model_type", "")
    if model_type == "qwen2_moe":
        return bool(cfg.get("qkv_bias", True))
    bias = bool(cfg.get("attention_bias", model_type == "qwen2"))
    family = FAMILIES.get(model_type)
    if bias and (model_type == "qwen3_moe" or (family is not None and family.bias_refused)):
        raise UnsupportedModelError(f"{model_type} with attention_bias=true is not implemented")  # o_proj too
    return bias


# The families declared in their own modules register themselves (they import only family.py).
from kvbatch.engine.models import gemma3 as _gemma3  # noqa: F401
from kvbatch.engine.models import gpt_oss as _gpt_oss  # noqa: F401
from kvbatch.engine.models import phi3 as _phi3  # noqa: F401
from kvbatch.engine.models import qwen3 as _qwen3  # noqa: F401

SUPPORTED_ARCHITECTURES |= set(FAMILIES)
