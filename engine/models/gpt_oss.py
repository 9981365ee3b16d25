"""gpt-oss (``GptOssForCausalLM``, ``model_type`` ``gpt_oss``): the common decoder with every gpt-oss
difference declared, none of it a copy of the decoder.

- attention **sinks**: a learned logit per query head (``self_attn.sinks``) joins every softmax's
  denominator, not its numerator (the softmax's maximum includes it), in every attention path
  (``ModelConfig.attention_sinks``; the kernels' ``sinks`` argument);
- sliding and full layers alternate (``layer_types``, else even layers slide, as transformers
  fills it); a sliding layer sees the last ``sliding_window`` keys, the current one included;
- q/k/v **and** o_proj carry biases (``attention_bias``);
- yarn rope scaling (:func:`~kvbatch.engine.models.rope.yarn_inverse_frequencies`), the same on every layer;
- every MLP is a mixture of experts: the router has a bias, picks the top-k logits and takes the
  softmax over those k only; each expert is a biased, clamped SwiGLU (``swiglu_alpha``,
  ``swiglu_limit``) whose ``gate_up_proj`` interleaves gate and up columns;
- experts published as MXFP4 (``quantization_config.quant_method: mxfp4``: ``*_blocks`` and
  ``*_scales``) are dequantized at load (:mod:`~kvbatch.engine.models.mxfp4`); for CUDA they are
  also kept as published, in the layouts below (``mxfp4.keep_mxfp4_experts``).

At load (:func:`convert_gpt_oss`) the checkpoint's names and layouts become the common decoder's:
``mlp.router`` -> ``mlp.gate``; ``experts.gate_up_proj`` [E, H, 2 I] (gate, up interleaved) ->
[E, 2 I, H] gate rows then up rows, its bias likewise; ``experts.down_proj`` [E, I, H] -> [E, H, I].
"""

from __future__ import annotations

from typing import Any

from kvbatch.engine.models.errors import UnsupportedModelError
from kvbatch.engine.models.family import Family, register_family

SLIDING, FULL = "sliding_attention", "full_attention"


def layer_types(cfg: dict[str, Any]) -> list[str]:
    """Each layer's attention kind: ``layer_types`` as stated, else transformers' rule (layer i
    slides when i is even)."""
    n = int(cfg["num_hidden_layers"])
    types = list(cfg.get("layer_types") or [SLIDING if (i + 1) % 2 else FULL for i in range(n)])
    if len(types) != n or any(t not in (SLIDING, FULL) for t in types):
        raise UnsupportedModelError(f"gpt_oss: layer_types must name {n} layers, each {SLIDING!r} or {FULL!r}")
    return types


def gpt_oss_settings(cfg: dict[str, Any]) -> dict[str, Any]:
    """The common decoder's settings for a gpt-oss config (see the module docstring)."""
    types = layer_types(cfg)
    window = cfg.get("sliding_window")
    if SLIDING in types and (window is None or int(window) <= 0):
        raise UnsupportedModelError(f"gpt_oss: sliding layers need a positive sliding_window, got {window!r}")
    if not cfg.get("attention_bias", True):
        raise UnsupportedModelError("gpt_oss with attention_bias=false is not implemented (every checkpoint has them)")
    return {"layer_windows": tuple(int(window) if t == SLIDING else 0 for t in types),
            "attention_sinks": True, "o_proj_bias": True}


def gpt_oss_moe(cfg: dict[str, Any]) -> dict[str, Any]:
    """The :class:`~kvbatch.engine.models.config.MoEConfig` fields of a gpt-oss config."""
    experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
    top_k = int(cfg.get("num_experts_per_tok") or 0)
    if not 0 < top_k <= experts:
        raise UnsupportedModelError(f"gpt_oss: num_experts_per_tok {top_k} not in 1..{experts}")
    return {"num_experts": experts, "top_k": top_k, "moe_intermediate_size": int(cfg["intermediate_size"]),
            "scoring": "softmax_topk", "router_bias": True, "expert_bias": True,
            "swiglu_alpha": float(cfg.get("swiglu_alpha", 1.702)), "swiglu_limit": float(cfg.get("swiglu_limit", 7.0))}


def _cat_halves(t: Any, dim: int) -> Any:
    """The entries of ``t`` along ``dim`` reordered: the even ones (gate), then the odd ones (up),
    in one new tensor (the family modules import torch only where they touch tensors)."""
    import torch

    idx = torch.arange(t.shape[dim])
    return t.index_select(dim, torch.cat((idx[0::2], idx[1::2])))


def convert_gpt_oss(tensors: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """``tensors`` with gpt-oss's router and expert tensors in the common decoder's names and layouts
    (module docstring); a wrongly shaped one raises ValueError naming it."""
    hidden, inter = int(config["hidden_size"]), int(config["intermediate_size"])
    out: dict[str, Any] = {}
    for name, t in tensors.items():
        if ".mlp.router." in name:
            out[name.replace(".mlp.router.", ".mlp.gate.")] = t
        elif name.endswith("mlp.experts.gate_up_proj"):
            if tuple(t.shape[1:]) != (hidden, 2 * inter):
                raise ValueError(f"{name} has shape {tuple(t.shape)}, the config says [E, {hidden}, {2 * inter}]")
            out[name] = _cat_halves(t.transpose(1, 2), 1)
        elif name.endswith("mlp.experts.gate_up_proj_bias"):
            out[name] = _cat_halves(t, 1)
        elif name.endswith("mlp.experts.down_proj"):
            if tuple(t.shape[1:]) != (inter, hidden):
                raise ValueError(f"{name} has shape {tuple(t.shape)}, the config says [E, {inter}, {hidden}]")
            out[name] = t.transpose(1, 2).contiguous()
        else:
            out[name] = t
    return out


GPT_OSS = register_family(Family(
    architecture="GptOssForCausalLM", model_type="gpt_oss", convert_tensors=convert_gpt_oss,
    layer_tensors=("self_attn.sinks", "self_attn.o_proj.bias", "mlp.gate.bias",
                   "mlp.experts.gate_up_proj_bias", "mlp.experts.down_proj_bias"),
    settings=gpt_oss_settings, moe=gpt_oss_moe))
