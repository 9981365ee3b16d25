"""Phi-3 and Phi-4 (``Phi3ForCausalLM``): the common decoder with fused checkpoint projections and
partial rotary.

The checkpoint holds ``self_attn.qkv_proj`` ([(Hq + 2 Hkv) D, H]: q rows, then k, then v) and
``mlp.gate_up_proj`` ([2 I, H]: gate rows, then up); they are split at load into the common
decoder's ``q/k/v_proj`` and ``gate/up_proj`` (which the decoder fuses again its own way), so the
fingerprint, the kernel choice and the model see one naming. ``partial_rotary_factor`` (Phi-4-mini:
0.75) turns only the first part of each head (:attr:`ModelConfig.rotary_dims`). A stated
``sliding_window`` applies as transformers applies it (shorter than the context: refused, as
sliding windows are not implemented). ``longrope`` scaling (Phi-3-*-128k, Phi-3.5, Phi-4-mini) is
the rotary table's (:func:`~kvbatch.engine.models.rope.cos_sin_table`): short factors below
``original_max_position_embeddings``, long factors from there on, keyed by position.
"""

from __future__ import annotations

from typing import Any

from kvbatch.engine.models.family import Family, register_family


def split_fused(tensors: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """``tensors`` with every ``qkv_proj``/``gate_up_proj`` split into the common decoder's names
    (row slices, copied so the fused tensor is freed); a wrongly shaped one raises ValueError."""
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    inter = int(config["intermediate_size"])
    out: dict[str, Any] = {}
    for name, t in tensors.items():
        if name.endswith(("self_attn.qkv_proj.weight", "self_attn.qkv_proj.bias")):
            prefix, kind = name.rsplit(".qkv_proj.", 1)
            sizes = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
            parts = ("q", "k", "v")
        elif name.endswith("mlp.gate_up_proj.weight"):
            prefix, kind = name.rsplit(".gate_up_proj.", 1)
            sizes, parts = [inter, inter], ("gate", "up")
        else:
            out[name] = t
            continue
        if t.shape[0] != sum(sizes):
            raise ValueError(f"{name} has {t.shape[0]} rows, the config says {sum(sizes)}")
        for part, piece in zip(parts, t.split(sizes)):
            out[f"{prefix}.{part}_proj.{kind}"] = piece.clone()
    return out


PHI3 = register_family(Family(architecture="Phi3ForCausalLM", model_type="phi3", partial_rotary=True,
                              sliding_default=True, convert_tensors=split_fused))
