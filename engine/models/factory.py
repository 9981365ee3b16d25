"""Picks the model class for a checkpoint's architecture.

Every class has the same interface (``forward(input_ids, batch, kv_cache, num_layers=None)``,
``kv_cache_shape(num_blocks, block_size)``, ``config``, ``dtype``, ``batch_invariant`` and the
MoE hooks), so the runner, the KV connector and the engine never branch on the architecture.
"""

from __future__ import annotations

import torch

from kvbatch.engine.models.config import ModelConfig
from kvbatch.engine.models.deepseek import DeepseekV3Model
from kvbatch.engine.models.llama import LlamaModel


def build_model(config: ModelConfig, tensors: dict[str, torch.Tensor], dtype: torch.dtype,
                batch_invariant: bool = False) -> LlamaModel:
    """The model for ``config.model_type``: DeepSeek-V3 (multi-head latent attention) or the
    Llama family (Llama, Mistral, Qwen2 and the Mixtral / Qwen MoE variants)."""
    if config.model_type == "deepseek_v3":
        return DeepseekV3Model(config, tensors, dtype, batch_invariant)
    return LlamaModel(config, tensors, dtype, batch_invariant)
