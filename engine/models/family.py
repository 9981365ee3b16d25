"""Model families declared as their differences from the common (Llama) decoder, and their registry.

Torch-free and importing nothing of the engine, so each family module (and ``config``) can import it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Family:
    """A decoder family that differs from the common (Llama) decoder only in what it declares here.

    One module per family (``engine/models/qwen3.py``, ``phi3.py``) builds one of these and calls
    :func:`register_family`, and ``config.py`` imports that module; the config, the checkpoint loader
    and the factory (the common decoder, :class:`~kvbatch.engine.models.llama.LlamaModel`) then accept it.

    ``architecture``/``model_type``: the HF class name and ``model_type`` of its config.json.
    ``qk_norm``: RMSNorm over each query and key head before rotary (``self_attn.q_norm``/``k_norm``).
    ``partial_rotary``: read ``partial_rotary_factor`` (rotary over the first part of each head).
    ``sliding_default``: whether a stated ``sliding_window`` applies without ``use_sliding_window``.
    ``bias_refused``: ``attention_bias`` would bias o_proj too (not implemented), so it is refused.
    ``convert_tensors``: ``(tensors, config) -> tensors`` at load, before the fingerprint: the
    family's checkpoint names into the common decoder's (fused projections split), on the CPU.

    The options below are general mechanisms of the common decoder that a family switches on
    (Gemma 3 all of them; a later family any of them):
    ``norm_unit_offset``: every RMSNorm scales by ``1 + weight``, computed in fp32 and rounded once.
    ``sandwich_norms``: a norm on each sublayer's output too, before its residual add: the
    checkpoint's ``post_attention_layernorm`` then normalizes the attention output,
    ``pre_feedforward_layernorm`` the MLP input and ``post_feedforward_layernorm`` the MLP output.
    ``embedding_scale``: the embeddings are multiplied by ``sqrt(hidden_size)``, rounded to their dtype.
    ``layer_tensors``: per-layer weights the loader requires besides the common decoder's
    (names under ``model.layers.N.``).
    ``settings``: ``(hf config) -> {ModelConfig field: value}``, the family's own config keys read
    into the common decoder's declared settings (per-layer sliding windows ``layer_windows``, the
    sliding layers' rope base ``local_rope_theta``, ``attention_scale``, ``hidden_act``,
    ``final_logit_softcap``, ``attention_sinks``, ``o_proj_bias``, ...); it raises
    ``UnsupportedModelError`` for what is not implemented.
    ``moe``: ``(hf config) -> {MoEConfig field: value}``, the family's mixture-of-experts MLPs (every
    layer's, gpt-oss: router bias, softmax over the top-k logits, biased clamped SwiGLU experts);
    None: dense MLPs.
    """

    architecture: str
    model_type: str
    qk_norm: bool = False
    partial_rotary: bool = False
    sliding_default: bool = False
    bias_refused: bool = False
    convert_tensors: Callable[[dict[str, Any], dict[str, Any]], dict[str, Any]] | None = None
    norm_unit_offset: bool = False
    sandwich_norms: bool = False
    embedding_scale: bool = False
    layer_tensors: tuple[str, ...] = ()
    settings: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    moe: Callable[[dict[str, Any]], dict[str, Any]] | None = None


# model_type -> its Family, filled by the family modules (engine/models/config.py imports them all).
FAMILIES: dict[str, Family] = {}


def register_family(family: Family) -> Family:
    """Make ``family`` loadable: the config (``config.SUPPORTED_ARCHITECTURES``) and the checkpoint
    loader (``weights.SUPPORTED_ARCHITECTURES``, by HF class name) read FAMILIES."""
    FAMILIES[family.model_type] = family
    return family
