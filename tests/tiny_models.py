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

    from kvbatch.engine.tokenizer import ChatTokenizer

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
