"""Picks the model class for a checkpoint's architecture.

Every class has the same interface (``forward(input_ids, batch, kv_cache, num_layers=None)``,
``kv_cache_shape(num_blocks, block_size)``, ``config``, ``dtype``, ``batch_invariant`` and the
MoE hooks), so the runner, the KV connector and the engine never branch on the architecture.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping

import torch

from kvbatch.engine.models.config import ModelConfig
from kvbatch.engine.models.deepseek import DeepseekV3Model
from kvbatch.engine.models.fp8 import Fp8BlockWeight
from kvbatch.engine.models.llama import LlamaModel, huge_pages_wanted
from kvbatch.engine.models.moe import use_fp8_experts, use_mxfp4_experts
from kvbatch.engine.models.mxfp4 import Mxfp4Experts
from kvbatch.kernels.cpu.gguf_blocks import GGUFBlocks, layer_qtype
from kvbatch.kernels.cpu.gguf_kernels import BlockIndex, use_gguf_blocks
from kvbatch.kernels.cpu.kernel_choice import choose_kernels, dense_shapes
from kvbatch.kernels.cpu.linear import GGUF, use_linear_format


def build_model(config: ModelConfig, tensors: dict[str, torch.Tensor], dtype: torch.dtype,
                batch_invariant: bool = False, device: torch.device | str = "cpu",
                expert_ids: dict[int, list[int]] | None = None, linear: str = "auto",
                weights: str = "full", gguf_blocks: Mapping[str, GGUFBlocks] | None = None,
                fp8_weights: Mapping[str, Fp8BlockWeight] | None = None,
                mxfp4_experts: Mapping[str, Mxfp4Experts] | None = None) -> LlamaModel:
    """The model for ``config.model_type``: DeepSeek-V3 (multi-head latent attention) or the
    common decoder (Llama, Mistral, Qwen2 and the Mixtral / Qwen MoE variants, and every family
    registered in :mod:`~kvbatch.engine.models.family`, which differ from it only in what their
    ``ModelConfig`` declares: Qwen3, Phi-3, Gemma 3, gpt-oss), its weights on ``device``. ``expert_ids``: the experts a partial checkpoint holds, per layer
    (:attr:`~kvbatch.engine.models.weights.Checkpoint.expert_ids`).

    The dense projections' kernel is measured on this CPU (cached on disk) unless ``linear``
    forces one (:func:`~kvbatch.kernels.cpu.kernel_choice.choose_kernels`); ``weights="int8"``
    quantizes them to weight-only int8; ``weights="gguf"`` multiplies by the GGUF file's own blocks
    (``gguf_blocks``: :attr:`~kvbatch.engine.models.weights.Checkpoint.gguf_blocks`) in the buckets
    where that measured faster, and warns when it falls back to fp32. The choice is kept as
    ``model.kernel_choice``. On CUDA an FP8 checkpoint's experts (``fp8_weights``) and an MXFP4
    checkpoint's (``mxfp4_experts``: :attr:`~kvbatch.engine.models.weights.Checkpoint.mxfp4_experts`)
    stay quantized; elsewhere both are ignored."""
    blocks = dict(gguf_blocks or {}) if weights == "gguf" else {}
    # the kernels are timed on the pages the model streams: the Llama family's projections in huge
    # pages where they are wanted (DeepSeek's MLA weights stay in torch's)
    huge_pages = config.model_type != "deepseek_v3" and huge_pages_wanted(device)
    choice = choose_kernels(dtype, dense_shapes(tensors), num_layers=config.num_layers, linear=linear,
                            weights=weights, batch_invariant=batch_invariant, device=device,
                            gguf_qtype=layer_qtype(blocks), huge_pages=huge_pages)
    if choice.note:
        warnings.warn(choice.note, RuntimeWarning, stacklevel=2)
    index = BlockIndex(tensors, blocks) if blocks and choice.fmt.kind == GGUF else None
    # CUDA: an FP8 checkpoint's experts stay FP8 (moe.load_moe_layer); the CPU keeps today's dequantized ones
    on_cuda = torch.device(device).type == "cuda"
    fp8_experts = fp8_weights if on_cuda else None
    with use_linear_format(choice.fmt), use_gguf_blocks(index), use_fp8_experts(fp8_experts), \
            use_mxfp4_experts(mxfp4_experts if on_cuda else None):
        if config.model_type == "deepseek_v3":
            model: LlamaModel = DeepseekV3Model(config, tensors, dtype, batch_invariant, device, expert_ids,
                                                fp8_weights)
        else:
            model = LlamaModel(config, tensors, dtype, batch_invariant, device, expert_ids, fp8_weights)
    model.kernel_choice = choice  # type: ignore[attr-defined]
    return model
