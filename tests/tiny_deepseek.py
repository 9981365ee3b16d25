"""Tiny seeded random DeepSeek-V3 checkpoints (MLA + MoE), built and saved with transformers."""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

VOCAB = 97

# Shapes chosen so every MLA axis differs (C=16, dn=16 is the only pair alike on purpose: a
# mixed-up W_UK / W_UV would still break on dv=12), with 4 expert groups of 2 and top-2 groups.
_BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
             kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=16,
             n_group=4, topk_group=2, num_experts_per_tok=2, first_k_dense_replace=1, routed_scaling_factor=2.5,
             max_position_embeddings=256, rms_norm_eps=1e-5, rope_interleave=True, tie_word_embeddings=False,
             # Weights large enough that attention scores are O(1): a rope or scale error then
             # moves the logits far beyond the 1e-4 tolerance instead of hiding under it.
             initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=0)

VARIANTS: dict[str, dict] = {
    "moe": {},  # q LoRA, MoE from layer 1 with group-limited routing, interleaved rope
    "no_q_lora": dict(q_lora_rank=None),
    "dense": dict(first_k_dense_replace=3),  # every layer dense (MoE config present, unused)
    # Latents with rms ~1e-3, so the 1e-6 eps of q_a/kv_a_layernorm (not rms_norm_eps) matters.
    "small_latents": dict(_latent_scale=3e-3),
    "split_rope": dict(rope_interleave=False, tie_word_embeddings=True),
    "yarn": dict(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                  "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1,
                                  "mscale": 1.0, "mscale_all_dim": 0.707}),
}


def deepseek_config(variant: str = "moe", **overrides):
    import transformers as tf

    settings = {k: v for k, v in {**_BASE, **VARIANTS[variant], **overrides}.items() if not k.startswith("_")}
    return tf.DeepseekV3Config(**settings)


def build_tiny_deepseek(folder: Path, variant: str = "moe", seed: int = 0, **overrides):
    """Save a random DeepSeek-V3 into ``folder``; returns the transformers model (eval, fp32)."""
    import transformers as tf

    torch.manual_seed(seed)
    model = tf.DeepseekV3ForCausalLM(deepseek_config(variant, **overrides)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # norms away from 1, so a skipped or misplaced one shows
                p.add_(torch.randn_like(p) * 0.2)
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0, 1.0)  # spread router scores: no near-ties between experts
        scale = VARIANTS[variant].get("_latent_scale")
        if scale:
            rank = model.config.kv_lora_rank
            for layer in model.model.layers:
                layer.self_attn.q_a_proj.weight.mul_(scale)
                layer.self_attn.kv_a_proj_with_mqa.weight[:rank].mul_(scale)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # steers selection only, so it must matter
                b.copy_(torch.randn_like(b) * 0.5)
    model.save_pretrained(folder)
    return model
