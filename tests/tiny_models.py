"""Tiny seeded random checkpoints of each supported architecture, built with transformers."""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

VOCAB = 97


def _config(arch: str):
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if arch == "llama":
        return tf.LlamaConfig(**common, rope_theta=10000.0, tie_word_embeddings=False)
    if arch == "llama3":  # llama3 rope scaling, tied embeddings, MHA
        c = dict(common, num_key_value_heads=4)
        return tf.LlamaConfig(**c, tie_word_embeddings=True, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    if arch == "mistral":
        return tf.MistralConfig(**common, sliding_window=None, rope_theta=10000.0)
    if arch == "qwen2":  # attention bias on q/k/v
        return tf.Qwen2Config(**common, rope_theta=10000.0, use_sliding_window=False, tie_word_embeddings=True)
    raise ValueError(arch)


ARCHS = ["llama", "llama3", "mistral", "qwen2"]


def build_tiny(arch: str, folder: Path, seed: int = 0):
    """Save a random model of ``arch`` into ``folder``; returns the transformers model (eval, fp32)."""
    import transformers as tf

    torch.manual_seed(seed)
    cfg = _config(arch)
    cls = {"llama": tf.LlamaForCausalLM, "llama3": tf.LlamaForCausalLM, "mistral": tf.MistralForCausalLM,
           "qwen2": tf.Qwen2ForCausalLM}[arch]
    model = cls(cfg).eval()
    with torch.no_grad():  # random biases, so a dropped bias cannot go unnoticed
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(folder)
    return model


def build_tiny_chat_model(folder: Path, seed: int = 0, max_positions: int = 256) -> Path:
    """A tiny random Llama that speaks SmolLM2's tokenizer and chat template, for end-to-end
    tests of the command line and the pipeline (loads in well under a second)."""
    import json

    import transformers as tf

    from kvbatch.engine.text.tokenizer import ChatTokenizer

    tok = ChatTokenizer.from_model("smollm2-135m")
    torch.manual_seed(seed)
    cfg = tf.LlamaConfig(vocab_size=tok.vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                         rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)
    tf.LlamaForCausalLM(cfg).eval().save_pretrained(folder)
    (folder / "tokenizer.json").write_text(tok._tok.to_str())
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": tok.chat_template, "bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
        "pad_token": "<|im_end|>", "unk_token": "<|endoftext|>"}))
    return folder


# ---------------------------------------------------------------- mixture-of-experts

MOE_ARCHS = ["mixtral", "qwen2_moe", "qwen3_moe"]
NUM_EXPERTS = 8
HOT_EXPERTS = (0, 1)  # the experts build_tiny_moe(skew > 0) makes the router prefer
_HOT_DIM = 0  # the hidden coordinate every token shares when skewed


def _moe_config(arch: str):
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0, rope_theta=10000.0,
                  num_experts_per_tok=2)
    if arch == "mixtral":  # experts of intermediate_size, always renormalised
        return tf.MixtralConfig(**common, num_local_experts=NUM_EXPERTS, sliding_window=None,
                                tie_word_embeddings=False)
    if arch == "qwen2_moe":  # q/k/v biases, a shared expert behind a sigmoid gate, raw top-k weights
        return tf.Qwen2MoeConfig(**common, num_experts=NUM_EXPERTS, moe_intermediate_size=32,
                                 shared_expert_intermediate_size=48, norm_topk_prob=False, qkv_bias=True,
                                 use_sliding_window=False, tie_word_embeddings=True)
    if arch == "qwen3_moe":  # q/k norms, renormalised top-k, layer 1 dense
        return tf.Qwen3MoeConfig(**common, num_experts=NUM_EXPERTS, moe_intermediate_size=32, head_dim=16,
                                 norm_topk_prob=True, mlp_only_layers=[1], use_sliding_window=False,
                                 tie_word_embeddings=False)
    raise ValueError(arch)


def build_tiny_moe(arch: str, folder: Path, seed: int = 0, skew: float = 0.0):
    """Save a random MoE model of ``arch`` (8 experts, top-2, 3 layers) into ``folder``;
    returns the transformers model (eval, fp32).

    ``skew`` > 0 makes every router prefer ``HOT_EXPERTS``: every token's embedding gets a
    shared component on one hidden coordinate and the hot experts' router rows a weight of
    ``skew`` on it, so their logits rise for all tokens alike (skew 4 sends most choices there).
    """
    import transformers as tf

    torch.manual_seed(seed)
    cfg = _moe_config(arch)
    cls = {"mixtral": tf.MixtralForCausalLM, "qwen2_moe": tf.Qwen2MoeForCausalLM,
           "qwen3_moe": tf.Qwen3MoeForCausalLM}[arch]
    model = cls(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith("mlp.gate.weight") or name.endswith("shared_expert_gate.weight"):
                # Routers start near zero: spread their logits so no two experts nearly tie
                # (a near-tie would flip on rounding noise and make parity tests flaky).
                p.copy_(torch.randn_like(p))
        if skew:
            model.model.embed_tokens.weight[:, _HOT_DIM] = 2.0
            for layer in model.model.layers:
                gate = getattr(layer.mlp, "gate", None)
                if gate is not None and gate.weight.shape[0] == NUM_EXPERTS:  # dense layers have no router
                    gate.weight[list(HOT_EXPERTS), _HOT_DIM] += skew
    model.save_pretrained(folder)
    return model


def edit_weights(folder: Path, edit) -> None:
    """Rewrite ``folder``'s ``model.safetensors`` after ``edit(tensors)`` changed the dict in place:
    a test's broken checkpoint (a tensor deleted, one of the wrong shape)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
