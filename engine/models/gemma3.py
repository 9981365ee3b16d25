"""Gemma 3 text (``Gemma3ForCausalLM``, ``model_type`` ``gemma3_text``): the common decoder with
every Gemma difference declared, none of it a copy of the decoder.

- RMSNorm scales by ``1 + weight`` in fp32 (``norm_unit_offset``), over the hidden state, over each
  query and key head (``qk_norm``) and around each sublayer (``sandwich_norms``: the checkpoint's
  ``post_attention_layernorm`` norms the attention output, ``pre_feedforward_layernorm`` and
  ``post_feedforward_layernorm`` the MLP's input and output);
- the embeddings are multiplied by ``sqrt(hidden_size)`` rounded to their dtype (``embedding_scale``);
  the head is the embedding matrix itself (tied), unscaled;
- the softmax scale is ``query_pre_attn_scalar ** -0.5``; the MLP is ``gelu_pytorch_tanh``-gated;
- sliding layers (``layer_types``, or every layer but each ``sliding_window_pattern``-th in older
  configs) see the last ``sliding_window`` keys, the current one included, and turn q/k with the
  unscaled ``rope_local_base_freq`` rotary; full layers see every key and use ``rope_theta`` with
  ``rope_scaling`` (linear, factor 8, on the 4B and larger);
- ``final_logit_softcapping`` applies when set; ``attn_logit_softcapping`` (Gemma 2) and
  bidirectional attention (EmbeddingGemma) are refused.
"""

from __future__ import annotations

from typing import Any

from kvbatch.engine.models.errors import UnsupportedModelError
from kvbatch.engine.models.family import Family, register_family

SLIDING, FULL = "sliding_attention", "full_attention"
ROPE_KINDS = ("default", "linear", "llama3")


def _rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None, float]:
    """(full layers' rope base, their scaling or None, sliding layers' rope base), from either
    spelling: transformers 5's ``rope_parameters`` keyed by layer type, or the hub's ``rope_theta``,
    ``rope_scaling`` and ``rope_local_base_freq``."""
    params = cfg.get("rope_parameters") or {}
    full = params.get(FULL) if isinstance(params.get(FULL), dict) else None
    local = params.get(SLIDING) if isinstance(params.get(SLIDING), dict) else None
    if full is not None:
        theta = float(full.get("rope_theta", 1_000_000.0))
        scaling: dict[str, Any] | None = {k: v for k, v in full.items() if k != "rope_theta"}
    else:
        theta = float(cfg.get("rope_theta") or 1_000_000.0)
        scaling = cfg.get("rope_scaling") or None
    if scaling is not None and scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind not in ROPE_KINDS:
        raise UnsupportedModelError(f"gemma3_text: unsupported rope scaling {kind!r} (supported: llama3, linear)")
    if local is not None and local.get("rope_type", "default") != "default":
        raise UnsupportedModelError(f"gemma3_text: sliding layers' rope {local.get('rope_type')!r} (only default)")
    local_theta = float((local or {}).get("rope_theta", cfg.get("rope_local_base_freq") or 10_000.0))
    return theta, scaling, local_theta


def layer_types(cfg: dict[str, Any]) -> list[str]:
    """Each layer's attention kind: ``layer_types`` as stated, else transformers' rule for older
    configs (layer i slides unless ``(i + 1) % sliding_window_pattern == 0``; pattern 6 by default)."""
    n = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types")
    if types is None:
        pattern = int(cfg.get("sliding_window_pattern") or 6)
        types = [SLIDING if (i + 1) % pattern else FULL for i in range(n)]
    types = list(types)
    if len(types) != n or any(t not in (SLIDING, FULL) for t in types):
        raise UnsupportedModelError(
            f"gemma3_text: layer_types must name {n} layers, each {SLIDING!r} or {FULL!r}, got {types}")
    return types


def gemma3_settings(cfg: dict[str, Any]) -> dict[str, Any]:
    """The common decoder's settings for a Gemma 3 text config (see the module docstring)."""
    if cfg.get("attn_logit_softcapping") is not None:
        raise UnsupportedModelError("gemma3_text: attn_logit_softcapping is not implemented (Gemma 3 leaves it unset)")
    if cfg.get("use_bidirectional_attention"):
        raise UnsupportedModelError("gemma3_text: use_bidirectional_attention is not implemented")
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise UnsupportedModelError(f"gemma3_text: hidden_activation {act!r} (only gelu_pytorch_tanh)")
    types = layer_types(cfg)
    window = cfg.get("sliding_window")
    if SLIDING in types and (window is None or int(window) <= 0):
        raise UnsupportedModelError(f"gemma3_text: sliding layers need a positive sliding_window, got {window!r}")
    theta, scaling, local_theta = _rope(cfg)
    cap = cfg.get("final_logit_softcapping")
    return dict(
        layer_windows=tuple(int(window) if t == SLIDING else 0 for t in types),
        rope_theta=theta, rope_scaling=scaling, local_rope_theta=local_theta,
        attention_scale=float(cfg.get("query_pre_attn_scalar") or 256) ** -0.5,
        hidden_act="gelu_pytorch_tanh",
        final_logit_softcap=None if cap is None else float(cap),
    )


GEMMA3 = register_family(Family(
    architecture="Gemma3ForCausalLM", model_type="gemma3_text", qk_norm=True, bias_refused=True,
    norm_unit_offset=True, sandwich_norms=True, embedding_scale=True,
    layer_tensors=("pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight"),
    settings=gemma3_settings))
